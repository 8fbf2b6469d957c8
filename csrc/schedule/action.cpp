// The action registry: built-in actions with their dependency rules, open to more.
#include "gpipe_fast/action.hpp"

#include <algorithm>
#include <deque>
#include <mutex>
#include <utility>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {
namespace {

using namespace action;

// A forward also waits for the skips it pops from other processes, where the schedule
// receives any (an optional need: a stage without such skips has no RecvSkips task).
std::vector<Need> forward_needs(const TaskKey& t, int, int) {
  const Need skips{{{RecvSkips, t.stage, t.microbatch}}, false};
  if (t.stage == 0) return {skips};
  return {{{{RecvForward, t.stage, t.microbatch}, {Forward, t.stage - 1, t.microbatch}}}, skips};
}

std::vector<Need> own_forward(const TaskKey& t, int, int) {
  return {{{{Forward, t.stage, t.microbatch}}}};
}

// Backward and BackwardInput: the output's gradient (the loss on the last stage), the
// stage's own forward, and its recompute when it has one.
std::vector<Need> backward_needs(const TaskKey& t, int stages, int) {
  const int s = t.stage;
  const int m = t.microbatch;
  Need gradient;
  if (s == stages - 1) {
    gradient.any_of = {{Loss, s, m}};
  } else {
    gradient.any_of = {{RecvBackward, s, m}, {Backward, s + 1, m}, {BackwardInput, s + 1, m}};
  }
  return {gradient, {{{Forward, s, m}}}, Need{{{Recompute, s, m}}, false},
          Need{{{RecvSkipGrads, s, m}}, false}};
}

std::vector<Need> weight_needs(const TaskKey& t, int, int) {
  return {{{{BackwardInput, t.stage, t.microbatch}}}};
}

std::vector<Need> send_backward_needs(const TaskKey& t, int, int) {
  return {{{{Backward, t.stage, t.microbatch}, {BackwardInput, t.stage, t.microbatch}}}};
}

// A receive is matched by its sender on another process: a dependency only in a schedule
// that holds both (the all-process schedule a dry run checks), dropped in one process's own.
std::vector<Need> recv_forward_needs(const TaskKey& t, int, int) {
  if (t.stage == 0) return {};
  return {Need{{{SendForward, t.stage - 1, t.microbatch}}, false}};
}

std::vector<Need> recv_backward_needs(const TaskKey& t, int stages, int) {
  if (t.stage == stages - 1) return {};
  return {Need{{{SendBackward, t.stage + 1, t.microbatch}}, false}};
}

// A skip receive's senders depend on the model (which stages its skips join): lowering adds
// them per task (lower.hpp), so the rule itself names none.
std::vector<Need> no_needs(const TaskKey&, int, int) { return {}; }

// A stage's gradients are reduced once all its micro-batches' weight gradients are in.
std::vector<Need> reduce_needs(const TaskKey& t, int, int microbatches) {
  std::vector<Need> needs;
  for (int m = 0; m < microbatches; ++m) {
    needs.push_back({{{Backward, t.stage, m}, {BackwardWeight, t.stage, m}}});
  }
  return needs;
}

struct Registry {
  std::mutex mutex;
  std::deque<ActionInfo> actions;  // a deque: references stay valid as actions are added
};

Registry& registry() {
  // Order = the ids in action.hpp.
  using C = CostClass;
  using M = Message;
  static Registry r{{},
                    {
                        {"forward", forward_needs, false, C::Forward,
                         {M::None, M::None, M::Activation, M::Activation}},
                        {"recompute", own_forward, false, C::Forward, {}},
                        {"backward", backward_needs, false, C::Backward,
                         {M::None, M::None, M::Gradient, M::Gradient}},
                        {"backward_input", backward_needs, false, C::BackwardInput,
                         {M::None, M::None, M::Gradient, M::Gradient}},
                        {"backward_weight", weight_needs, false, C::BackwardWeight, {}},
                        {"loss", own_forward, false, C::Loss, {}},
                        {"send_forward", own_forward, true, C::None, {M::Activation}},
                        {"recv_forward", recv_forward_needs, true, C::None,
                         {M::None, M::Activation}},
                        {"send_backward", send_backward_needs, true, C::None, {M::Gradient}},
                        {"recv_backward", recv_backward_needs, true, C::None,
                         {M::None, M::Gradient}},
                        {"reduce_grad", reduce_needs, true, C::None,
                         {M::ReducedGradients, M::ReducedGradients}},
                        {"send_skips", own_forward, true, C::None, {M::Skips}},
                        {"recv_skips", no_needs, true, C::None, {M::None, M::Skips}},
                        {"send_skip_grads", send_backward_needs, true, C::None,
                         {M::SkipGradients}},
                        {"recv_skip_grads", no_needs, true, C::None,
                         {M::None, M::SkipGradients}},
                    }};
  return r;
}

bool snake_case(const std::string& name) {
  if (name.empty() || name[0] < 'a' || name[0] > 'z') return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

constexpr int kMaxOffset = 1 << 20;

}  // namespace

const char* cost_class_name(CostClass cost) {
  switch (cost) {
    case CostClass::None: return "none";
    case CostClass::Forward: return "forward";
    case CostClass::Backward: return "backward";
    case CostClass::BackwardInput: return "backward_input";
    case CostClass::BackwardWeight: return "backward_weight";
    case CostClass::Loss: return "loss";
  }
  return "none";
}

CostClass parse_cost_class(const std::string& name) {
  for (CostClass cost : {CostClass::None, CostClass::Forward, CostClass::Backward,
                         CostClass::BackwardInput, CostClass::BackwardWeight, CostClass::Loss}) {
    if (name == cost_class_name(cost)) return cost;
  }
  throw InvalidArgument("cost must be 'none', 'forward', 'backward', 'backward_input', "
                        "'backward_weight' or 'loss', got '" + name + "'");
}

const char* message_name(Message message) {
  switch (message) {
    case Message::None: return "none";
    case Message::Activation: return "activation";
    case Message::Skips: return "skips";
    case Message::Gradient: return "gradient";
    case Message::SkipGradients: return "skip_gradients";
    case Message::ReducedGradients: return "reduced_gradients";
  }
  return "none";
}

Message parse_message(const std::string& name) {
  for (Message message : {Message::None, Message::Activation, Message::Skips, Message::Gradient,
                          Message::SkipGradients, Message::ReducedGradients}) {
    if (name == message_name(message)) return message;
  }
  throw InvalidArgument("message must be 'none', 'activation', 'skips', 'gradient', "
                        "'skip_gradients' or 'reduced_gradients', got '" + name + "'");
}

double unit_cost(CostClass cost) {
  switch (cost) {
    case CostClass::Forward: return 1.0;
    case CostClass::Backward: return 2.0;
    case CostClass::BackwardInput: return 1.0;
    case CostClass::BackwardWeight: return 1.0;
    case CostClass::None:
    case CostClass::Loss: return 0.0;
  }
  return 0.0;
}

namespace {

// Adds `info` to the locked registry.
ActionId add_locked(Registry& r, ActionInfo info) {
  for (const auto& known : r.actions) {
    GF_EXPECTS(known.name != info.name, "action '" + info.name + "' is already registered");
  }
  r.actions.push_back(std::move(info));
  return static_cast<ActionId>(r.actions.size() - 1);
}

void check_name(const std::string& name) {
  GF_EXPECTS(!name.empty(), "an action needs a name");
  GF_EXPECTS(snake_case(name), "action name '" + name + "' must be snake_case ([a-z][a-z0-9_]*)");
}

// A need of data with its actions resolved to ids.
struct ResolvedNeed {
  std::vector<std::pair<ActionId, int>> any_of;
  bool every_microbatch;
  bool required;
};

std::vector<Need> needs_of(const std::vector<ResolvedNeed>& specs, const TaskKey& task,
                           int stages, int microbatches) {
  std::vector<Need> needs;
  auto add = [&](const ResolvedNeed& spec, int microbatch) {
    Need need{{}, spec.required};
    for (const auto& [action, offset] : spec.any_of) {
      const int stage = task.stage + offset;
      if (stage >= 0 && stage < stages) need.any_of.push_back({action, stage, microbatch});
    }
    if (!need.any_of.empty()) needs.push_back(std::move(need));
  };
  for (const ResolvedNeed& spec : specs) {
    if (!spec.every_microbatch) {
      add(spec, task.microbatch);
      continue;
    }
    for (int m = 0; m < microbatches; ++m) add(spec, m);
  }
  return needs;
}

}  // namespace

ActionId register_action(const std::string& name, NeedsRule needs, bool communication,
                         CostClass cost, Wire wire) {
  check_name(name);
  GF_EXPECTS(needs != nullptr, "action '" + name + "' needs a dependency rule");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return add_locked(r, {name, std::move(needs), communication, cost, wire});
}

ActionId register_action(const std::string& name, const std::vector<NeedSpec>& needs,
                         bool communication, CostClass cost, Wire wire) {
  check_name(name);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<ResolvedNeed> resolved;
  for (const NeedSpec& spec : needs) {
    GF_EXPECTS(!spec.any_of.empty(),
               "action '" + name + "': a need names at least one (action, stage offset)");
    ResolvedNeed need{{}, spec.every_microbatch, spec.required};
    for (const auto& [action, offset] : spec.any_of) {
      ActionId id = static_cast<ActionId>(r.actions.size());  // the new action itself
      if (action != name) {
        const auto it = std::find_if(r.actions.begin(), r.actions.end(),
                                     [&](const ActionInfo& info) { return info.name == action; });
        GF_EXPECTS(it != r.actions.end(),
                   "action '" + name + "' needs unknown action '" + action + "'");
        id = static_cast<ActionId>(it - r.actions.begin());
      }
      GF_EXPECTS(offset >= -kMaxOffset && offset <= kMaxOffset,
                 "action '" + name + "': stage offset " + std::to_string(offset) +
                     " is out of range");
      need.any_of.emplace_back(id, offset);
    }
    resolved.push_back(std::move(need));
  }
  NeedsRule rule = [resolved = std::move(resolved)](const TaskKey& task, int stages,
                                                     int microbatches) {
    return needs_of(resolved, task, stages, microbatches);
  };
  return add_locked(r, {name, std::move(rule), communication, cost, wire});
}

const ActionInfo& action_info(ActionId id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  GF_EXPECTS(id >= 0 && static_cast<std::size_t>(id) < r.actions.size(),
             "unknown action id " + std::to_string(id));
  return r.actions[static_cast<std::size_t>(id)];
}

std::optional<ActionId> find_action(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (std::size_t id = 0; id < r.actions.size(); ++id) {
    if (r.actions[id].name == name) return static_cast<ActionId>(id);
  }
  return std::nullopt;
}

namespace {

ActionId first_with(Message Wire::*field, Message message, const char* verb) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (std::size_t id = 0; id < r.actions.size(); ++id) {
    if (r.actions[id].wire.*field == message) return static_cast<ActionId>(id);
  }
  throw InvalidArgument(std::string("no action ") + verb + " '" + message_name(message) + "'");
}

}  // namespace

ActionId sender_of(Message message) { return first_with(&Wire::sends, message, "sends"); }
ActionId receiver_of(Message message) { return first_with(&Wire::receives, message, "receives"); }

int action_count() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return static_cast<int>(r.actions.size());
}

std::string describe(const TaskKey& task) {
  return action_info(task.action).name + "(stage " + std::to_string(task.stage) +
         ", micro-batch " + std::to_string(task.microbatch) + ")";
}

}  // namespace gpipe_fast
