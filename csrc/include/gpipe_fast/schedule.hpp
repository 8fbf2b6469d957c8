// A pipeline step as tasks (action, stage, micro-batch) with dependencies, run by workers.
#pragma once

#include <string>
#include <vector>

#include "gpipe_fast/action.hpp"

namespace gpipe_fast {

struct Task {
  ActionId action = action::Forward;
  int stage = 0;
  int microbatch = 0;
  int worker = 0;  // the worker that runs the task's stage
  // Tasks (by id) that must finish before this one starts. Tasks earlier in the same
  // worker's order are implied and need not be listed.
  std::vector<int> deps;

  TaskKey key() const { return {action, stage, microbatch}; }
};

// A DAG of tasks plus, for each worker, the order it runs them in. Stages map to compute
// workers (several stages per worker in interleaved schedules); communication tasks may run
// on further workers. The executor only reads this structure, so any schedule that can be
// written as per-worker task lists with cross-worker dependencies runs unchanged.
class Schedule {
 public:
  // `stage_worker[s]` is the worker of stage s (-1: a stage of another process, which
  // this schedule holds no task of); empty means one worker per stage. `workers`: how many
  // workers in all, at least enough for the stages (0: just those).
  Schedule(int stages, int microbatches, std::vector<int> stage_worker = {}, int workers = 0);

  // Appends a task to a worker's order and returns its id: a communication task to
  // `worker`, any other to its stage's worker (`worker`, if given, must be that one).
  int add(ActionId action, int stage, int microbatch, std::vector<int> deps = {}, int worker = -1);

  int stages() const { return stages_; }
  int workers() const { return static_cast<int>(order_.size()); }
  int microbatches() const { return microbatches_; }
  int worker_of(int stage) const;
  const std::vector<int>& stage_workers() const { return stage_worker_; }
  const std::vector<Task>& tasks() const { return tasks_; }
  const Task& task(int id) const { return tasks_.at(static_cast<std::size_t>(id)); }
  const std::vector<int>& order(int worker) const {
    return order_.at(static_cast<std::size_t>(worker));
  }
  // The id of the task `key`, or -1.
  int find(const TaskKey& key) const;

  // Actions done before this schedule runs (a backward-only run is given its forwards and
  // losses): a required need on them is met without a task in the schedule.
  void set_given(std::vector<ActionId> actions);
  const std::vector<ActionId>& given() const { return given_; }
  bool is_given(ActionId action) const;

  // Throws InvalidArgument unless every dependency names an existing other task, each
  // (action, stage, micro-batch) appears once, the loss runs on the last stage only, each
  // dependency on the same worker comes earlier in its order (so per stage F comes before
  // B, and B before W), and a dry run finishes: every worker, running its tasks in order
  // as soon as their dependencies are done, runs them all (so the executor cannot
  // deadlock). The result is remembered until the next add().
  void validate() const;

  // Tasks that depend on task `id`, listed or implied by order (after validate()).
  const std::vector<int>& successors(int id) const;

 private:
  int stages_;
  int microbatches_;
  std::vector<int> stage_worker_;
  std::vector<Task> tasks_;
  std::vector<std::vector<int>> order_;
  std::vector<ActionId> given_;
  mutable bool validated_ = false;
  mutable std::vector<std::vector<int>> successors_;
};

// A worker stuck in a dry run: the task it cannot start and the dependency it waits for.
struct Stuck {
  int worker = -1;
  int task = -1;
  int waits_for = -1;
};

// Runs the schedule with no costs: each worker starts its next task once its dependencies
// are done. Returns the stuck workers when the run cannot finish (empty: no deadlock).
// Does not check anything else (see Schedule::validate).
std::vector<Stuck> dry_run(const Schedule& schedule);

// The predicted timeline of a schedule when task i takes cost[i] time units and each worker
// runs one task at a time, in its order, as soon as its dependencies have finished.
struct SimulatedTimeline {
  std::vector<double> start;
  std::vector<double> end;
  double makespan = 0.0;
  // Share of worker-time spent idle: 1 - sum(cost) / (workers * makespan).
  double bubble = 0.0;
};

SimulatedTimeline simulate(const Schedule& schedule, const std::vector<double>& cost);

// Each task's cost when every stage costs the same: its action's unit_cost (a forward 1, a
// backward 2, each half of it 1, a loss and communication nothing).
std::vector<double> equal_stage_costs(const Schedule& schedule);

}  // namespace gpipe_fast
