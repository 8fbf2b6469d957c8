// The schedule kinds: one entry each, and what is derived from the entries.
#include "gpipe_fast/kinds.hpp"

#include <algorithm>
#include <mutex>
#include <utility>

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

struct KindRegistry {
  std::mutex mutex;
  std::vector<ScheduleKind> kinds;
};

// Never destroyed: a kind registered from Python holds its generator, which must not be
// released after the interpreter is gone at exit.
KindRegistry& kind_registry() {
  static KindRegistry* r = new KindRegistry{
      {},
      {
          {"gpipe", gpipe, round_robin, 1, false, "fill-drain: every forward, then every backward"},
          {"1f1b", one_f_one_b, round_robin, 1, false,
           "one forward, one backward: K-k micro-batches in flight on stage k"},
          {"interleaved", interleaved_program, round_robin, 0, false,
           "Megatron's interleaved 1F1B: V stages per worker, stage s on worker s mod W"},
          {"zero_bubble", zero_bubble, round_robin, 1, true,
           "ZB-H1: 1F1B with weight gradients deferred into the bubbles"},
          {"zbv", zbv, zigzag, 2, true,
           "ZB-V: two stages per worker in a V (w and 2W-1-w), weight gradients in the waits"},
      }};
  return *r;
}

std::string known_names(const std::vector<ScheduleKind>& kinds) {
  std::string out;
  for (const ScheduleKind& kind : kinds) {
    out += (out.empty() ? "'" : ", '") + kind.name + "'";
  }
  return out;
}

bool kind_name(const std::string& name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

// The program `kind` generates, checked: one list per worker, every task on its stage's
// worker, and a schedule that links and passes the dry run; InvalidArgument naming the kind
// otherwise.
Program checked_program(const ScheduleKind& kind, int stages, int workers, int microbatches,
                        Checkpoint checkpoint, const std::vector<int>& stage_worker) {
  const std::string prefix = "schedule '" + kind.name + "' generated an invalid program for " +
                             std::to_string(stages) + " stages on " + std::to_string(workers) +
                             " workers, " + std::to_string(microbatches) + " micro-batches: ";
  try {
    Program program = kind.generate(stages, workers, microbatches);
    GF_EXPECTS(program.size() == static_cast<std::size_t>(workers),
               "it has " + std::to_string(program.size()) + " worker lists, not " +
                   std::to_string(workers));
    for (const auto& order : program) {
      for (const TaskKey& key : order) {
        GF_EXPECTS(key.stage >= 0 && key.stage < stages && key.microbatch >= 0 &&
                       key.microbatch < microbatches,
                   "task (" + action_info(key.action).name + ", " + std::to_string(key.stage) +
                       ", " + std::to_string(key.microbatch) + ") is outside the pipeline");
      }
    }
    add_recompute(program, checkpoint);
    link(program, stages, microbatches, stage_worker).validate();
    return program;
  } catch (const InvalidArgument& error) {
    throw InvalidArgument(prefix + error.what());
  }
}

}  // namespace

int round_robin(int stage, int, int workers) { return stage % workers; }

int zigzag(int stage, int, int workers) {
  const int round = stage / workers;
  const int position = stage % workers;
  return round % 2 == 0 ? position : workers - 1 - position;
}

std::vector<ScheduleKind> schedule_kinds() {
  KindRegistry& r = kind_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.kinds;
}

ScheduleKind schedule_kind(const std::string& name) {
  KindRegistry& r = kind_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = std::find_if(r.kinds.begin(), r.kinds.end(),
                               [&](const ScheduleKind& kind) { return kind.name == name; });
  GF_EXPECTS(it != r.kinds.end(),
             "schedule must be one of " + known_names(r.kinds) + ", got '" + name + "'");
  return *it;
}

void register_schedule_kind(ScheduleKind kind) {
  GF_EXPECTS(kind_name(kind.name),
             "schedule name '" + kind.name + "' must be non-empty [a-z0-9_]");
  GF_EXPECTS(kind.generate != nullptr, "schedule '" + kind.name + "' needs a generator");
  GF_EXPECTS(kind.placement != nullptr, "schedule '" + kind.name + "' needs a placement");
  GF_EXPECTS(kind.stages_per_worker >= 0,
             "schedule '" + kind.name + "': stages_per_worker must be >= 0 (0: any), got " +
                 std::to_string(kind.stages_per_worker));
  kind.registered = true;
  KindRegistry& r = kind_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const ScheduleKind& known : r.kinds) {
    GF_EXPECTS(known.name != kind.name, "schedule '" + kind.name + "' is already registered");
  }
  r.kinds.push_back(std::move(kind));
}

void unregister_schedule_kind(const std::string& name) {
  KindRegistry& r = kind_registry();
  ScheduleKind removed;  // released after the lock: its generator may take Python's lock
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    const auto it = std::find_if(r.kinds.begin(), r.kinds.end(),
                                 [&](const ScheduleKind& kind) { return kind.name == name; });
    GF_EXPECTS(it != r.kinds.end(), "schedule '" + name + "' is not registered");
    GF_EXPECTS(it->registered, "schedule '" + name + "' is built in: it cannot be unregistered");
    removed = std::move(*it);
    r.kinds.erase(it);
  }
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
  const ScheduleKind kind = schedule_kind(name);
  check_layout(kind, stages, workers);
  std::vector<int> out;
  for (int s = 0; s < stages; ++s) {
    const int worker = kind.placement(s, stages, workers);
    GF_EXPECTS(worker >= 0 && worker < workers,
               "schedule '" + name + "' places stage " + std::to_string(s) + " on worker " +
                   std::to_string(worker) + " of " + std::to_string(workers));
    out.push_back(worker);
  }
  return out;
}

Program make_program(const std::string& name, int stages, int workers, int microbatches,
                     Checkpoint checkpoint) {
  GF_EXPECTS(microbatches >= 1, "microbatches must be >= 1, got " + std::to_string(microbatches));
  const ScheduleKind kind = schedule_kind(name);
  check_layout(kind, stages, workers);
  if (kind.registered) {
    return checked_program(kind, stages, workers, microbatches, checkpoint,
                           placement(name, stages, workers));
  }
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
  // Forward work (no recompute: Checkpoint::Never adds none) and, with `loss`, the losses.
  for (auto& order : program) {
    const auto dropped = [loss](const TaskKey& key) {
      const CostClass cost = action_info(key.action).cost;
      return !(cost == CostClass::Forward || (loss && cost == CostClass::Loss));
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
