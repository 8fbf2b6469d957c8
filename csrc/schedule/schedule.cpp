// Schedule construction, validation and the deadlock dry run.
#include "gpipe_fast/schedule.hpp"

#include <algorithm>
#include <unordered_map>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {
namespace {

std::string task_name(const Schedule& schedule, int id) {
  const Task& task = schedule.task(id);
  return describe(task.key()) + " [task " + std::to_string(id) + ", worker " +
         std::to_string(task.worker) + "]";
}

}  // namespace

Schedule::Schedule(int stages, int microbatches, std::vector<int> stage_worker, int workers)
    : stages_(stages), microbatches_(microbatches), stage_worker_(std::move(stage_worker)) {
  GF_EXPECTS(stages >= 1, "stages must be >= 1, got " + std::to_string(stages));
  GF_EXPECTS(microbatches >= 1, "microbatches must be >= 1, got " + std::to_string(microbatches));
  GF_EXPECTS(workers >= 0, "workers must be >= 0, got " + std::to_string(workers));
  if (stage_worker_.empty()) {
    for (int s = 0; s < stages; ++s) stage_worker_.push_back(s);
  }
  GF_EXPECTS(stage_worker_.size() == static_cast<std::size_t>(stages),
             "stage_worker needs one worker per stage: got " +
                 std::to_string(stage_worker_.size()) + " for " + std::to_string(stages));
  int needed = 0;
  for (int worker : stage_worker_) {
    GF_EXPECTS(worker >= -1, "stage_worker entries must be >= -1, got " + std::to_string(worker));
    needed = std::max(needed, worker + 1);
  }
  if (workers == 0) {
    // Derived: the stages' workers, each with a stage.
    for (int worker = 0; worker < needed; ++worker) {
      GF_EXPECTS(std::find(stage_worker_.begin(), stage_worker_.end(), worker) != stage_worker_.end(),
                 "worker " + std::to_string(worker) + " has no stage");
    }
    workers = needed;
  }
  GF_EXPECTS(workers >= std::max(needed, 1),
             "workers (" + std::to_string(workers) + ") must cover the stages' workers (" +
                 std::to_string(needed) + ")");
  order_.resize(static_cast<std::size_t>(workers));
}

int Schedule::worker_of(int stage) const {
  GF_EXPECTS(stage >= 0 && stage < stages_, "stage " + std::to_string(stage) + " out of range");
  return stage_worker_[static_cast<std::size_t>(stage)];
}

int Schedule::add(ActionId action, int stage, int microbatch, std::vector<int> deps, int worker) {
  const ActionInfo& info = action_info(action);  // throws for an unknown action
  GF_EXPECTS(stage >= 0 && stage < stages_, "stage " + std::to_string(stage) + " out of range");
  GF_EXPECTS(microbatch >= 0 && microbatch < microbatches_,
             "microbatch " + std::to_string(microbatch) + " out of range");
  const int home = worker_of(stage);
  GF_EXPECTS(home >= 0, describe(TaskKey{action, stage, microbatch}) +
                            ": its stage runs in another process");
  if (worker < 0) worker = home;
  GF_EXPECTS(worker < workers(), "worker " + std::to_string(worker) + " out of range");
  GF_EXPECTS(info.communication || worker == home,
             describe(TaskKey{action, stage, microbatch}) + " must run on its stage's worker " +
                 std::to_string(home) + ", not " + std::to_string(worker));
  const int id = static_cast<int>(tasks_.size());
  tasks_.push_back(Task{action, stage, microbatch, worker, std::move(deps)});
  order_[static_cast<std::size_t>(worker)].push_back(id);
  validated_ = false;
  return id;
}

int Schedule::find(const TaskKey& key) const {
  for (std::size_t id = 0; id < tasks_.size(); ++id) {
    if (tasks_[id].key() == key) return static_cast<int>(id);
  }
  return -1;
}

void Schedule::set_given(std::vector<ActionId> actions) {
  for (ActionId action : actions) action_info(action);
  given_ = std::move(actions);
  validated_ = false;
}

bool Schedule::is_given(ActionId action) const {
  return std::find(given_.begin(), given_.end(), action) != given_.end();
}

void Schedule::validate() const {
  if (validated_) return;
  const auto n = tasks_.size();
  // Position of each task in its worker's order.
  std::vector<std::size_t> position(n, 0);
  for (const auto& order : order_) {
    for (std::size_t i = 0; i < order.size(); ++i) position[static_cast<std::size_t>(order[i])] = i;
  }
  std::unordered_map<long long, int> seen;
  for (std::size_t id = 0; id < n; ++id) {
    const Task& task = tasks_[id];
    const long long code = (static_cast<long long>(task.action) * stages_ + task.stage) *
                               static_cast<long long>(microbatches_) +
                           task.microbatch;
    const auto [it, fresh] = seen.emplace(code, static_cast<int>(id));
    GF_EXPECTS(fresh, task_name(*this, static_cast<int>(id)) + " repeats " +
                          task_name(*this, it->second));
    GF_EXPECTS(task.action != action::Loss || task.stage == stages_ - 1,
               task_name(*this, static_cast<int>(id)) + ": the loss belongs to the last stage (" +
                   std::to_string(stages_ - 1) + ")");
    for (int dep : task.deps) {
      GF_EXPECTS(dep >= 0 && static_cast<std::size_t>(dep) < n,
                 "task " + std::to_string(id) + " depends on unknown task " + std::to_string(dep));
      GF_EXPECTS(static_cast<std::size_t>(dep) != id,
                 "task " + std::to_string(id) + " depends on itself");
      const Task& before = tasks_[static_cast<std::size_t>(dep)];
      GF_EXPECTS(before.worker != task.worker ||
                     position[static_cast<std::size_t>(dep)] < position[id],
                 task_name(*this, static_cast<int>(id)) + " needs " +
                     task_name(*this, dep) + ", which its worker runs after it");
    }
  }
  const auto stuck = dry_run(*this);
  if (!stuck.empty()) {
    std::string report;
    for (const Stuck& s : stuck) {
      report += "; worker " + std::to_string(s.worker) + " waits at " +
                task_name(*this, s.task) + " for " + task_name(*this, s.waits_for);
    }
    throw InvalidArgument("schedule deadlocks: a dry run stops with tasks left" + report);
  }
  successors_.assign(n, {});
  for (std::size_t id = 0; id < n; ++id) {
    for (int dep : tasks_[id].deps) successors_[static_cast<std::size_t>(dep)].push_back(static_cast<int>(id));
  }
  for (const auto& order : order_) {
    for (std::size_t i = 1; i < order.size(); ++i) {
      auto& next = successors_[static_cast<std::size_t>(order[i - 1])];
      if (std::find(next.begin(), next.end(), order[i]) == next.end()) next.push_back(order[i]);
    }
  }
  validated_ = true;
}

const std::vector<int>& Schedule::successors(int id) const {
  GF_EXPECTS(validated_, "successors() needs a validated schedule");
  return successors_.at(static_cast<std::size_t>(id));
}

std::vector<Stuck> dry_run(const Schedule& schedule) {
  const auto& tasks = schedule.tasks();
  for (const Task& task : tasks) {
    for (int dep : task.deps) {
      GF_EXPECTS(dep >= 0 && static_cast<std::size_t>(dep) < tasks.size(),
                 "dry_run: a task depends on unknown task " + std::to_string(dep));
    }
  }
  std::vector<char> done(tasks.size(), 0);
  std::vector<std::size_t> cursor(static_cast<std::size_t>(schedule.workers()), 0);
  // Sweep the workers until no one can move; each sweep moves at least one task or ends.
  for (bool moved = true; moved;) {
    moved = false;
    for (int worker = 0; worker < schedule.workers(); ++worker) {
      const auto& order = schedule.order(worker);
      auto& at = cursor[static_cast<std::size_t>(worker)];
      while (at < order.size()) {
        const Task& task = tasks[static_cast<std::size_t>(order[at])];
        const bool ready = std::all_of(task.deps.begin(), task.deps.end(),
                                       [&](int dep) { return done[static_cast<std::size_t>(dep)] != 0; });
        if (!ready) break;
        done[static_cast<std::size_t>(order[at])] = 1;
        ++at;
        moved = true;
      }
    }
  }
  std::vector<Stuck> stuck;
  for (int worker = 0; worker < schedule.workers(); ++worker) {
    const auto& order = schedule.order(worker);
    const auto at = cursor[static_cast<std::size_t>(worker)];
    if (at == order.size()) continue;
    const Task& task = tasks[static_cast<std::size_t>(order[at])];
    int waits_for = -1;
    for (int dep : task.deps) {
      if (!done[static_cast<std::size_t>(dep)]) {
        waits_for = dep;
        break;
      }
    }
    stuck.push_back({worker, order[at], waits_for});
  }
  return stuck;
}

}  // namespace gpipe_fast
