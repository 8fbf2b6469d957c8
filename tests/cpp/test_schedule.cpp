// Schedules: the generators against hand-written orders, recompute placement, validation, the
// deadlock dry run over random layouts, the in-flight bounds, and simulate().
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <tuple>
#include <string>
#include <vector>

#include "check.hpp"
#include "show_program.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/generators.hpp"
#include "gpipe_fast/kinds.hpp"
#include "gpipe_fast/schedule.hpp"

using gpipe_fast::Checkpoint;
using gpipe_fast::InvalidArgument;
using gpipe_fast::Program;
using gpipe_fast::Schedule;
using gpipe_fast::Task;
using gpipe_fast::TaskKey;
namespace action = gpipe_fast::action;

using show_program::show;

namespace {

std::string show(const Schedule& s) {
  Program program(static_cast<std::size_t>(s.workers()));
  for (int w = 0; w < s.workers(); ++w) {
    for (int id : s.order(w)) program[static_cast<std::size_t>(w)].push_back(s.task(id).key());
  }
  return show_program::show(program);
}

std::string deps(const Schedule& s) {
  std::string out;
  for (std::size_t id = 0; id < s.tasks().size(); ++id) {
    out += std::to_string(id) + ":[";
    for (std::size_t i = 0; i < s.tasks()[id].deps.size(); ++i) {
      out += (i ? "," : "") + std::to_string(s.tasks()[id].deps[i]);
    }
    out += "] ";
  }
  return out;
}

bool is_backward(gpipe_fast::ActionId a) { return a == action::Backward || a == action::BackwardInput; }

}  // namespace

// -- the generators, exactly -------------------------------------------------------------------

TEST(program_gpipe_k2_m3) {
  CHECK_EQ(show(gpipe_fast::gpipe_program(2, 3)),
           std::string("F0.0 F0.1 F0.2 B0.2 B0.1 B0.0 | "
                       "F1.0 L1.0 F1.1 L1.1 F1.2 L1.2 B1.2 B1.1 B1.0"));
}

TEST(program_1f1b_k3_m4) {
  // Stage k: K-1-k forwards of warm-up, then one forward and one backward in turn.
  CHECK_EQ(show(gpipe_fast::one_f_one_b_program(3, 4)),
           std::string("F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3 | "
                       "F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3 | "
                       "F2.0 L2.0 B2.0 F2.1 L2.1 B2.1 F2.2 L2.2 B2.2 F2.3 L2.3 B2.3"));
}

TEST(program_1f1b_fewer_microbatches_than_stages) {
  CHECK_EQ(show(gpipe_fast::one_f_one_b_program(3, 1)),
           std::string("F0.0 B0.0 | F1.0 B1.0 | F2.0 L2.0 B2.0"));
}

TEST(program_zero_bubble_k3_m4) {
  // 1F1B's shape with backward split into I (input) and W (weight); stage k keeps up to k
  // weight gradients pending and runs them last, in the cool-down's waits.
  CHECK_EQ(show(gpipe_fast::zero_bubble_program(3, 4)),
           std::string("F0.0 F0.1 F0.2 I0.0 W0.0 F0.3 I0.1 W0.1 I0.2 W0.2 I0.3 W0.3 | "
                       "F1.0 F1.1 I1.0 F1.2 I1.1 W1.0 F1.3 I1.2 W1.1 I1.3 W1.2 W1.3 | "
                       "F2.0 L2.0 I2.0 F2.1 L2.1 I2.1 F2.2 L2.2 I2.2 W2.0 F2.3 L2.3 I2.3 W2.1 "
                       "W2.2 W2.3"));
}

TEST(program_interleaved_4_stages_on_2_workers_m4) {
  // Megatron's interleaved 1F1B: micro-batches in groups of 2 go depth first through the
  // worker's stages; warm-up (V-1)D + 2(D-1-r) = 4 on worker 0, 2 on worker 1.
  CHECK_EQ(show(gpipe_fast::interleaved_program(4, 2, 4)),
           std::string("F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 "
                       "B0.2 B0.3 | "
                       "F1.0 F1.1 F3.0 L3.0 B3.0 F3.1 L3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 L3.2 "
                       "B3.2 F3.3 L3.3 B3.3 B1.2 B1.3"));
}

TEST(program_interleaved_with_one_stage_per_worker_is_1f1b) {
  CHECK_EQ(show(gpipe_fast::interleaved_program(3, 3, 5)),
           show(gpipe_fast::one_f_one_b_program(3, 5)));
}

TEST(program_forward_only_is_each_kinds_forwards_with_the_loss) {
  // gpipe, 1f1b and zero bubble: the fill-drain forward, a loss after each last-stage forward.
  const std::string fill_drain = "F0.0 F0.1 F0.2 | F1.0 F1.1 F1.2 | F2.0 L2.0 F2.1 L2.1 F2.2 L2.2";
  for (const char* kind : {"gpipe", "1f1b", "zero_bubble"}) {
    CHECK_EQ(show(gpipe_fast::forward_only_program(kind, 3, 3, 3)), fill_drain);
  }
  // Interleaved: the training program's forwards, groups depth first through each worker.
  CHECK_EQ(show(gpipe_fast::forward_only_program("interleaved", 4, 2, 4)),
           std::string("F0.0 F0.1 F2.0 F2.1 F0.2 F0.3 F2.2 F2.3 | "
                       "F1.0 F1.1 F3.0 L3.0 F3.1 L3.1 F1.2 F1.3 F3.2 L3.2 F3.3 L3.3"));
  // Without the loss (pipe(x) across processes): forwards only.
  CHECK_EQ(show(gpipe_fast::forward_only_program("1f1b", 2, 2, 2, false)),
           std::string("F0.0 F0.1 | F1.0 F1.1"));
  CHECK_THROWS(gpipe_fast::forward_only_program("nope", 2, 2, 2), InvalidArgument);
}

TEST(schedule_forward_only_of_every_kind_validates) {
  for (const char* kind : {"gpipe", "1f1b", "zero_bubble", "interleaved"}) {
    const bool interleaved = std::string(kind) == "interleaved";
    for (int m = 1; m <= 5; ++m) {
      const Schedule s = gpipe_fast::make_forward_schedule(kind, 4, interleaved ? 2 : 4, m);
      int losses = 0;
      for (const Task& t : s.tasks()) {
        CHECK(t.action == action::Forward || t.action == action::Loss);
        losses += t.action == action::Loss;
      }
      CHECK_EQ(losses, m);
      CHECK_EQ(static_cast<int>(s.tasks().size()), 4 * m + m);
    }
  }
}

// -- recompute ---------------------------------------------------------------------------------

TEST(recompute_gpipe_always_rebuilds_the_next_microbatch_ahead) {
  Program p = gpipe_fast::gpipe_program(2, 3);
  gpipe_fast::add_recompute(p, Checkpoint::Always);
  // R0.1 runs before B0.2: stage 0 rebuilds micro-batch 1 while it waits for 2's gradient.
  CHECK_EQ(show(p), std::string("F0.0 F0.1 F0.2 R0.2 R0.1 B0.2 R0.0 B0.1 B0.0 | "
                                "F1.0 L1.0 F1.1 L1.1 F1.2 L1.2 R1.2 R1.1 B1.2 R1.0 B1.1 B1.0"));
}

TEST(recompute_except_last_keeps_what_the_next_task_needs) {
  Program gpipe = gpipe_fast::gpipe_program(2, 3);
  gpipe_fast::add_recompute(gpipe, Checkpoint::ExceptLast);
  // The last micro-batch's backward follows its forward at once: it keeps its activations.
  CHECK_EQ(show(gpipe), std::string("F0.0 F0.1 F0.2 R0.1 B0.2 R0.0 B0.1 B0.0 | "
                                    "F1.0 L1.0 F1.1 L1.1 F1.2 L1.2 R1.1 B1.2 R1.0 B1.1 B1.0"));
  Program one = gpipe_fast::one_f_one_b_program(3, 4);
  gpipe_fast::add_recompute(one, Checkpoint::ExceptLast);
  // 1F1B: on the last stage every backward follows its forward; elsewhere all recompute, the
  // next one ahead of the backward before it when its forward has run.
  CHECK_EQ(show(one), std::string("F0.0 F0.1 F0.2 R0.0 R0.1 B0.0 F0.3 R0.2 B0.1 R0.3 B0.2 B0.3 | "
                                  "F1.0 F1.1 R1.0 R1.1 B1.0 F1.2 R1.2 B1.1 F1.3 R1.3 B1.2 B1.3 | "
                                  "F2.0 L2.0 B2.0 F2.1 L2.1 B2.1 F2.2 L2.2 B2.2 F2.3 L2.3 B2.3"));
  const auto flags = gpipe_fast::recomputed(one, 3, 4);
  CHECK(flags[0] == (std::vector<bool>{true, true, true, true}));
  CHECK(flags[2] == (std::vector<bool>{false, false, false, false}));
}

TEST(recompute_never_adds_nothing) {
  Program p = gpipe_fast::zero_bubble_program(3, 4);
  const std::string before = show(p);
  gpipe_fast::add_recompute(p, Checkpoint::Never);
  CHECK_EQ(show(p), before);
}

// -- the phase schedules of pipe(x) + loss.backward() -------------------------------------------

TEST(schedule_gpipe_forward_exact_k2_m3) {
  const Schedule s = gpipe_fast::gpipe_forward(2, 3);
  CHECK_EQ(s.stages(), 2);
  CHECK_EQ(s.workers(), 2);
  CHECK_EQ(s.microbatches(), 3);
  CHECK_EQ(show(s), std::string("F0.0 F0.1 F0.2 | F1.0 F1.1 F1.2"));
  CHECK_EQ(deps(s), std::string("0:[] 1:[] 2:[] 3:[0] 4:[1] 5:[2] "));
}

TEST(schedule_gpipe_backward_exact_k2_m3_recompute) {
  const Schedule s = gpipe_fast::gpipe_backward(2, 3, {true, true, false});
  // Stage 1 first in time, micro-batches in reverse; Recompute ahead of the backward before
  // its own; B(0, m) waits for B(1, m) and, where flagged, for R(0, m).
  CHECK_EQ(show(s), std::string("R0.1 B0.2 R0.0 B0.1 B0.0 | R1.1 B1.2 R1.0 B1.1 B1.0"));
  CHECK_EQ(deps(s), std::string("0:[] 1:[6] 2:[] 3:[8,0] 4:[9,2] 5:[] 6:[] 7:[] 8:[5] 9:[7] "));
}

TEST(schedule_gpipe_backward_rejects_wrong_flag_count) {
  CHECK_THROWS(gpipe_fast::gpipe_backward(2, 3, {true, false}), InvalidArgument);
  CHECK_THROWS(gpipe_fast::gpipe_backward(2, 3, {true, false, true, true}), InvalidArgument);
}

// -- link and validate -------------------------------------------------------------------------

TEST(link_derives_dependencies_from_the_actions) {
  const Schedule s = gpipe_fast::link(gpipe_fast::one_f_one_b_program(2, 2), 2, 2);
  // Worker 0: F0.0 F0.1 B0.0 B0.1 (ids 0-3); worker 1: F1.0 L1.0 B1.0 F1.1 L1.1 B1.1 (4-9).
  CHECK_EQ(deps(s), std::string("0:[] 1:[] 2:[6,0] 3:[9,1] 4:[0] 5:[4] 6:[5,4] 7:[1] 8:[7] "
                                "9:[8,7] "));
  s.validate();
}

TEST(link_rejects_a_missing_prerequisite_and_a_misplaced_stage) {
  // A backward without the loss it needs (and no loss given).
  Program no_loss = {{{action::Forward, 0, 0}, {action::Backward, 0, 0}}};
  CHECK_THROWS(gpipe_fast::link(no_loss, 1, 1), InvalidArgument);
  gpipe_fast::link(no_loss, 1, 1, {}, {action::Loss}).validate();  // given: fine
  // Stage 1's task in worker 0's program.
  Program misplaced = {{{action::Forward, 1, 0}}, {}};
  CHECK_THROWS(gpipe_fast::link(misplaced, 2, 1), InvalidArgument);
  Program twice = {{{action::Forward, 0, 0}, {action::Forward, 0, 0}}};
  CHECK_THROWS(gpipe_fast::link(twice, 1, 1), InvalidArgument);
}

TEST(validate_rejects_backward_before_forward_on_a_stage) {
  Program swapped = {{{action::Backward, 0, 0}, {action::Forward, 0, 0}}};
  const Schedule s = gpipe_fast::link(swapped, 1, 1, {}, {action::Loss});
  std::string message;
  try {
    s.validate();
  } catch (const InvalidArgument& e) {
    message = e.what();
  }
  CHECK(message.find("backward(stage 0, micro-batch 0)") != std::string::npos);
  CHECK(message.find("which its worker runs after it") != std::string::npos);
}

TEST(validate_rejects_weight_before_input_gradient) {
  Program p = {{{action::Forward, 0, 0}, {action::Loss, 0, 0}, {action::BackwardWeight, 0, 0},
                {action::BackwardInput, 0, 0}}};
  CHECK_THROWS(gpipe_fast::link(p, 1, 1).validate(), InvalidArgument);
}

TEST(validate_finds_a_deadlock_and_names_the_waits) {
  // Worker 0 runs B0.0 before F0.1; worker 1 runs F1.1 before B1.0. B0.0 needs B1.0, which
  // waits behind F1.1, which needs F0.1, which waits behind B0.0.
  const Program deadlocked = {
      {{action::Forward, 0, 0}, {action::Backward, 0, 0}, {action::Forward, 0, 1},
       {action::Backward, 0, 1}},
      {{action::Forward, 1, 0}, {action::Loss, 1, 0}, {action::Forward, 1, 1},
       {action::Loss, 1, 1}, {action::Backward, 1, 1}, {action::Backward, 1, 0}}};
  const Schedule s = gpipe_fast::link(deadlocked, 2, 2);
  CHECK_EQ(gpipe_fast::dry_run(s).size(), std::size_t{2});
  std::string message;
  try {
    s.validate();
  } catch (const InvalidArgument& e) {
    message = e.what();
  }
  CHECK(message.find("deadlocks") != std::string::npos);
  CHECK(message.find("worker 0 waits at backward(stage 0, micro-batch 0)") != std::string::npos);
  CHECK(message.find("worker 1 waits at forward(stage 1, micro-batch 1)") != std::string::npos);
  // Control: with worker 0 in fill-drain order the same tasks run.
  Program fine = deadlocked;
  fine[0] = {{action::Forward, 0, 0}, {action::Forward, 0, 1}, {action::Backward, 0, 1},
             {action::Backward, 0, 0}};
  const Schedule ok = gpipe_fast::link(fine, 2, 2);
  CHECK(gpipe_fast::dry_run(ok).empty());
  ok.validate();
}

TEST(validate_rejects_bad_dependencies_and_loss_on_another_stage) {
  Schedule self(1, 1);
  self.add(action::Forward, 0, 0, {0});
  CHECK_THROWS(self.validate(), InvalidArgument);
  Schedule past_end(2, 1);
  past_end.add(action::Forward, 0, 0);
  past_end.add(action::Forward, 1, 0, {2});
  CHECK_THROWS(past_end.validate(), InvalidArgument);
  Schedule loss(2, 1);
  loss.add(action::Forward, 0, 0);
  loss.add(action::Loss, 0, 0, {0});
  CHECK_THROWS(loss.validate(), InvalidArgument);
}

TEST(schedule_constructor_and_add_reject_bad_arguments) {
  CHECK_THROWS(Schedule(0, 1), InvalidArgument);
  CHECK_THROWS(Schedule(1, 0), InvalidArgument);
  CHECK_THROWS(Schedule(2, 1, {0}), InvalidArgument);      // one worker for two stages
  CHECK_THROWS(Schedule(2, 1, {0, 2}), InvalidArgument);   // worker 1 has no stage
  CHECK_THROWS(gpipe_fast::gpipe_forward(0, 2), InvalidArgument);
  CHECK_THROWS(gpipe_fast::make_schedule("gpipe", 3, 2, 4, Checkpoint::Never), InvalidArgument);
  CHECK_THROWS(gpipe_fast::make_schedule("interleaved", 5, 2, 4, Checkpoint::Never), InvalidArgument);
  CHECK_THROWS(gpipe_fast::make_schedule("2f2b", 2, 2, 4, Checkpoint::Never), InvalidArgument);
  Schedule s(2, 2);
  CHECK_THROWS(s.add(action::Forward, 2, 0), InvalidArgument);
  CHECK_THROWS(s.add(action::Forward, 0, -1), InvalidArgument);
  CHECK_THROWS(s.add(99, 0, 0), InvalidArgument);
  CHECK_EQ(s.tasks().size(), std::size_t{0});
  CHECK_EQ(Schedule(4, 1, {0, 1, 0, 1}).workers(), 2);
}

TEST(actions_are_an_open_set) {
  const int before = gpipe_fast::action_count();
  CHECK(before >= 11);
  CHECK_EQ(gpipe_fast::action_info(action::BackwardWeight).name, std::string("backward_weight"));
  CHECK(gpipe_fast::find_action("loss") == std::optional<gpipe_fast::ActionId>(action::Loss));
  const auto checksum = gpipe_fast::register_action(
      "checksum_test", [](const TaskKey& t, int, int) {
        return std::vector<gpipe_fast::Need>{{{{action::Forward, t.stage, t.microbatch}}}};
      });
  CHECK_EQ(checksum, before);
  CHECK_THROWS(gpipe_fast::register_action("checksum_test", gpipe_fast::action_info(0).needs),
               InvalidArgument);
  // A schedule using it links its dependency from the rule.
  Program p = {{{action::Forward, 0, 0}, {checksum, 0, 0}}};
  const Schedule s = gpipe_fast::link(p, 1, 1);
  CHECK_EQ(deps(s), std::string("0:[] 1:[0] "));
}

// -- every generator on random layouts -------------------------------------------------------

namespace {

// Each (stage, micro-batch) runs a forward, a backward (or input and weight halves), the
// last stage a loss, and recomputes exactly where flagged.
void check_complete(const Schedule& s) {
  std::map<std::tuple<int, int, int>, int> counts;
  for (const Task& t : s.tasks()) ++counts[{t.action, t.stage, t.microbatch}];
  auto count = [&](gpipe_fast::ActionId a, int stage, int m) { return counts[{a, stage, m}]; };
  for (int stage = 0; stage < s.stages(); ++stage) {
    for (int m = 0; m < s.microbatches(); ++m) {
      CHECK_EQ(count(action::Forward, stage, m), 1);
      const int whole = count(action::Backward, stage, m);
      const int split = count(action::BackwardInput, stage, m);
      CHECK_EQ(whole + split, 1);
      CHECK_EQ(count(action::BackwardWeight, stage, m), split);
      CHECK_EQ(count(action::Loss, stage, m), stage == s.stages() - 1 ? 1 : 0);
    }
  }
}

// The most micro-batches whose forward ran and backward (input half) did not, per stage
// and per worker, walking each worker's order.
struct InFlight {
  std::vector<int> stage;
  std::vector<int> worker;
};

InFlight in_flight(const Schedule& s) {
  InFlight peak{std::vector<int>(static_cast<std::size_t>(s.stages())),
                std::vector<int>(static_cast<std::size_t>(s.workers()))};
  for (int w = 0; w < s.workers(); ++w) {
    std::vector<int> now(static_cast<std::size_t>(s.stages()));
    int total = 0;
    for (int id : s.order(w)) {
      const Task& t = s.task(id);
      const int delta = t.action == action::Forward ? 1 : is_backward(t.action) ? -1 : 0;
      now[static_cast<std::size_t>(t.stage)] += delta;
      total += delta;
      auto& p = peak.stage[static_cast<std::size_t>(t.stage)];
      p = std::max(p, now[static_cast<std::size_t>(t.stage)]);
      peak.worker[static_cast<std::size_t>(w)] = std::max(peak.worker[static_cast<std::size_t>(w)], total);
    }
  }
  return peak;
}

}  // namespace

TEST(generators_never_deadlock_on_random_layouts) {
  std::mt19937 random(20261123);
  const char* kinds[] = {"gpipe", "1f1b", "zero_bubble", "interleaved"};
  const Checkpoint modes[] = {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always};
  int checked = 0;
  const int trials = check::sweep_cases(400);
  for (int trial = 0; trial < trials; ++trial) {
    const int workers = 1 + static_cast<int>(random() % 8);
    const int chunks = 1 + static_cast<int>(random() % 4);
    const int microbatches = 1 + static_cast<int>(random() % 24);
    for (const char* kind : kinds) {
      const bool interleaved = std::string(kind) == "interleaved";
      const int stages = interleaved ? workers * chunks : workers;
      const Checkpoint mode = modes[random() % 3];
      const Schedule s = gpipe_fast::make_schedule(kind, stages, workers, microbatches, mode);
      CHECK(gpipe_fast::dry_run(s).empty());
      check_complete(s);
      const InFlight peak = in_flight(s);
      for (int k = 0; k < stages; ++k) {
        const int got = peak.stage[static_cast<std::size_t>(k)];
        if (std::string(kind) == "gpipe") {
          CHECK_EQ(got, microbatches);
        } else if (!interleaved) {
          CHECK_EQ(got, std::min(stages - k, microbatches));  // 1f1b and zero_bubble
        }
      }
      if (interleaved && chunks > 1) {
        // Megatron's bound: the warm-up's forwards plus one, per worker, with its group size
        // (workers when it divides M) replaced by the first group's (ceil(M / rounds)).
        const int rounds = std::max(1, microbatches / workers);
        const int group = (microbatches + rounds - 1) / rounds;
        for (int r = 0; r < workers; ++r) {
          const int bound = std::min((chunks - 1) * group + 2 * (workers - 1 - r) + 1,
                                     microbatches * chunks);
          CHECK(peak.worker[static_cast<std::size_t>(r)] <= bound);
        }
      }
      ++checked;
    }
  }
  CHECK_EQ(checked, 4 * trials);
}

// -- simulate ----------------------------------------------------------------------------------

namespace {

// Per-task costs: forward and recompute 1, loss 0, backward 2, its halves 1 each.
std::vector<double> unit_costs(const Schedule& s) {
  std::vector<double> cost;
  for (const Task& t : s.tasks()) {
    switch (t.action) {
      case action::Loss: cost.push_back(0.0); break;
      case action::Backward: cost.push_back(2.0); break;
      default: cost.push_back(1.0);
    }
  }
  return cost;
}

gpipe_fast::SimulatedTimeline timeline(const std::string& kind, int stages, int workers,
                                       int microbatches) {
  const Schedule s = gpipe_fast::make_schedule(kind, stages, workers, microbatches, Checkpoint::Never);
  return gpipe_fast::simulate(s, unit_costs(s));
}

}  // namespace

TEST(simulate_fill_drain_forward_unit_costs) {
  for (int k : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 4, 7, 16}) {
      const Schedule s = gpipe_fast::gpipe_forward(k, m);
      const auto t = gpipe_fast::simulate(s, std::vector<double>(s.tasks().size(), 1.0));
      CHECK_EQ(t.makespan, static_cast<double>(m + k - 1));
      const double expected = static_cast<double>(k - 1) / static_cast<double>(m + k - 1);
      CHECK(std::fabs(t.bubble - expected) < 1e-12);
      for (std::size_t id = 0; id < s.tasks().size(); ++id) {
        const Task& task = s.tasks()[id];
        CHECK_EQ(t.start[id], static_cast<double>(task.stage + task.microbatch));
      }
    }
  }
}

TEST(simulate_bubbles_of_the_schedules) {
  for (int k : {2, 4, 8}) {
    for (int m : {1, 4, 8, 32}) {
      // Each worker's work: m forwards (1) and backwards (2).
      const double work = 3.0 * m;
      const double fill_drain = static_cast<double>(k - 1) / static_cast<double>(m + k - 1);
      // GPipe and 1F1B idle 3(K-1) per worker: the fill-drain bubble (K-1)/(M+K-1).
      CHECK(std::fabs(timeline("gpipe", k, k, m).bubble - fill_drain) < 1e-9);
      CHECK(std::fabs(timeline("1f1b", k, k, m).bubble - fill_drain) < 1e-9);
      CHECK_EQ(timeline("1f1b", k, k, m).makespan, work + 3.0 * (k - 1));
      if (m < k) continue;  // too few micro-batches to fill the steady state
      // ZB-H1 idles a third of that when forward, input and weight gradients cost the same:
      // (K-1)(F + B - W) against (K-1)(F + B + W).
      CHECK_EQ(timeline("zero_bubble", k, k, m).makespan, work + 1.0 * (k - 1));
      // Interleaved with V = 2 stages per worker runs the same model in stages of half the
      // work: per worker 2 x work, idle 6(K-1) under 1F1B; interleaving halves it (Megatron:
      // the bubble divides by V).
      CHECK_EQ(timeline("interleaved", 2 * k, k, m).makespan, 2 * work + 3.0 * (k - 1));
    }
  }
}

TEST(simulate_rejects_bad_costs) {
  const Schedule s = gpipe_fast::gpipe_forward(2, 3);
  const std::size_t n = s.tasks().size();
  CHECK_THROWS(gpipe_fast::simulate(s, std::vector<double>(n - 1, 1.0)), InvalidArgument);
  std::vector<double> negative(n, 1.0);
  negative[3] = -0.5;
  CHECK_THROWS(gpipe_fast::simulate(s, negative), InvalidArgument);
  std::vector<double> nan(n, 1.0);
  nan[0] = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS(gpipe_fast::simulate(s, nan), InvalidArgument);
  CHECK_EQ(gpipe_fast::simulate(s, std::vector<double>(n, 0.0)).makespan, 0.0);
}

TEST(schedule_phases_with_several_stages_per_worker) {
  const Schedule forward = gpipe_fast::gpipe_forward(4, 2, {0, 1, 0, 1});
  CHECK_EQ(show(forward), std::string("F0.0 F0.1 F2.0 F2.1 | F1.0 F1.1 F3.0 F3.1"));
  const Schedule backward = gpipe_fast::gpipe_backward(4, 2, {true, false}, {0, 1, 0, 1});
  CHECK_EQ(show(backward), std::string("R2.0 B2.1 B2.0 R0.0 B0.1 B0.0 | R3.0 B3.1 B3.0 R1.0 B1.1 B1.0"));
}
