// The open set of actions a task performs, each with the rule naming what must finish first.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gpipe_fast {

using ActionId = int;

// The built-in actions. Their ids are fixed so generators can name them; more can be
// registered at run time (register_action), and the runtime treats every id alike.
namespace action {
inline constexpr ActionId Forward = 0;
inline constexpr ActionId Recompute = 1;
inline constexpr ActionId Backward = 2;
inline constexpr ActionId BackwardInput = 3;   // gradient of the stage's input only
inline constexpr ActionId BackwardWeight = 4;  // gradient of the stage's weights only
inline constexpr ActionId Loss = 5;            // the loss of one micro-batch, last stage only
inline constexpr ActionId SendForward = 6;     // an activation to the next stage's process
inline constexpr ActionId RecvForward = 7;     // an activation from the previous stage's process
inline constexpr ActionId SendBackward = 8;    // a gradient to the previous stage's process
inline constexpr ActionId RecvBackward = 9;    // a gradient from the next stage's process
inline constexpr ActionId ReduceGrad = 10;     // a stage's gradients averaged over data parallelism
// Skip connections between processes: each pair of stages a skip joins gets its own message
// per micro-batch, past the stages in between.
inline constexpr ActionId SendSkips = 11;      // what a stage stashed, to the popping stages' processes
inline constexpr ActionId RecvSkips = 12;      // what a stage pops, from the stashing stages' processes
inline constexpr ActionId SendSkipGrads = 13;  // the popped skips' gradients, back to the stashers
inline constexpr ActionId RecvSkipGrads = 14;  // the stashed skips' gradients, from the poppers
}  // namespace action

// One task's identity: what it does, to which stage, on which micro-batch.
struct TaskKey {
  ActionId action = action::Forward;
  int stage = 0;
  int microbatch = 0;
  bool operator==(const TaskKey& other) const {
    return action == other.action && stage == other.stage && microbatch == other.microbatch;
  }
};

// One prerequisite of a task: the first of `any_of` that the schedule holds. When none is
// there, a required need makes the schedule invalid unless its action is given (done before
// the run, as the forwards are for a backward-only run); an optional one is dropped.
struct Need {
  std::vector<TaskKey> any_of;
  bool required = true;
};

// What `task` needs in a schedule of `stages` stages and `microbatches` micro-batches: the
// rule of its action.
using NeedsRule = std::function<std::vector<Need>(const TaskKey& task, int stages, int microbatches)>;

// What a task of an action costs, as a kind of work: the simulator prices it from the
// stage's cost of that kind (a recompute is a forward again), and unit_cost() is its price
// when every stage costs the same (a forward 1, a backward 2, each half of it 1).
enum class CostClass { None, Forward, Backward, BackwardInput, BackwardWeight, Loss };

// "none" | "forward" | "backward" | "backward_input" | "backward_weight" | "loss".
const char* cost_class_name(CostClass cost);
CostClass parse_cost_class(const std::string& name);  // InvalidArgument naming `cost`
double unit_cost(CostClass cost);

// What travels between processes: a stage's output (and the skips its forward stashes for
// later stages), the gradients going back, and a stage's gradients summed over data
// parallelism.
enum class Message { None, Activation, Skips, Gradient, SkipGradients, ReducedGradients };

// "none" | "activation" | "skips" | "gradient" | "skip_gradients" | "reduced_gradients".
const char* message_name(Message message);
Message parse_message(const std::string& name);  // InvalidArgument naming the message

// What an action's tasks exchange with other processes: lowering reads these facts, not
// action ids, to place sends and receives. A communication action `sends` or `receives` a
// message; a compute action `produces` a message for a neighbouring stage (a send of it
// follows the task when that stage runs elsewhere) and `consumes` one (its receive comes
// first). An Activation travels with its Skips, a Gradient with its SkipGradients.
struct Wire {
  Message sends = Message::None;
  Message receives = Message::None;
  Message produces = Message::None;
  Message consumes = Message::None;
};

struct ActionInfo {
  std::string name;  // snake_case; Python dispatches on it (its handler, by name)
  NeedsRule needs;
  // Communication (send, recv, reduce) runs on a process's communication worker, not on
  // its stage's compute worker, so that it overlaps with compute.
  bool communication = false;
  CostClass cost = CostClass::None;
  Wire wire;
};

// Adds an action and returns its id; InvalidArgument if the name is taken, empty or not
// snake_case ([a-z][a-z0-9_]*: Python looks the stage's method up by it).
ActionId register_action(const std::string& name, NeedsRule needs, bool communication = false,
                         CostClass cost = CostClass::None, Wire wire = {});
const ActionInfo& action_info(ActionId id);  // InvalidArgument for an unknown id
std::optional<ActionId> find_action(const std::string& name);
int action_count();

// A need written as data, for rules given from Python (no callback into the interpreter,
// nothing to outlive it): the first of `any_of` that the schedule holds, each an action (by
// name; the action being registered may name itself) on the stage `offset` stages from the
// task's, on the task's own micro-batch, or with `every_microbatch` one such need per
// micro-batch of the step. An alternative whose stage lies outside the pipeline is left
// out, and a need left with none is dropped: the first stage has no previous stage to wait
// for.
struct NeedSpec {
  std::vector<std::pair<std::string, int>> any_of;  // (action, stage offset)
  bool every_microbatch = false;
  bool required = true;
};

// Adds an action whose rule is `needs`; InvalidArgument as above, or for a need naming no
// action, an unknown action, or an offset beyond +-(1 << 20).
ActionId register_action(const std::string& name, const std::vector<NeedSpec>& needs,
                         bool communication = false, CostClass cost = CostClass::None,
                         Wire wire = {});

// The first action registered that sends (receives) `message`; InvalidArgument if none does.
ActionId sender_of(Message message);
ActionId receiver_of(Message message);

// "forward(stage 1, micro-batch 3)".
std::string describe(const TaskKey& task);

}  // namespace gpipe_fast
