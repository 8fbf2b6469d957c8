// Schedule generators, validate(), the Schedule constructor and simulate().
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "check.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/schedule.hpp"

using gpipe_fast::InvalidArgument;
using gpipe_fast::Schedule;
using gpipe_fast::Task;
using gpipe_fast::TaskKind;

namespace {

std::string describe(const Task& task) {
  std::string out = std::string(gpipe_fast::to_string(task.kind)) + "(c" +
                    std::to_string(task.cell) + ",m" + std::to_string(task.microbatch) + ",deps[";
  for (std::size_t i = 0; i < task.deps.size(); ++i) {
    if (i) out += ",";
    out += std::to_string(task.deps[i]);
  }
  return out + "])";
}

std::string describe(const std::vector<Task>& tasks) {
  std::string out;
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    out += std::to_string(i) + ":" + describe(tasks[i]) + " ";
  }
  return out;
}

std::string describe(const std::vector<int>& ids) {
  std::string out = "[";
  for (std::size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  return out + "]";
}

}  // namespace

TEST(schedule_gpipe_forward_exact_k2_m3) {
  const Schedule s = gpipe_fast::gpipe_forward(2, 3);
  const std::vector<Task> expected = {
      {TaskKind::Forward, 0, 0, {}},  // 0
      {TaskKind::Forward, 0, 1, {}},  // 1
      {TaskKind::Forward, 0, 2, {}},  // 2
      {TaskKind::Forward, 1, 0, {0}},  // 3
      {TaskKind::Forward, 1, 1, {1}},  // 4
      {TaskKind::Forward, 1, 2, {2}},  // 5
  };
  CHECK_EQ(s.cells(), 2);
  CHECK_EQ(s.microbatches(), 3);
  CHECK_EQ(describe(s.tasks()), describe(expected));
  CHECK_EQ(describe(s.order(0)), describe(std::vector<int>{0, 1, 2}));
  CHECK_EQ(describe(s.order(1)), describe(std::vector<int>{3, 4, 5}));
  s.validate();
}

TEST(schedule_gpipe_backward_exact_k2_m3_recompute) {
  const Schedule s = gpipe_fast::gpipe_backward(2, 3, {true, true, false});
  // Cell 1 first, micro-batches in reverse, Recompute before Backward where flagged;
  // Backward(0, m) depends on Backward(1, m).
  const std::vector<Task> expected = {
      {TaskKind::Backward, 1, 2, {}},   // 0
      {TaskKind::Recompute, 1, 1, {}},  // 1
      {TaskKind::Backward, 1, 1, {}},   // 2
      {TaskKind::Recompute, 1, 0, {}},  // 3
      {TaskKind::Backward, 1, 0, {}},   // 4
      {TaskKind::Backward, 0, 2, {0}},  // 5
      {TaskKind::Recompute, 0, 1, {}},  // 6
      {TaskKind::Backward, 0, 1, {2}},  // 7
      {TaskKind::Recompute, 0, 0, {}},  // 8
      {TaskKind::Backward, 0, 0, {4}},  // 9
  };
  CHECK_EQ(describe(s.tasks()), describe(expected));
  CHECK_EQ(describe(s.order(1)), describe(std::vector<int>{0, 1, 2, 3, 4}));
  CHECK_EQ(describe(s.order(0)), describe(std::vector<int>{5, 6, 7, 8, 9}));
  s.validate();
}

TEST(schedule_gpipe_backward_rejects_wrong_flag_count) {
  CHECK_THROWS(gpipe_fast::gpipe_backward(2, 3, {true, false}), InvalidArgument);
  CHECK_THROWS(gpipe_fast::gpipe_backward(2, 3, {true, false, true, true}), InvalidArgument);
}

TEST(schedule_generated_schedules_validate) {
  for (int k = 1; k <= 5; ++k) {
    for (int m = 1; m <= 6; ++m) {
      gpipe_fast::gpipe_forward(k, m).validate();
      const auto flags = static_cast<std::size_t>(m);
      gpipe_fast::gpipe_backward(k, m, std::vector<bool>(flags, true)).validate();
      gpipe_fast::gpipe_backward(k, m, std::vector<bool>(flags, false)).validate();
      CHECK_EQ(gpipe_fast::gpipe_forward(k, m).tasks().size(), static_cast<std::size_t>(k * m));
    }
  }
}

TEST(schedule_validate_rejects_self_dependency) {
  Schedule s(1, 1);
  s.add(TaskKind::Forward, 0, 0);
  s.add(TaskKind::Forward, 0, 0, {1});
  CHECK_THROWS(s.validate(), InvalidArgument);
}

TEST(schedule_validate_rejects_out_of_range_dependency) {
  Schedule past_end(2, 1);
  past_end.add(TaskKind::Forward, 0, 0);
  past_end.add(TaskKind::Forward, 1, 0, {2});
  CHECK_THROWS(past_end.validate(), InvalidArgument);

  Schedule negative(2, 1);
  negative.add(TaskKind::Forward, 0, 0);
  negative.add(TaskKind::Forward, 1, 0, {-1});
  CHECK_THROWS(negative.validate(), InvalidArgument);
}

TEST(schedule_validate_rejects_cycle_through_cell_order) {
  // cell 0 runs A then B, cell 1 runs C then D; A needs D and C needs B. The dependencies
  // alone are acyclic; only the per-cell orders close the cycle A->B->C->D->A.
  Schedule s(2, 1);
  const int a = s.add(TaskKind::Forward, 0, 0, {3});
  const int b = s.add(TaskKind::Forward, 0, 0);
  const int c = s.add(TaskKind::Forward, 1, 0, {b});
  const int d = s.add(TaskKind::Forward, 1, 0);
  CHECK_EQ(a, 0);
  CHECK_EQ(d, 3);
  CHECK_EQ(c, 2);
  CHECK_THROWS(s.validate(), InvalidArgument);

  // Control: the same schedule without A's dependency on D is valid.
  Schedule ok(2, 1);
  ok.add(TaskKind::Forward, 0, 0);
  ok.add(TaskKind::Forward, 0, 0);
  ok.add(TaskKind::Forward, 1, 0, {1});
  ok.add(TaskKind::Forward, 1, 0);
  ok.validate();
}

TEST(schedule_validate_rejects_dependency_on_later_task_of_same_cell) {
  Schedule s(1, 2);
  s.add(TaskKind::Forward, 0, 0, {1});
  s.add(TaskKind::Forward, 0, 1);
  CHECK_THROWS(s.validate(), InvalidArgument);
}

TEST(schedule_constructor_and_add_reject_bad_arguments) {
  CHECK_THROWS(Schedule(0, 1), InvalidArgument);
  CHECK_THROWS(Schedule(-1, 1), InvalidArgument);
  CHECK_THROWS(Schedule(1, 0), InvalidArgument);
  CHECK_THROWS(Schedule(1, -3), InvalidArgument);
  CHECK_THROWS(gpipe_fast::gpipe_forward(0, 2), InvalidArgument);
  CHECK_THROWS(gpipe_fast::gpipe_forward(2, 0), InvalidArgument);
  Schedule s(2, 2);
  CHECK_THROWS(s.add(TaskKind::Forward, 2, 0), InvalidArgument);
  CHECK_THROWS(s.add(TaskKind::Forward, -1, 0), InvalidArgument);
  CHECK_THROWS(s.add(TaskKind::Forward, 0, 2), InvalidArgument);
  CHECK_THROWS(s.add(TaskKind::Forward, 0, -1), InvalidArgument);
  CHECK_EQ(s.tasks().size(), std::size_t{0});
}

TEST(simulate_fill_drain_forward_unit_costs) {
  for (int k : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 4, 7, 16}) {
      const Schedule s = gpipe_fast::gpipe_forward(k, m);
      const auto t = gpipe_fast::simulate(s, std::vector<double>(s.tasks().size(), 1.0));
      CHECK_EQ(t.makespan, static_cast<double>(m + k - 1));
      const double expected = static_cast<double>(k - 1) / static_cast<double>(m + k - 1);
      CHECK(std::fabs(t.bubble - expected) < 1e-12);
      // Micro-batch m runs cell k at tick m + k.
      for (std::size_t id = 0; id < s.tasks().size(); ++id) {
        const Task& task = s.tasks()[id];
        CHECK_EQ(t.start[id], static_cast<double>(task.cell + task.microbatch));
        CHECK_EQ(t.end[id], t.start[id] + 1.0);
      }
    }
  }
}

TEST(simulate_fill_drain_backward_unit_costs) {
  for (int k : {1, 2, 5}) {
    for (int m : {1, 3, 8}) {
      const std::vector<bool> flags(static_cast<std::size_t>(m), false);
      const Schedule s = gpipe_fast::gpipe_backward(k, m, flags);
      const auto t = gpipe_fast::simulate(s, std::vector<double>(s.tasks().size(), 1.0));
      CHECK_EQ(t.makespan, static_cast<double>(m + k - 1));
    }
  }
}

TEST(simulate_rejects_bad_costs) {
  const Schedule s = gpipe_fast::gpipe_forward(2, 3);
  const std::size_t n = s.tasks().size();
  CHECK_THROWS(gpipe_fast::simulate(s, std::vector<double>(n - 1, 1.0)), InvalidArgument);
  CHECK_THROWS(gpipe_fast::simulate(s, std::vector<double>(n + 1, 1.0)), InvalidArgument);
  CHECK_THROWS(gpipe_fast::simulate(s, {}), InvalidArgument);
  std::vector<double> negative(n, 1.0);
  negative[3] = -0.5;
  CHECK_THROWS(gpipe_fast::simulate(s, negative), InvalidArgument);
  std::vector<double> nan(n, 1.0);
  nan[0] = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS(gpipe_fast::simulate(s, nan), InvalidArgument);
  // Zero costs are allowed.
  const auto t = gpipe_fast::simulate(s, std::vector<double>(n, 0.0));
  CHECK_EQ(t.makespan, 0.0);
}
