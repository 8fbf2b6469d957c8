// The schedule kinds: one entry each, and what is derived from the entries.
#include "gpipe_fast/kinds.hpp"

#include <algorithm>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {
namespace {

Program gpipe(int stages, int, int microbatches) { return gpipe_program(stages, microbatches); }
Program one_f_one_b(int stages, int, int microbatches) {
  return one_f_one_b_program(stages, microbatches);
}
Program zero_bubble(int stages, int, int microbatches) {
  return zero_bubble_program(stages, microbatches);
}
Program zbv(int stages, int, int microbatches) { return zbv_program(stages, microbatches); }

std::string known_names() {
  std::string out;
  for (const ScheduleKind& kind : schedule_kinds()) {
    out += (out.empty() ? "'" : ", '") + kind.name + "'";
  }
  return out;
}

}  // namespace

int round_robin(int stage, int, int workers) { return stage % workers; }

int zigzag(int stage, int, int workers) {
  const int round = stage / workers;
  const int position = stage % workers;
  return round % 2 == 0 ? position : workers - 1 - position;
}

const std::vector<ScheduleKind>& schedule_kinds() {
  static const std::vector<ScheduleKind> kinds = {
      {"gpipe", gpipe, round_robin, 1, false, "fill-drain: every forward, then every backward"},
      {"1f1b", one_f_one_b, round_robin, 1, false,
       "one forward, one backward: K-k micro-batches in flight on stage k"},
      {"interleaved", interleaved_program, round_robin, 0, false,
       "Megatron's interleaved 1F1B: V stages per worker, stage s on worker s mod W"},
      {"zero_bubble", zero_bubble, round_robin, 1, true,
       "ZB-H1: 1F1B with weight gradients deferred into the bubbles"},
      {"zbv", zbv, zigzag, 2, true,
       "ZB-V: two stages per worker in a V (w and 2W-1-w), weight gradients in the waits"},
  };
  return kinds;
}

const ScheduleKind& schedule_kind(const std::string& name) {
  const auto& kinds = schedule_kinds();
  const auto it = std::find_if(kinds.begin(), kinds.end(),
                               [&](const ScheduleKind& kind) { return kind.name == name; });
  GF_EXPECTS(it != kinds.end(),
             "schedule must be one of " + known_names() + ", got '" + name + "'");
  return *it;
}

void check_layout(const ScheduleKind& kind, int stages, int workers) {
  GF_EXPECTS(stages >= 1, "stages must be >= 1, got " + std::to_string(stages));
  GF_EXPECTS(workers >= 1, "workers must be >= 1, got " + std::to_string(workers));
  const std::string got =
      ": got " + std::to_string(stages) + " stages on " + std::to_string(workers) + " workers";
  if (kind.stages_per_worker == 0) {
    GF_EXPECTS(stages % workers == 0, "schedule '" + kind.name + "' needs stages (" +
                                          std::to_string(stages) + ") to be a multiple of workers (" +
                                          std::to_string(workers) + ")");
    return;
  }
  const int per = kind.stages_per_worker;
  GF_EXPECTS(stages == per * workers,
             "schedule '" + kind.name + "' runs " +
                 (per == 1 ? std::string("one stage") : std::to_string(per) + " stages") +
                 " per worker" + got);
}

std::vector<int> placement(const std::string& name, int stages, int workers) {
  const ScheduleKind& kind = schedule_kind(name);
  check_layout(kind, stages, workers);
  std::vector<int> out;
  for (int s = 0; s < stages; ++s) out.push_back(kind.placement(s, stages, workers));
  return out;
}

Program make_program(const std::string& name, int stages, int workers, int microbatches,
                     Checkpoint checkpoint) {
  GF_EXPECTS(microbatches >= 1, "microbatches must be >= 1, got " + std::to_string(microbatches));
  const ScheduleKind& kind = schedule_kind(name);
  check_layout(kind, stages, workers);
  Program program = kind.generate(stages, workers, microbatches);
  add_recompute(program, checkpoint);
  return program;
}

Schedule make_schedule(const std::string& kind, int stages, int workers, int microbatches,
                       Checkpoint checkpoint) {
  Program program = make_program(kind, stages, workers, microbatches, checkpoint);
  Schedule schedule =
      link(program, stages, microbatches, placement(kind, stages, workers));
  schedule.validate();
  return schedule;
}

Program forward_only_program(const std::string& kind, int stages, int workers, int microbatches,
                             bool loss) {
  Program program = make_program(kind, stages, workers, microbatches, Checkpoint::Never);
  for (auto& order : program) {
    const auto dropped = [loss](const TaskKey& key) {
      return !(key.action == action::Forward || (loss && key.action == action::Loss));
    };
    order.erase(std::remove_if(order.begin(), order.end(), dropped), order.end());
  }
  return program;
}

Schedule make_forward_schedule(const std::string& kind, int stages, int workers,
                               int microbatches, bool loss) {
  Schedule schedule = link(forward_only_program(kind, stages, workers, microbatches, loss), stages,
                           microbatches, placement(kind, stages, workers));
  schedule.validate();
  return schedule;
}

double ideal_bubble(const std::string& kind, int stages, int workers, int microbatches) {
  const Schedule schedule = make_schedule(kind, stages, workers, microbatches, Checkpoint::Never);
  return simulate(schedule, equal_stage_costs(schedule)).bubble;
}

}  // namespace gpipe_fast
