// Lowering onto ranks: communication workers, their order, and no deadlock across processes.
#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "check.hpp"
#include "show_program.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/generators.hpp"
#include "gpipe_fast/lower.hpp"

using gpipe_fast::Checkpoint;
using gpipe_fast::Lowered;
using gpipe_fast::Program;
using gpipe_fast::Schedule;
using gpipe_fast::TaskKey;
namespace action = gpipe_fast::action;

using show_program::show;

namespace {

std::vector<int> ranks_of(int workers, int ranks) {
  std::vector<int> out;
  for (int w = 0; w < workers; ++w) out.push_back(w % ranks);
  return out;
}

}  // namespace

TEST(lower_1f1b_on_two_ranks) {
  const Lowered l = gpipe_fast::lower(gpipe_fast::one_f_one_b_program(2, 2), 2, 2, {}, {0, 1});
  CHECK_EQ(l.compute_workers, 2);
  CHECK(l.worker_rank == (std::vector<int>{0, 1, 0, 0, 1, 1}));
  // Each send follows its producer on the compute worker; receives run on the
  // communication worker in the order their data is ready.
  CHECK_EQ(show(l.program[0]), std::string("F0.0 sF0.0 F0.1 sF0.1 B0.0 B0.1"));
  CHECK_EQ(show(l.program[1]), std::string("F1.0 L1.0 B1.0 sB1.0 F1.1 L1.1 B1.1 sB1.1"));
  CHECK_EQ(show(l.program[2]), std::string(""));  // rank 0 receives no activation
  CHECK_EQ(show(l.program[3]), std::string("rB0.0 rB0.1"));
  CHECK_EQ(show(l.program[4]), std::string("rF1.0 rF1.1"));
  CHECK_EQ(show(l.program[5]), std::string(""));
  const Schedule all = gpipe_fast::link_all(l, 2, 2);
  all.validate();
  // Rank 1 alone: its compute worker 0, its communication workers 1 and 2; stage 0 elsewhere.
  const Schedule one = gpipe_fast::link_rank(l, 2, 2, 1);
  CHECK(one.stage_workers() == (std::vector<int>{-1, 0}));
  CHECK_EQ(one.workers(), 3);
  one.validate();
  for (const auto& task : one.tasks()) CHECK_EQ(task.stage, 1);
}

TEST(lower_adds_a_gradient_reduction_per_stage_after_its_last_backward) {
  const Lowered l =
      gpipe_fast::lower(gpipe_fast::zero_bubble_program(2, 3), 2, 3, {}, {0, 1}, true);
  CHECK_EQ(show(l.program[3]).substr(show(l.program[3]).size() - 5), std::string("AR0.0"));
  CHECK_EQ(show(l.program[5]).substr(show(l.program[5]).size() - 5), std::string("AR1.0"));
  gpipe_fast::link_all(l, 2, 3).validate();
  // One process (data parallelism only): no sends, one reduction per stage.
  const Lowered local = gpipe_fast::lower(gpipe_fast::gpipe_program(2, 2), 2, 2, {}, {}, true);
  CHECK_EQ(show(local.program[3]), std::string("AR1.0 AR0.0"));
  gpipe_fast::link_rank(local, 2, 2, 0).validate();
}

TEST(lower_rejects_bad_ranks) {
  CHECK_THROWS(gpipe_fast::lower(gpipe_fast::gpipe_program(2, 2), 2, 2, {}, {0}), gpipe_fast::InvalidArgument);
  CHECK_THROWS(gpipe_fast::lower(gpipe_fast::gpipe_program(2, 2), 2, 2, {}, {0, -1}), gpipe_fast::InvalidArgument);
  const Lowered l = gpipe_fast::lower(gpipe_fast::gpipe_program(2, 2), 2, 2, {}, {0, 1});
  CHECK_THROWS(gpipe_fast::link_rank(l, 2, 2, 2), gpipe_fast::InvalidArgument);
}

TEST(lowered_schedules_never_deadlock_and_pairs_agree_on_order) {
  std::mt19937 random(1123);
  const char* kinds[] = {"gpipe", "1f1b", "zero_bubble", "interleaved"};
  const Checkpoint modes[] = {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always};
  int checked = 0;
  const int trials = check::sweep_cases(300);
  for (int trial = 0; trial < trials; ++trial) {
    const int ranks = 1 + static_cast<int>(random() % 6);
    const int chunks = 1 + static_cast<int>(random() % 3);
    const int microbatches = 1 + static_cast<int>(random() % 13);
    const std::string kind = kinds[random() % 4];
    const bool interleaved = kind == "interleaved";
    const int stages = interleaved ? ranks * chunks : ranks;
    const Program program = gpipe_fast::make_program(kind, stages, ranks, microbatches,
                                                      modes[random() % 3]);
    std::vector<int> stage_worker;
    for (int s = 0; s < stages; ++s) stage_worker.push_back(s % ranks);
    const Lowered l = gpipe_fast::lower(program, stages, microbatches, stage_worker,
                                        ranks_of(ranks, ranks), random() % 2 == 0);
    const Schedule all = gpipe_fast::link_all(l, stages, microbatches);
    CHECK(gpipe_fast::dry_run(all).empty());
    all.validate();
    for (int rank = 0; rank < ranks; ++rank) gpipe_fast::link_rank(l, stages, microbatches, rank).validate();
    // From one rank to another, each flow's transfers (activations, gradients: each has a
    // receiving worker of its own) are sent and received in the same order.
    using Flow = std::tuple<int, int, int>;  // (from, to, flow)
    std::map<Flow, std::vector<std::pair<int, int>>> sent;      // (boundary, micro-batch)
    std::map<Flow, std::vector<std::pair<int, int>>> received;
    for (std::size_t w = 0; w < l.program.size(); ++w) {
      const int rank = l.worker_rank[w];
      for (const TaskKey& k : l.program[w]) {
        const int s = k.stage;
        const int m = k.microbatch;
        if (k.action == action::SendForward) sent[{rank, (s + 1) % ranks, 0}].push_back({s, m});
        if (k.action == action::SendBackward) sent[{rank, (s - 1) % ranks, 1}].push_back({s - 1, m});
        if (k.action == action::RecvForward) received[{(s - 1) % ranks, rank, 0}].push_back({s - 1, m});
        if (k.action == action::RecvBackward) received[{(s + 1) % ranks, rank, 1}].push_back({s, m});
      }
    }
    CHECK(sent == received);
    ++checked;
  }
  CHECK_EQ(checked, trials);
}

TEST(lowered_forward_only_runs_send_activations_and_nothing_backward) {
  // 2 stages on 2 ranks with the loss: the send follows its forward; no gradient, no reduction.
  const Lowered l =
      gpipe_fast::lower(gpipe_fast::forward_only_program("1f1b", 2, 2, 2), 2, 2, {}, {0, 1});
  CHECK_EQ(show(l.program[0]), std::string("F0.0 sF0.0 F0.1 sF0.1"));
  CHECK_EQ(show(l.program[1]), std::string("F1.0 L1.0 F1.1 L1.1"));
  CHECK_EQ(show(l.program[2]) + show(l.program[3]) + show(l.program[5]), std::string(""));
  CHECK_EQ(show(l.program[4]), std::string("rF1.0 rF1.1"));
  // Every kind on random layouts, with and without the loss: no deadlock across ranks, and
  // each rank's own schedule validates.
  std::mt19937 random(77);
  const char* kinds[] = {"gpipe", "1f1b", "zero_bubble", "interleaved"};
  for (int trial = 0; trial < 100; ++trial) {
    const int ranks = 1 + static_cast<int>(random() % 5);
    const int chunks = 1 + static_cast<int>(random() % 3);
    const int microbatches = 1 + static_cast<int>(random() % 9);
    const std::string kind = kinds[random() % 4];
    const int stages = kind == "interleaved" ? ranks * chunks : ranks;
    const Program program = gpipe_fast::forward_only_program(kind, stages, ranks, microbatches,
                                                             random() % 2 == 0);
    std::vector<int> stage_worker;
    for (int s = 0; s < stages; ++s) stage_worker.push_back(s % ranks);
    const Lowered lowered = gpipe_fast::lower(program, stages, microbatches, stage_worker,
                                              ranks_of(ranks, ranks));
    CHECK(gpipe_fast::dry_run(gpipe_fast::link_all(lowered, stages, microbatches)).empty());
    for (const auto& order : lowered.program) {
      for (const TaskKey& k : order) {
        CHECK(k.action == action::Forward || k.action == action::Loss ||
              k.action == action::SendForward || k.action == action::RecvForward);
      }
    }
    for (int rank = 0; rank < ranks; ++rank) {
      gpipe_fast::rank_schedule(program, stages, microbatches, stage_worker, ranks_of(ranks, ranks),
                                false, rank);
    }
  }
}

TEST(inline_receives_run_on_the_compute_worker_right_before_their_task) {
  // Both ranks take their messages themselves: each receive goes right before the forward
  // or backward that needs it, and the communication workers are left empty.
  const Lowered both =
      gpipe_fast::lower(gpipe_fast::one_f_one_b_program(2, 2), 2, 2, {}, {0, 1}, false, {}, {0, 1});
  CHECK_EQ(show(both.program[0]), std::string("F0.0 sF0.0 F0.1 sF0.1 rB0.0 B0.0 rB0.1 B0.1"));
  CHECK_EQ(show(both.program[1]), std::string("rF1.0 F1.0 L1.0 B1.0 sB1.0 rF1.1 F1.1 L1.1 B1.1 sB1.1"));
  for (std::size_t w = 2; w < both.program.size(); ++w) CHECK_EQ(show(both.program[w]), std::string(""));
  CHECK(gpipe_fast::dry_run(gpipe_fast::link_all(both, 2, 2)).empty());
  // Rank 1 only: rank 0 keeps its receiving worker; a reduction stays on the gradient worker.
  const Lowered one =
      gpipe_fast::lower(gpipe_fast::one_f_one_b_program(2, 2), 2, 2, {}, {0, 1}, true, {}, {1});
  CHECK_EQ(show(one.program[0]), std::string("F0.0 sF0.0 F0.1 sF0.1 B0.0 B0.1"));
  CHECK_EQ(show(one.program[3]), std::string("rB0.0 rB0.1 AR0.0"));
  CHECK_EQ(show(one.program[1]).substr(0, 11), std::string("rF1.0 F1.0 "));
  CHECK_EQ(show(one.program[4]), std::string(""));
  CHECK_EQ(show(one.program[5]), std::string("AR1.0"));
  gpipe_fast::link_all(one, 2, 2).validate();
  CHECK_THROWS(gpipe_fast::lower(gpipe_fast::gpipe_program(2, 2), 2, 2, {}, {0, 1}, false, {}, {2}),
               gpipe_fast::InvalidArgument);
}

TEST(inline_receives_never_deadlock_and_each_precedes_the_task_that_needs_it) {
  std::mt19937 random(2024);
  const char* kinds[] = {"gpipe", "1f1b", "zero_bubble", "interleaved"};
  const Checkpoint modes[] = {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always};
  for (int trial = 0; trial < 200; ++trial) {
    const int ranks = 1 + static_cast<int>(random() % 5);
    const int chunks = 1 + static_cast<int>(random() % 3);
    const int microbatches = 1 + static_cast<int>(random() % 9);
    const std::string kind = kinds[random() % 4];
    const int stages = kind == "interleaved" ? ranks * chunks : ranks;
    const bool forward_only = random() % 4 == 0;
    const Program program =
        forward_only ? gpipe_fast::forward_only_program(kind, stages, ranks, microbatches, true)
                     : gpipe_fast::make_program(kind, stages, ranks, microbatches, modes[random() % 3]);
    std::vector<int> stage_worker;
    for (int s = 0; s < stages; ++s) stage_worker.push_back(s % ranks);
    std::vector<int> inline_ranks;
    for (int rank = 0; rank < ranks; ++rank) {
      if (random() % 3 != 0) inline_ranks.push_back(rank);
    }
    // Skips from the first stage to every later stage: receives of their own.
    gpipe_fast::SkipPairs skips;
    for (int s = 1; s < stages && random() % 2 == 0; ++s) skips.emplace_back(0, s);
    const Lowered l = gpipe_fast::lower(program, stages, microbatches, stage_worker,
                                        ranks_of(ranks, ranks), random() % 2 == 0, skips,
                                        inline_ranks);
    const Schedule all = gpipe_fast::link_all(l, stages, microbatches);
    CHECK(gpipe_fast::dry_run(all).empty());
    all.validate();
    for (int rank = 0; rank < ranks; ++rank) gpipe_fast::link_rank(l, stages, microbatches, rank).validate();
    for (std::size_t w = 0; w < l.program.size(); ++w) {
      const bool compute = static_cast<int>(w) < l.compute_workers;
      const bool takes_inline = std::find(inline_ranks.begin(), inline_ranks.end(),
                                          l.worker_rank[w]) != inline_ranks.end();
      const auto& order = l.program[w];
      auto receives = [&](std::size_t i) {
        const auto a = order[i].action;
        return a == action::RecvForward || a == action::RecvBackward || a == action::RecvSkips ||
               a == action::RecvSkipGrads;
      };
      for (std::size_t i = 0; i < order.size(); ++i) {
        const TaskKey& k = order[i];
        if (!receives(i)) continue;
        CHECK(compute == takes_inline);  // an inline rank's receives are all on compute workers
        if (!compute) continue;
        std::size_t next = i + 1;  // the first task after this run of receives needs it
        while (next < order.size() && receives(next)) ++next;
        CHECK(next < order.size());
        const TaskKey& user = order[next];
        const bool forward = k.action == action::RecvForward || k.action == action::RecvSkips;
        CHECK(user.stage == k.stage && user.microbatch == k.microbatch);
        if (forward) {
          CHECK(user.action == action::Forward);
        } else {
          CHECK(user.action == action::Backward || user.action == action::BackwardInput);
        }
      }
    }
  }
}
