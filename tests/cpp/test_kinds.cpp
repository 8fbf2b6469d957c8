// The registry of schedule kinds and action facts: placement, layout checks, ideal bubbles,
// ZB-V's order, and actions given as data.
#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "check.hpp"
#include "show_program.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/generators.hpp"
#include "gpipe_fast/kinds.hpp"
#include "gpipe_fast/lower.hpp"
#include "gpipe_fast/schedule.hpp"

using gpipe_fast::Checkpoint;
using gpipe_fast::CostClass;
using gpipe_fast::InvalidArgument;
using gpipe_fast::Program;
using gpipe_fast::Schedule;
using gpipe_fast::Task;
using gpipe_fast::TaskKey;
namespace action = gpipe_fast::action;

using show_program::show;

namespace {

std::string message_of(void (*attempt)()) {
  try {
    attempt();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

// -- the registry --------------------------------------------------------------------------------

TEST(kinds_hold_their_facts) {
  std::vector<std::string> names;
  for (const auto& kind : gpipe_fast::schedule_kinds()) names.push_back(kind.name);
  CHECK(names == (std::vector<std::string>{"gpipe", "1f1b", "interleaved", "zero_bubble", "zbv"}));
  CHECK_EQ(gpipe_fast::schedule_kind("zbv").stages_per_worker, 2);
  CHECK_EQ(gpipe_fast::schedule_kind("interleaved").stages_per_worker, 0);
  CHECK_EQ(gpipe_fast::schedule_kind("1f1b").stages_per_worker, 1);
  CHECK(gpipe_fast::schedule_kind("zbv").split_backward);
  CHECK(gpipe_fast::schedule_kind("zero_bubble").split_backward);
  CHECK(!gpipe_fast::schedule_kind("1f1b").split_backward);
  const std::string unknown = message_of([] { gpipe_fast::schedule_kind("2f2b"); });
  CHECK(contains(unknown, "schedule must be one of 'gpipe', '1f1b', 'interleaved', "
                          "'zero_bubble', 'zbv', got '2f2b'"));
}

TEST(placement_follows_each_kinds_rule) {
  CHECK(gpipe_fast::placement("1f1b", 3, 3) == (std::vector<int>{0, 1, 2}));
  CHECK(gpipe_fast::placement("interleaved", 6, 2) == (std::vector<int>{0, 1, 0, 1, 0, 1}));
  // The V: worker w runs stages w and 2W-1-w; the first and last stage share worker 0.
  CHECK(gpipe_fast::placement("zbv", 8, 4) == (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0}));
  CHECK(gpipe_fast::placement("zbv", 2, 1) == (std::vector<int>{0, 0}));
  CHECK_EQ(gpipe_fast::zigzag(4, 6, 2), 0);  // the third round runs down again
  CHECK_EQ(gpipe_fast::zigzag(5, 6, 2), 1);
}

TEST(layouts_a_kind_cannot_run_are_refused_naming_the_rule) {
  CHECK(contains(message_of([] { gpipe_fast::placement("zbv", 6, 2); }),
                 "schedule 'zbv' runs 2 stages per worker: got 6 stages on 2 workers"));
  CHECK(contains(message_of([] { gpipe_fast::placement("zbv", 2, 2); }), "2 stages per worker"));
  CHECK(contains(message_of([] { gpipe_fast::placement("gpipe", 4, 2); }),
                 "schedule 'gpipe' runs one stage per worker: got 4 stages on 2 workers"));
  CHECK(contains(message_of([] { gpipe_fast::placement("interleaved", 5, 2); }),
                 "multiple of workers (2)"));
  CHECK_THROWS(gpipe_fast::placement("zbv", 4, 0), InvalidArgument);
  CHECK_THROWS(gpipe_fast::make_schedule("zbv", 3, 1, 2, Checkpoint::Never), InvalidArgument);
  CHECK_THROWS(gpipe_fast::zbv_program(3, 2), InvalidArgument);
  CHECK_THROWS(gpipe_fast::zbv_program(4, 0), InvalidArgument);
}

TEST(ideal_bubbles_are_the_closed_forms_where_there_is_one) {
  for (int k : {2, 3, 4, 8}) {
    for (int m : {1, 4, 8, 16}) {
      const double fill_drain = static_cast<double>(k - 1) / (m + k - 1);
      CHECK(std::fabs(gpipe_fast::ideal_bubble("gpipe", k, k, m) - fill_drain) < 1e-12);
      CHECK(std::fabs(gpipe_fast::ideal_bubble("1f1b", k, k, m) - fill_drain) < 1e-12);
      if (m < k) continue;  // the steady states need M >= K
      const double zb = static_cast<double>(k - 1) / (3 * m + k - 1);
      CHECK(std::fabs(gpipe_fast::ideal_bubble("zero_bubble", k, k, m) - zb) < 1e-12);
      if (m % k) continue;  // Megatron's groups
      const double interleaved = static_cast<double>(k - 1) / (2 * m + k - 1);
      CHECK(std::fabs(gpipe_fast::ideal_bubble("interleaved", 2 * k, k, m) - interleaved) < 1e-12);
    }
  }
  // ZB-V on 4 workers, 8 micro-batches: 6 ticks of work per micro-batch and worker, 3 of
  // warm-up (worker 3 starts 3 ticks late): 1 - 48 / 51.
  CHECK(std::fabs(gpipe_fast::ideal_bubble("zbv", 8, 4, 8) - 3.0 / 51.0) < 1e-12);
}

// -- ZB-V ----------------------------------------------------------------------------------------

TEST(program_zbv_two_workers_four_microbatches) {
  // Worker 0 runs stages 0 and 3 (the loss), worker 1 stages 1 and 2. Warm-up forwards down
  // the V; the upward stage's forward as soon as its input is there; input gradients first,
  // weight gradients in the waits, two micro-batches held per worker at most.
  CHECK_EQ(show(gpipe_fast::zbv_program(4, 4)),
           std::string("F0.0 F0.1 F3.0 L3.0 I3.0 F3.1 L3.1 I3.1 I0.0 W3.0 I0.1 W3.1 F0.2 W0.0 "
                       "W0.1 F3.2 L3.2 I3.2 F0.3 W3.2 I0.2 W0.2 F3.3 L3.3 I3.3 W3.3 I0.3 W0.3 | "
                       "F1.0 F2.0 F1.1 F2.1 I2.0 I1.0 I2.1 I1.1 W2.0 W1.0 W2.1 F1.2 F2.2 W1.1 "
                       "I2.2 I1.2 F1.3 F2.3 W2.2 W1.2 I2.3 I1.3 W2.3 W1.3"));
}

TEST(program_zbv_on_one_worker_runs_a_microbatch_at_a_time) {
  // One worker holds 2 stage activations: one micro-batch through both stages at a time.
  CHECK_EQ(show(gpipe_fast::zbv_program(2, 2)),
           std::string("F0.0 F1.0 L1.0 I1.0 I0.0 W1.0 W0.0 F0.1 F1.1 L1.1 I1.1 I0.1 W1.1 W0.1"));
}

namespace {

// Most stage activations a worker holds at once: forward to weight gradient (the whole
// backward when it is not split).
std::vector<int> held_per_worker(const Schedule& s) {
  std::vector<int> peak(static_cast<std::size_t>(s.workers()), 0);
  for (int w = 0; w < s.workers(); ++w) {
    int now = 0;
    for (int id : s.order(w)) {
      const Task& t = s.task(id);
      now += t.action == action::Forward ? 1
             : (t.action == action::BackwardWeight || t.action == action::Backward) ? -1
                                                                                     : 0;
      peak[static_cast<std::size_t>(w)] = std::max(peak[static_cast<std::size_t>(w)], now);
    }
  }
  return peak;
}

}  // namespace

TEST(zbv_is_valid_complete_and_bounded_for_any_layout) {
  const Checkpoint modes[] = {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always};
  int checked = 0;
  const int stride = check::sweep_stride();
  for (int workers = 1; workers <= 8; ++workers) {
    for (int m = 1; m <= 29; m += stride) {
      for (Checkpoint mode : modes) {
        const int stages = 2 * workers;
        const Schedule s = gpipe_fast::make_schedule("zbv", stages, workers, m, mode);
        CHECK(gpipe_fast::dry_run(s).empty());
        std::map<std::tuple<int, int, int>, int> counts;
        for (const Task& t : s.tasks()) ++counts[{t.action, t.stage, t.microbatch}];
        for (int stage = 0; stage < stages; ++stage) {
          for (int mb = 0; mb < m; ++mb) {
            CHECK_EQ((counts[{action::Forward, stage, mb}]), 1);
            CHECK_EQ((counts[{action::BackwardInput, stage, mb}]), 1);
            CHECK_EQ((counts[{action::BackwardWeight, stage, mb}]), 1);
            CHECK_EQ((counts[{action::Backward, stage, mb}]), 0);
            CHECK_EQ((counts[{action::Loss, stage, mb}]), stage == stages - 1 ? 1 : 0);
            const int recomputes = counts[{action::Recompute, stage, mb}];
            CHECK(mode == Checkpoint::Always ? recomputes == 1
                  : mode == Checkpoint::Never ? recomputes == 0
                                              : recomputes <= 1);
          }
        }
        for (int held : held_per_worker(s)) CHECK(held <= 2 * workers);
        const auto t = gpipe_fast::simulate(s, gpipe_fast::equal_stage_costs(s));
        if (mode == Checkpoint::Never && m >= workers) {
          // Within W - 1 ticks of the least possible: 6 per micro-batch, W - 1 of warm-up.
          CHECK(t.makespan <= 6.0 * m + 2 * (workers - 1));
        }
        ++checked;
      }
    }
  }
  CHECK_EQ(checked, 8 * check::sweep_cases(29) * 3);
}

TEST(zbv_idles_no_more_than_zero_bubble_and_about_half_as_much) {
  // The same model on the same workers: ZB-H1 in W stages, ZB-V in 2W stages of half the
  // work each. With M a multiple of W, ZB-V never idles a larger share; on 3 or 4 workers,
  // under 0.6 of it (its warm-up is as long, its work per micro-batch twice as many ticks).
  for (int workers = 2; workers <= 8; ++workers) {
    for (int m = workers; m <= 40; m += workers) {
      const double zbv = gpipe_fast::ideal_bubble("zbv", 2 * workers, workers, m);
      const double zb = gpipe_fast::ideal_bubble("zero_bubble", workers, workers, m);
      CHECK(zbv <= zb + 1e-12);
      if (workers == 3 || workers == 4) CHECK(zbv < 0.6 * zb);
    }
  }
}

TEST(zbv_lowered_onto_ranks_sends_nothing_between_the_two_middle_stages) {
  // Two ranks: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2 (one worker each).
  const auto lowered = gpipe_fast::lower_schedule("zbv", 4, 2, 3, Checkpoint::ExceptLast, {0, 1},
                                                  true);
  for (std::size_t w = 0; w < lowered.program.size(); ++w) {
    for (const TaskKey& k : lowered.program[w]) {
      const bool send = k.action == action::SendForward || k.action == action::SendBackward;
      CHECK(!(send && k.stage == 1 && k.action == action::SendForward));  // 1 -> 2: same rank
      CHECK(!(send && k.stage == 2 && k.action == action::SendBackward));
      CHECK(!(k.action == action::RecvForward && k.stage == 2));
    }
  }
  gpipe_fast::link_all(lowered, 4, 3).validate();
  const Schedule rank0 = gpipe_fast::rank_schedule("zbv", 4, 2, 3, Checkpoint::Always, {0, 1},
                                                   false, 0);
  CHECK(rank0.stage_workers() == (std::vector<int>{0, -1, -1, 0}));
  const Schedule rank1 = gpipe_fast::rank_schedule("zbv", 4, 2, 3, Checkpoint::Always, {0, 1},
                                                   false, 1);
  CHECK(rank1.stage_workers() == (std::vector<int>{-1, 0, 0, -1}));
}

TEST(zbv_lowered_schedules_never_deadlock_and_pairs_agree_on_order) {
  std::mt19937 random(77);
  const Checkpoint modes[] = {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always};
  for (int trial = 0; trial < 60; ++trial) {
    const int ranks = 1 + static_cast<int>(random() % 5);
    const int stages = 2 * ranks;
    const int m = 1 + static_cast<int>(random() % 13);
    std::vector<int> worker_rank;
    for (int r = 0; r < ranks; ++r) worker_rank.push_back(r);
    const auto lowered = gpipe_fast::lower_schedule("zbv", stages, ranks, m, modes[random() % 3],
                                                    worker_rank, random() % 2 == 0);
    const Schedule all = gpipe_fast::link_all(lowered, stages, m);
    CHECK(gpipe_fast::dry_run(all).empty());
    for (int rank = 0; rank < ranks; ++rank) gpipe_fast::link_rank(lowered, stages, m, rank).validate();
    // Each transfer between two ranks is sent and received in the same order on both.
    const auto where = gpipe_fast::placement("zbv", stages, ranks);
    auto rank_of = [&](int stage) { return where[static_cast<std::size_t>(stage)]; };
    using Flow = std::tuple<int, int, int>;
    std::map<Flow, std::vector<std::pair<int, int>>> sent, received;
    for (std::size_t w = 0; w < lowered.program.size(); ++w) {
      const int rank = lowered.worker_rank[w];
      for (const TaskKey& k : lowered.program[w]) {
        const int s = k.stage;
        if (k.action == action::SendForward) sent[{rank, rank_of(s + 1), 0}].push_back({s, k.microbatch});
        if (k.action == action::SendBackward) sent[{rank, rank_of(s - 1), 1}].push_back({s - 1, k.microbatch});
        if (k.action == action::RecvForward) received[{rank_of(s - 1), rank, 0}].push_back({s - 1, k.microbatch});
        if (k.action == action::RecvBackward) received[{rank_of(s + 1), rank, 1}].push_back({s, k.microbatch});
      }
    }
    CHECK(sent == received);
  }
}

// -- actions: cost classes and rules given as data ------------------------------------------------

TEST(actions_carry_their_cost_class) {
  CHECK(gpipe_fast::action_info(action::Forward).cost == CostClass::Forward);
  CHECK(gpipe_fast::action_info(action::Recompute).cost == CostClass::Forward);
  CHECK(gpipe_fast::action_info(action::Backward).cost == CostClass::Backward);
  CHECK(gpipe_fast::action_info(action::SendForward).cost == CostClass::None);
  CHECK_EQ(gpipe_fast::unit_cost(CostClass::Backward), 2.0);
  CHECK_EQ(gpipe_fast::unit_cost(CostClass::Loss), 0.0);
  CHECK(gpipe_fast::parse_cost_class("backward_weight") == CostClass::BackwardWeight);
  CHECK(contains(message_of([] { gpipe_fast::parse_cost_class("cheap"); }), "cost must be"));
  const Schedule s = gpipe_fast::make_schedule("1f1b", 2, 2, 1, Checkpoint::Never);
  // Worker 0: F0.0 B0.0; worker 1: F1.0 L1.0 B1.0.
  CHECK(gpipe_fast::equal_stage_costs(s) == (std::vector<double>{1, 2, 1, 0, 2}));
}

TEST(an_action_given_as_data_links_like_a_native_one) {
  using gpipe_fast::NeedSpec;
  // "probe": the previous stage's probe (itself, named before it exists) where there is
  // one, and every micro-batch's forward of its own stage. Priced as a forward.
  const int before = gpipe_fast::action_count();
  const std::vector<NeedSpec> needs = {NeedSpec{{{"probe_data_test", -1}}, false, true},
                                       NeedSpec{{{"forward", 0}}, true, true}};
  const auto probe = gpipe_fast::register_action("probe_data_test", needs, false,
                                                 CostClass::Forward);
  CHECK_EQ(probe, before);
  CHECK(gpipe_fast::action_info(probe).cost == CostClass::Forward);
  const Program program = {{{action::Forward, 0, 0}, {action::Forward, 0, 1}, {probe, 0, 0}},
                           {{action::Forward, 1, 0}, {action::Forward, 1, 1}, {probe, 1, 0}}};
  const Schedule s = gpipe_fast::link(program, 2, 2);
  // Ids: worker 0 has 0-2, worker 1 has 3-5. probe(0) waits for both forwards of stage 0
  // (there is no stage -1); probe(1) for probe(0) and both forwards of stage 1.
  CHECK(s.task(2).deps == (std::vector<int>{0, 1}));
  CHECK(s.task(5).deps == (std::vector<int>{2, 3, 4}));
  s.validate();
  CHECK_EQ(gpipe_fast::equal_stage_costs(s)[2], 1.0);
  // A required need the program does not hold is refused, as for native actions.
  const Program missing = {{{probe, 0, 0}}};
  CHECK_THROWS(gpipe_fast::link(missing, 1, 1), InvalidArgument);
}

TEST(actions_given_as_data_are_checked_and_none_is_half_added) {
  using gpipe_fast::NeedSpec;
  const int before = gpipe_fast::action_count();
  using Needs = std::vector<NeedSpec>;
  CHECK_THROWS(gpipe_fast::register_action("empty_need_test", Needs{NeedSpec{{}, false, true}}),
               InvalidArgument);
  CHECK_THROWS(gpipe_fast::register_action("unknown_need_test",
                                           Needs{NeedSpec{{{"frobnicate", 0}}, false, true}}),
               InvalidArgument);
  CHECK_THROWS(gpipe_fast::register_action("far_need_test",
                                           Needs{NeedSpec{{{"forward", 1 << 30}}, false, true}}),
               InvalidArgument);
  const Needs fine = {NeedSpec{{{"forward", 0}}, false, true}};
  CHECK_THROWS(gpipe_fast::register_action("Bad-Name", fine), InvalidArgument);
  CHECK_THROWS(gpipe_fast::register_action("_private", fine), InvalidArgument);
  CHECK_THROWS(gpipe_fast::register_action("forward", fine), InvalidArgument);
  CHECK_THROWS(gpipe_fast::register_action("no_rule_test", nullptr), InvalidArgument);
  CHECK_EQ(gpipe_fast::action_count(), before);
}

// -- actions' wire facts and kinds registered at run time ---------------------------------------

TEST(actions_name_what_they_send_and_receive) {
  using gpipe_fast::Message;
  CHECK_EQ(gpipe_fast::sender_of(Message::Activation), action::SendForward);
  CHECK_EQ(gpipe_fast::receiver_of(Message::Activation), action::RecvForward);
  CHECK_EQ(gpipe_fast::sender_of(Message::Gradient), action::SendBackward);
  CHECK_EQ(gpipe_fast::receiver_of(Message::Gradient), action::RecvBackward);
  CHECK_EQ(gpipe_fast::receiver_of(Message::Skips), action::RecvSkips);
  CHECK_EQ(gpipe_fast::sender_of(Message::SkipGradients), action::SendSkipGrads);
  CHECK_EQ(gpipe_fast::receiver_of(Message::ReducedGradients), action::ReduceGrad);
  CHECK(gpipe_fast::action_info(action::Forward).wire.produces == Message::Activation);
  CHECK(gpipe_fast::action_info(action::BackwardInput).wire.consumes == Message::Gradient);
  CHECK(gpipe_fast::action_info(action::BackwardWeight).wire.produces == Message::None);
  CHECK(gpipe_fast::parse_message("skip_gradients") == Message::SkipGradients);
  CHECK(contains(message_of([] { gpipe_fast::parse_message("mail"); }), "message must be"));
}

namespace {

// GPipe's program with its micro-batches taken last first.
Program reversed_gpipe(int stages, int, int microbatches) {
  Program program = gpipe_fast::gpipe_program(stages, microbatches);
  for (auto& order : program) {
    for (TaskKey& key : order) key.microbatch = microbatches - 1 - key.microbatch;
  }
  return program;
}

}  // namespace

TEST(a_kind_registered_at_run_time_takes_the_native_path) {
  gpipe_fast::ScheduleKind kind;
  kind.name = "reversed_gpipe_test";
  kind.generate = reversed_gpipe;
  kind.placement = gpipe_fast::round_robin;
  gpipe_fast::register_schedule_kind(kind);
  CHECK(gpipe_fast::schedule_kind("reversed_gpipe_test").registered);
  CHECK(!gpipe_fast::schedule_kind("gpipe").registered);
  CHECK_THROWS(gpipe_fast::register_schedule_kind(kind), InvalidArgument);
  gpipe_fast::make_schedule("reversed_gpipe_test", 3, 3, 4, Checkpoint::Always).validate();
  CHECK_EQ(gpipe_fast::ideal_bubble("reversed_gpipe_test", 3, 3, 4),
           gpipe_fast::ideal_bubble("gpipe", 3, 3, 4));
  // Lowered onto two ranks like a built-in kind: stage 1's first receive is micro-batch 3's.
  const auto lowered = gpipe_fast::lower_schedule("reversed_gpipe_test", 2, 2, 4,
                                                  Checkpoint::Never, {0, 1}, false);
  CHECK(lowered.program[4].front() == (TaskKey{action::RecvForward, 1, 3}));
  for (int rank : {0, 1}) {
    gpipe_fast::rank_forward_schedule("reversed_gpipe_test", 2, 2, 4, true, {0, 1}, rank)
        .validate();
  }
  gpipe_fast::unregister_schedule_kind("reversed_gpipe_test");
  CHECK_THROWS(gpipe_fast::schedule_kind("reversed_gpipe_test"), InvalidArgument);
  CHECK(contains(message_of([] { gpipe_fast::unregister_schedule_kind("gpipe"); }),
                 "built in"));
}

TEST(a_registered_kind_whose_program_is_invalid_is_named) {
  gpipe_fast::ScheduleKind kind;
  kind.name = "backward_first_test";
  kind.generate = [](int stages, int, int microbatches) {
    Program program = gpipe_fast::gpipe_program(stages, microbatches);
    for (auto& order : program) std::reverse(order.begin(), order.end());
    return program;
  };
  kind.placement = gpipe_fast::round_robin;
  gpipe_fast::register_schedule_kind(kind);
  const std::string message = message_of(
      [] { gpipe_fast::make_schedule("backward_first_test", 2, 2, 2, Checkpoint::Never); });
  gpipe_fast::unregister_schedule_kind("backward_first_test");
  CHECK(contains(message, "schedule 'backward_first_test' generated an invalid program"));
  gpipe_fast::ScheduleKind nameless = kind;
  nameless.name = "";
  CHECK_THROWS(gpipe_fast::register_schedule_kind(nameless), InvalidArgument);
  gpipe_fast::ScheduleKind no_generator = kind;
  no_generator.generate = nullptr;
  CHECK_THROWS(gpipe_fast::register_schedule_kind(no_generator), InvalidArgument);
}
