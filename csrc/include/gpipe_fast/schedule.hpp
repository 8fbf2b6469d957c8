// A pipeline step as tasks per (cell, micro-batch) with dependencies, and its generators.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpipe_fast {

enum class TaskKind : std::uint8_t { Forward, Recompute, Backward };

const char* to_string(TaskKind kind);

struct Task {
  TaskKind kind;
  int cell;
  int microbatch;
  // Tasks (by id) that must finish before this one starts. Tasks earlier in the same
  // cell's order are implied and need not be listed.
  std::vector<int> deps;
};

// A DAG of tasks plus, for each cell, the order its worker runs them in. The executor only
// reads this structure, so any schedule (fill-drain, 1F1B, interleaved, zero-bubble) that can
// be written as per-cell task lists with cross-cell dependencies runs unchanged.
class Schedule {
 public:
  Schedule(int cells, int microbatches);

  // Appends a task to `cell`'s order and returns its id.
  int add(TaskKind kind, int cell, int microbatch, std::vector<int> deps = {});

  int cells() const { return cells_; }
  int microbatches() const { return microbatches_; }
  const std::vector<Task>& tasks() const { return tasks_; }
  const Task& task(int id) const { return tasks_.at(static_cast<std::size_t>(id)); }
  const std::vector<int>& order(int cell) const { return order_.at(static_cast<std::size_t>(cell)); }

  // Throws InvalidArgument unless every dependency names an existing other task and the
  // dependencies together with the per-cell orders form no cycle (so the executor cannot
  // deadlock on this schedule).
  void validate() const;

 private:
  int cells_;
  int microbatches_;
  std::vector<Task> tasks_;
  std::vector<std::vector<int>> order_;
};

// GPipe fill-drain forward: micro-batch m runs cell k at clock tick m + k.
Schedule gpipe_forward(int cells, int microbatches);

// GPipe fill-drain backward: micro-batches in reverse, cell K-1 first. For each micro-batch
// with recompute[m] set, a Recompute task precedes its Backward on the same cell; it depends
// on nothing from other cells, so it overlaps with the gradient still travelling back.
Schedule gpipe_backward(int cells, int microbatches, const std::vector<bool>& recompute);

// The predicted timeline of a schedule when task i takes cost[i] time units and each cell
// runs one task at a time, in its order, as soon as its dependencies have finished.
struct SimulatedTimeline {
  std::vector<double> start;
  std::vector<double> end;
  double makespan = 0.0;
  // Share of cell-time spent idle: 1 - sum(cost) / (cells * makespan).
  double bubble = 0.0;
};

SimulatedTimeline simulate(const Schedule& schedule, const std::vector<double>& cost);

}  // namespace gpipe_fast
