// The action registry: built-in actions with their dependency rules, open to more.
#include "gpipe_fast/action.hpp"

#include <deque>
#include <mutex>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {
namespace {

using namespace action;

std::vector<Need> forward_needs(const TaskKey& t, int, int) {
  if (t.stage == 0) return {};
  return {{{{RecvForward, t.stage, t.microbatch}, {Forward, t.stage - 1, t.microbatch}}}};
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
  return {gradient, {{{Forward, s, m}}}, Need{{{Recompute, s, m}}, false}};
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
  static Registry r{{},
                    {
                        {"forward", forward_needs},
                        {"recompute", own_forward},
                        {"backward", backward_needs},
                        {"backward_input", backward_needs},
                        {"backward_weight", weight_needs},
                        {"loss", own_forward},
                        {"send_forward", own_forward, true},
                        {"recv_forward", recv_forward_needs, true},
                        {"send_backward", send_backward_needs, true},
                        {"recv_backward", recv_backward_needs, true},
                        {"reduce_grad", reduce_needs, true},
                    }};
  return r;
}

}  // namespace

ActionId register_action(const std::string& name, NeedsRule needs, bool communication) {
  GF_EXPECTS(!name.empty(), "an action needs a name");
  GF_EXPECTS(needs != nullptr, "action '" + name + "' needs a dependency rule");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& info : r.actions) {
    GF_EXPECTS(info.name != name, "action '" + name + "' is already registered");
  }
  r.actions.push_back({name, needs, communication});
  return static_cast<ActionId>(r.actions.size() - 1);
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
