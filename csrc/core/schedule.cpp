// Schedule construction, validation and the fill-drain generators.
#include "gpipe_fast/schedule.hpp"

#include <deque>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {

const char* to_string(TaskKind kind) {
  switch (kind) {
    case TaskKind::Forward: return "forward";
    case TaskKind::Recompute: return "recompute";
    case TaskKind::Backward: return "backward";
  }
  return "unknown";
}

Schedule::Schedule(int cells, int microbatches) : cells_(cells), microbatches_(microbatches) {
  GF_EXPECTS(cells >= 1, "cells must be >= 1, got " + std::to_string(cells));
  GF_EXPECTS(microbatches >= 1, "microbatches must be >= 1, got " + std::to_string(microbatches));
  order_.resize(static_cast<std::size_t>(cells));
}

int Schedule::add(TaskKind kind, int cell, int microbatch, std::vector<int> deps) {
  GF_EXPECTS(cell >= 0 && cell < cells_, "cell " + std::to_string(cell) + " out of range");
  GF_EXPECTS(microbatch >= 0 && microbatch < microbatches_,
             "microbatch " + std::to_string(microbatch) + " out of range");
  const int id = static_cast<int>(tasks_.size());
  tasks_.push_back(Task{kind, cell, microbatch, std::move(deps)});
  order_[static_cast<std::size_t>(cell)].push_back(id);
  return id;
}

void Schedule::validate() const {
  const auto n = tasks_.size();
  std::vector<std::vector<int>> successors(n);
  std::vector<int> indegree(n, 0);
  auto edge = [&](int from, int to) {
    successors[static_cast<std::size_t>(from)].push_back(to);
    ++indegree[static_cast<std::size_t>(to)];
  };
  for (std::size_t id = 0; id < n; ++id) {
    for (int dep : tasks_[id].deps) {
      GF_EXPECTS(dep >= 0 && static_cast<std::size_t>(dep) < n,
                 "task " + std::to_string(id) + " depends on unknown task " + std::to_string(dep));
      GF_EXPECTS(static_cast<std::size_t>(dep) != id,
                 "task " + std::to_string(id) + " depends on itself");
      edge(dep, static_cast<int>(id));
    }
  }
  for (const auto& order : order_) {
    for (std::size_t i = 1; i < order.size(); ++i) edge(order[i - 1], order[i]);
  }
  // Kahn's algorithm: every task is reached iff the graph has no cycle.
  std::deque<int> ready;
  for (std::size_t id = 0; id < n; ++id) {
    if (indegree[id] == 0) ready.push_back(static_cast<int>(id));
  }
  std::size_t reached = 0;
  while (!ready.empty()) {
    const int id = ready.front();
    ready.pop_front();
    ++reached;
    for (int next : successors[static_cast<std::size_t>(id)]) {
      if (--indegree[static_cast<std::size_t>(next)] == 0) ready.push_back(next);
    }
  }
  GF_EXPECTS(reached == n, "schedule has a dependency cycle: " + std::to_string(n - reached) +
                               " tasks can never start");
}

Schedule gpipe_forward(int cells, int microbatches) {
  Schedule schedule(cells, microbatches);
  std::vector<int> previous_cell(static_cast<std::size_t>(microbatches), -1);
  for (int cell = 0; cell < cells; ++cell) {
    for (int m = 0; m < microbatches; ++m) {
      auto& producer = previous_cell[static_cast<std::size_t>(m)];
      std::vector<int> deps;
      if (producer >= 0) deps.push_back(producer);
      producer = schedule.add(TaskKind::Forward, cell, m, std::move(deps));
    }
  }
  return schedule;
}

Schedule gpipe_backward(int cells, int microbatches, const std::vector<bool>& recompute) {
  GF_EXPECTS(recompute.size() == static_cast<std::size_t>(microbatches),
             "recompute needs one flag per micro-batch");
  Schedule schedule(cells, microbatches);
  std::vector<int> next_cell(static_cast<std::size_t>(microbatches), -1);
  for (int cell = cells - 1; cell >= 0; --cell) {
    for (int m = microbatches - 1; m >= 0; --m) {
      if (recompute[static_cast<std::size_t>(m)]) schedule.add(TaskKind::Recompute, cell, m);
      auto& consumer = next_cell[static_cast<std::size_t>(m)];
      std::vector<int> deps;
      if (consumer >= 0) deps.push_back(consumer);
      consumer = schedule.add(TaskKind::Backward, cell, m, std::move(deps));
    }
  }
  return schedule;
}

}  // namespace gpipe_fast
