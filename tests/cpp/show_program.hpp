// Programs as text for the schedule tests: "F0.1 L1.1 ..." per worker, joined by " | ".
#pragma once

#include <string>
#include <vector>

#include "gpipe_fast/action.hpp"
#include "gpipe_fast/generators.hpp"

namespace show_program {

// An action's letters: F R B I W L for compute, sF rF sB rB AR for communication.
inline std::string letter(gpipe_fast::ActionId id) {
  namespace action = gpipe_fast::action;
  switch (id) {
    case action::Forward: return "F";
    case action::Recompute: return "R";
    case action::Backward: return "B";
    case action::BackwardInput: return "I";
    case action::BackwardWeight: return "W";
    case action::Loss: return "L";
    case action::SendForward: return "sF";
    case action::RecvForward: return "rF";
    case action::SendBackward: return "sB";
    case action::RecvBackward: return "rB";
    case action::ReduceGrad: return "AR";
    default: return "?";
  }
}

// One worker's order: stage.micro-batch after the action's letters, space-separated.
inline std::string show(const std::vector<gpipe_fast::TaskKey>& order) {
  std::string out;
  for (const gpipe_fast::TaskKey& k : order) {
    if (!out.empty()) out += " ";
    out += letter(k.action) + std::to_string(k.stage) + "." + std::to_string(k.microbatch);
  }
  return out;
}

// Every worker's order, joined by " | ".
inline std::string show(const gpipe_fast::Program& program) {
  std::string out;
  for (std::size_t w = 0; w < program.size(); ++w) {
    if (w) out += " | ";
    out += show(program[w]);
  }
  return out;
}

}  // namespace show_program
