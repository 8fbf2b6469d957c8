// Predicts a schedule's timeline from per-task costs (list scheduling in per-worker order).
#include <algorithm>
#include <numeric>

#include "gpipe_fast/error.hpp"
#include "gpipe_fast/schedule.hpp"

namespace gpipe_fast {

SimulatedTimeline simulate(const Schedule& schedule, const std::vector<double>& cost) {
  const auto& tasks = schedule.tasks();
  GF_EXPECTS(cost.size() == tasks.size(), "simulate needs one cost per task: got " +
                                              std::to_string(cost.size()) + " for " +
                                              std::to_string(tasks.size()) + " tasks");
  for (double c : cost) GF_EXPECTS(c >= 0.0, "task costs must be non-negative");
  schedule.validate();

  SimulatedTimeline timeline;
  timeline.start.assign(tasks.size(), 0.0);
  timeline.end.assign(tasks.size(), -1.0);
  std::vector<std::size_t> cursor(static_cast<std::size_t>(schedule.workers()), 0);
  std::vector<double> worker_free(static_cast<std::size_t>(schedule.workers()), 0.0);

  // Each sweep starts every worker's next task whose dependencies are finished; the schedule
  // cannot deadlock (validated), so every sweep makes progress until all tasks are placed.
  std::size_t placed = 0;
  while (placed < tasks.size()) {
    for (int worker = 0; worker < schedule.workers(); ++worker) {
      const auto c = static_cast<std::size_t>(worker);
      const auto& order = schedule.order(worker);
      while (cursor[c] < order.size()) {
        const int id = order[cursor[c]];
        double ready = worker_free[c];
        bool blocked = false;
        for (int dep : tasks[static_cast<std::size_t>(id)].deps) {
          const double done = timeline.end[static_cast<std::size_t>(dep)];
          if (done < 0.0) {
            blocked = true;
            break;
          }
          ready = std::max(ready, done);
        }
        if (blocked) break;
        timeline.start[static_cast<std::size_t>(id)] = ready;
        timeline.end[static_cast<std::size_t>(id)] = ready + cost[static_cast<std::size_t>(id)];
        worker_free[c] = timeline.end[static_cast<std::size_t>(id)];
        ++cursor[c];
        ++placed;
      }
    }
  }
  timeline.makespan = tasks.empty() ? 0.0 : *std::max_element(timeline.end.begin(), timeline.end.end());
  const double busy = std::accumulate(cost.begin(), cost.end(), 0.0);
  timeline.bubble =
      timeline.makespan > 0.0 ? 1.0 - busy / (schedule.workers() * timeline.makespan) : 0.0;
  return timeline;
}

std::vector<double> equal_stage_costs(const Schedule& schedule) {
  std::vector<double> cost;
  cost.reserve(schedule.tasks().size());
  for (const Task& task : schedule.tasks()) cost.push_back(unit_cost(action_info(task.action).cost));
  return cost;
}

}  // namespace gpipe_fast
