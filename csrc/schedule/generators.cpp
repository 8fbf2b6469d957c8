// The schedule generators, recompute placement, and linking a program into a schedule.
#include "gpipe_fast/generators.hpp"

#include <algorithm>
#include <deque>
#include <functional>
#include <optional>
#include <unordered_map>
#include <utility>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {
namespace {

using namespace action;

void check_sizes(int stages, int microbatches) {
  GF_EXPECTS(stages >= 1, "stages must be >= 1, got " + std::to_string(stages));
  GF_EXPECTS(microbatches >= 1, "microbatches must be >= 1, got " + std::to_string(microbatches));
}

// A forward, and on the last stage the micro-batch's loss right after it.
void add_forward(std::vector<TaskKey>& out, int stage, int microbatch, int stages) {
  out.push_back({Forward, stage, microbatch});
  if (stage == stages - 1) out.push_back({Loss, stage, microbatch});
}

bool is_backward(ActionId a) { return a == Backward || a == BackwardInput; }

struct KeyHash {
  std::size_t operator()(const TaskKey& k) const {
    return (static_cast<std::size_t>(k.action) * 1000003u + static_cast<std::size_t>(k.stage)) *
               1000003u +
           static_cast<std::size_t>(k.microbatch);
  }
};

// Inserts Recompute(s, m) wherever should(s, m) holds (see add_recompute for the placement).
// `forward_given`: the forwards ran before this program (a backward-only run).
void insert_recomputes(Program& program, const std::function<bool(int, int)>& should,
                       bool forward_given) {
  for (auto& order : program) {
    // Per index of `order`: the recomputes to run just before it, in insertion order.
    std::vector<std::vector<TaskKey>> before(order.size());
    std::unordered_map<TaskKey, std::size_t, KeyHash> position;
    for (std::size_t i = 0; i < order.size(); ++i) position[order[i]] = i;
    // The backwards of each stage in the order they run.
    std::unordered_map<int, std::vector<std::size_t>> backwards;
    for (std::size_t i = 0; i < order.size(); ++i) {
      if (is_backward(order[i].action)) backwards[order[i].stage].push_back(i);
    }
    for (auto& [stage, indices] : backwards) {
      for (std::size_t j = 0; j < indices.size(); ++j) {
        const int m = order[indices[j]].microbatch;
        if (!should(stage, m)) continue;
        const auto forward = position.find({Forward, stage, m});
        GF_EXPECTS(forward_given || forward != position.end(),
                   "recompute of stage " + std::to_string(stage) + ", micro-batch " +
                       std::to_string(m) + " has no forward in the program");
        std::size_t target = indices[j];
        if (j > 0 && (forward == position.end() || forward->second < indices[j - 1])) {
          target = indices[j - 1];  // ahead: rebuild while waiting for the previous gradient
        }
        before[target].push_back({Recompute, stage, m});
      }
    }
    std::vector<TaskKey> out;
    out.reserve(order.size() * 2);
    for (std::size_t i = 0; i < order.size(); ++i) {
      out.insert(out.end(), before[i].begin(), before[i].end());
      out.push_back(order[i]);
    }
    order = std::move(out);
  }
}

}  // namespace

Checkpoint parse_checkpoint(const std::string& name) {
  if (name == "never") return Checkpoint::Never;
  if (name == "except_last") return Checkpoint::ExceptLast;
  if (name == "always") return Checkpoint::Always;
  throw InvalidArgument("checkpoint must be 'always', 'except_last' or 'never', got '" + name + "'");
}

Schedule link(const Program& program, int stages, int microbatches, std::vector<int> stage_worker,
              std::vector<ActionId> given, const ExtraNeeds& extra) {
  Schedule schedule(stages, microbatches, std::move(stage_worker),
                    static_cast<int>(program.size()));
  schedule.set_given(std::move(given));
  // Ids in worker-major order, known before any task is added so deps can point forward.
  std::unordered_map<TaskKey, int, KeyHash> id_of;
  int next = 0;
  for (std::size_t worker = 0; worker < program.size(); ++worker) {
    for (const TaskKey& key : program[worker]) {
      GF_EXPECTS(key.stage >= 0 && key.stage < stages,
                 describe(key) + ": stage out of range [0, " + std::to_string(stages) + ")");
      GF_EXPECTS(action_info(key.action).communication ||
                     schedule.worker_of(key.stage) == static_cast<int>(worker),
                 describe(key) + " is in worker " + std::to_string(worker) +
                     "'s program, but its stage runs on worker " +
                     std::to_string(schedule.worker_of(key.stage)));
      GF_EXPECTS(id_of.emplace(key, next).second, describe(key) + " appears twice in the program");
      ++next;
    }
  }
  for (int worker = 0; worker < static_cast<int>(program.size()); ++worker) {
    for (const TaskKey& key : program[static_cast<std::size_t>(worker)]) {
      std::vector<int> deps;
      std::vector<Need> needs = action_info(key.action).needs(key, stages, microbatches);
      if (extra) {
        for (Need& need : extra(key)) needs.push_back(std::move(need));
      }
      for (const Need& need : needs) {
        int found = -1;
        for (const TaskKey& option : need.any_of) {
          const auto it = id_of.find(option);
          if (it != id_of.end()) {
            found = it->second;
            break;
          }
        }
        if (found >= 0) {
          deps.push_back(found);
          continue;
        }
        const bool given_elsewhere =
            std::any_of(need.any_of.begin(), need.any_of.end(),
                        [&](const TaskKey& option) { return schedule.is_given(option.action); });
        GF_EXPECTS(!need.required || given_elsewhere,
                   describe(key) + " needs " + describe(need.any_of.front()) +
                       ", which the program does not hold");
      }
      schedule.add(key.action, key.stage, key.microbatch, std::move(deps), worker);
    }
  }
  return schedule;
}

Program gpipe_program(int stages, int microbatches) {
  check_sizes(stages, microbatches);
  Program program(static_cast<std::size_t>(stages));
  for (int k = 0; k < stages; ++k) {
    auto& out = program[static_cast<std::size_t>(k)];
    for (int m = 0; m < microbatches; ++m) add_forward(out, k, m, stages);
    for (int m = microbatches - 1; m >= 0; --m) out.push_back({Backward, k, m});
  }
  return program;
}

namespace {

// 1F1B's shape on stage k, with `backward(m)` emitting what a backward is.
void one_f_one_b(std::vector<TaskKey>& out, int k, int stages, int microbatches,
                 const std::function<void(int)>& backward) {
  const int warmup = std::min(stages - 1 - k, microbatches);
  for (int m = 0; m < warmup; ++m) add_forward(out, k, m, stages);
  for (int i = 0; i < microbatches - warmup; ++i) {
    add_forward(out, k, warmup + i, stages);
    backward(i);
  }
  for (int i = microbatches - warmup; i < microbatches; ++i) backward(i);
}

}  // namespace

Program one_f_one_b_program(int stages, int microbatches) {
  check_sizes(stages, microbatches);
  Program program(static_cast<std::size_t>(stages));
  for (int k = 0; k < stages; ++k) {
    auto& out = program[static_cast<std::size_t>(k)];
    one_f_one_b(out, k, stages, microbatches, [&](int m) { out.push_back({Backward, k, m}); });
  }
  return program;
}

Program zero_bubble_program(int stages, int microbatches) {
  check_sizes(stages, microbatches);
  Program program(static_cast<std::size_t>(stages));
  for (int k = 0; k < stages; ++k) {
    auto& out = program[static_cast<std::size_t>(k)];
    // Stage k keeps up to k weight gradients pending: stages further down the pipe wait
    // longer for gradients in the cool-down, and fill that wait with them.
    std::deque<int> pending;
    one_f_one_b(out, k, stages, microbatches, [&](int m) {
      out.push_back({BackwardInput, k, m});
      pending.push_back(m);
      while (pending.size() > static_cast<std::size_t>(k)) {
        out.push_back({BackwardWeight, k, pending.front()});
        pending.pop_front();
      }
    });
    for (int m : pending) out.push_back({BackwardWeight, k, m});
  }
  return program;
}

Program interleaved_program(int stages, int workers, int microbatches) {
  check_sizes(stages, microbatches);
  GF_EXPECTS(workers >= 1, "workers must be >= 1, got " + std::to_string(workers));
  GF_EXPECTS(stages % workers == 0, "interleaved needs stages (" + std::to_string(stages) +
                                        ") to be a multiple of workers (" +
                                        std::to_string(workers) + ")");
  const int chunks = stages / workers;
  if (chunks == 1) return one_f_one_b_program(stages, microbatches);
  // Micro-batches in groups that go depth first through a worker's stages: Megatron's
  // groups of `workers` when they divide the micro-batches; otherwise max(1, M / workers)
  // groups of near-equal size (each at least `workers` when M >= workers), so any M works.
  // The warm-up covers the first group through all but the last local stage.
  const int rounds = std::max(1, microbatches / workers);
  std::vector<int> group_start = {0};
  for (int g = 0; g < rounds; ++g) {
    group_start.push_back(group_start.back() + microbatches / rounds + (g < microbatches % rounds ? 1 : 0));
  }
  const int first_group = group_start[1];
  Program program(static_cast<std::size_t>(workers));
  for (int r = 0; r < workers; ++r) {
    std::vector<std::pair<int, int>> forwards;
    std::vector<std::pair<int, int>> backwards;
    for (int g = 0; g < rounds; ++g) {
      const int first = group_start[static_cast<std::size_t>(g)];
      const int last = group_start[static_cast<std::size_t>(g) + 1];
      for (int v = 0; v < chunks; ++v) {
        for (int m = first; m < last; ++m) forwards.emplace_back(v * workers + r, m);
      }
      for (int v = chunks - 1; v >= 0; --v) {
        for (int m = first; m < last; ++m) backwards.emplace_back(v * workers + r, m);
      }
    }
    const int total = static_cast<int>(forwards.size());
    const int warmup = std::min((chunks - 1) * first_group + 2 * (workers - 1 - r), total);
    auto& out = program[static_cast<std::size_t>(r)];
    auto forward = [&](int i) { add_forward(out, forwards[i].first, forwards[i].second, stages); };
    auto backward = [&](int i) {
      out.push_back({Backward, backwards[static_cast<std::size_t>(i)].first,
                     backwards[static_cast<std::size_t>(i)].second});
    };
    for (int i = 0; i < warmup; ++i) forward(i);
    for (int i = 0; i < total - warmup; ++i) {
      forward(warmup + i);
      backward(i);
    }
    for (int i = total - warmup; i < total; ++i) backward(i);
  }
  return program;
}

namespace {

// One ZB-V order and its length when every task takes one tick (see zbv_program).
struct TimedProgram {
  Program program;
  int ticks = 0;
};

TimedProgram zbv_order(int stages, int microbatches, bool forward_first) {
  const int workers = stages / 2;
  const auto at = [](auto& table, int stage, int m) -> int& {
    return table[static_cast<std::size_t>(stage)][static_cast<std::size_t>(m)];
  };
  std::vector<std::vector<int>> forward_end(
      static_cast<std::size_t>(stages), std::vector<int>(static_cast<std::size_t>(microbatches), -1));
  auto input_end = forward_end;
  std::vector<int> next_forward(static_cast<std::size_t>(stages), 0);
  std::vector<int> next_input(static_cast<std::size_t>(stages), 0);
  std::vector<std::deque<TaskKey>> pending_weight(static_cast<std::size_t>(workers));
  std::vector<int> held(static_cast<std::size_t>(workers), 0);
  const int limit = 2 * workers;
  TimedProgram out{Program(static_cast<std::size_t>(workers)), 0};
  long long left = 3LL * stages * microbatches;
  for (int tick = 0, idle_ticks = 0; left > 0; ++tick) {
    const auto done = [&](int end) { return end >= 0 && end <= tick; };
    bool moved = false;
    for (int w = 0; w < workers; ++w) {
      const auto wi = static_cast<std::size_t>(w);
      const int down = w;             // stages 0 .. W-1, going down the workers
      const int up = stages - 1 - w;  // stages W .. 2W-1, coming back up
      std::optional<TaskKey> input;
      for (int s : {up, down}) {
        const int m = next_input[static_cast<std::size_t>(s)];
        if (m >= microbatches || !done(at(forward_end, s, m))) continue;
        if (s + 1 < stages && !done(at(input_end, s + 1, m))) continue;
        if (!input || m < input->microbatch) input = TaskKey{BackwardInput, s, m};
      }
      std::optional<TaskKey> forward;
      for (int s : {up, down}) {
        const int m = next_forward[static_cast<std::size_t>(s)];
        if (forward || m >= microbatches || (s > 0 && !done(at(forward_end, s - 1, m)))) continue;
        if (s == down && held[wi] + 2 > limit) continue;
        forward = TaskKey{Forward, s, m};
      }
      std::optional<TaskKey> task = forward_first ? (forward ? forward : input)
                                                  : (input ? input : forward);
      if (!task && !pending_weight[wi].empty()) {
        task = pending_weight[wi].front();
        pending_weight[wi].pop_front();
      }
      if (!task) continue;
      moved = true;
      --left;
      out.ticks = tick + 1;
      const int s = task->stage;
      const int m = task->microbatch;
      auto& order = out.program[wi];
      if (task->action == Forward) {
        add_forward(order, s, m, stages);
        at(forward_end, s, m) = tick + 1;
        ++next_forward[static_cast<std::size_t>(s)];
        if (s == down) held[wi] += 2;
      } else if (task->action == BackwardInput) {
        order.push_back(*task);
        at(input_end, s, m) = tick + 1;
        ++next_input[static_cast<std::size_t>(s)];
        pending_weight[wi].push_back({BackwardWeight, s, m});
      } else {
        order.push_back(*task);
        --held[wi];
      }
    }
    // Every task ends one tick after it starts: a tick in which nothing starts after one in
    // which nothing did means nothing is running and nothing can start.
    idle_ticks = moved ? 0 : idle_ticks + 1;
    GF_EXPECTS(idle_ticks < 2, "zbv_program: the order is stuck (a bug)");
  }
  return out;
}

}  // namespace

Program zbv_program(int stages, int microbatches) {
  check_sizes(stages, microbatches);
  GF_EXPECTS(stages % 2 == 0, "zbv runs two stages per worker: it needs an even number of "
                              "stages, got " + std::to_string(stages));
  // Each worker's order is what it does in a run where every task takes one tick (a loss
  // none): when free, a worker takes
  //   - an input gradient whose output gradient has come (the oldest micro-batch; of two,
  //     the stage further down the V, whose gradient the next worker waits for),
  //   - or a forward whose input has come, the upward stage's first (it carries its
  //     micro-batch on towards the loss); a new micro-batch enters the worker's first stage
  //     only while the worker holds fewer than 2W stage activations, counting the two each
  //     micro-batch will hold (so the upward forward always has room),
  //   - else the oldest pending weight gradient, which frees its activations,
  // and idles otherwise. Weight gradients thus fill the waits, and each worker holds at most
  // 2W stage activations (forward to weight gradient): W micro-batches of stages half as deep
  // as 1F1B's, which holds W on its first worker. No worker can wait forever: the oldest
  // unfinished micro-batch always has room on every worker, everything older having freed
  // its share. Two orders are run, input gradients first (as 1F1B) and forwards first; the
  // shorter is kept (the first on a tie): neither is the shorter for every (W, M).
  TimedProgram best = zbv_order(stages, microbatches, false);
  TimedProgram other = zbv_order(stages, microbatches, true);
  return other.ticks < best.ticks ? std::move(other.program) : std::move(best.program);
}

void add_recompute(Program& program, Checkpoint checkpoint) {
  if (checkpoint == Checkpoint::Never) return;
  // Under except_last, (stage, m) keeps its activations when its worker's next task after
  // the forward (and the loss) is that backward: they are needed at once, so dropping and
  // rebuilding them would only cost time.
  std::unordered_map<TaskKey, bool, KeyHash> keep;
  if (checkpoint == Checkpoint::ExceptLast) {
    for (const auto& order : program) {
      for (std::size_t i = 0; i < order.size(); ++i) {
        const TaskKey& forward = order[i];
        if (forward.action != Forward) continue;
        std::size_t next = i + 1;
        if (next < order.size() && order[next] == TaskKey{Loss, forward.stage, forward.microbatch}) ++next;
        keep[forward] = next < order.size() && is_backward(order[next].action) &&
                        order[next].stage == forward.stage &&
                        order[next].microbatch == forward.microbatch;
      }
    }
  }
  insert_recomputes(
      program,
      [&](int stage, int m) {
        const auto it = keep.find({Forward, stage, m});
        return it == keep.end() || !it->second;
      },
      false);
}

std::vector<std::vector<bool>> recomputed(const Program& program, int stages, int microbatches) {
  check_sizes(stages, microbatches);
  std::vector<std::vector<bool>> flags(static_cast<std::size_t>(stages),
                                       std::vector<bool>(static_cast<std::size_t>(microbatches)));
  for (const auto& order : program) {
    for (const TaskKey& key : order) {
      if (key.action != Recompute) continue;
      GF_EXPECTS(key.stage >= 0 && key.stage < stages && key.microbatch >= 0 &&
                     key.microbatch < microbatches,
                 describe(key) + " is out of range");
      flags[static_cast<std::size_t>(key.stage)][static_cast<std::size_t>(key.microbatch)] = true;
    }
  }
  return flags;
}

std::vector<std::vector<bool>> recomputed(const Schedule& schedule) {
  std::vector<std::vector<bool>> flags(static_cast<std::size_t>(schedule.stages()),
                                       std::vector<bool>(static_cast<std::size_t>(schedule.microbatches())));
  for (const Task& task : schedule.tasks()) {
    if (task.action == Recompute) {
      flags[static_cast<std::size_t>(task.stage)][static_cast<std::size_t>(task.microbatch)] = true;
    }
  }
  return flags;
}

namespace {

// Each worker's stages in increasing order (one worker per stage when `stage_worker` is empty).
std::vector<std::vector<int>> stages_by_worker(int stages, const std::vector<int>& stage_worker) {
  std::vector<std::vector<int>> out;
  for (int s = 0; s < stages; ++s) {
    const int worker = stage_worker.empty() ? s : stage_worker.at(static_cast<std::size_t>(s));
    GF_EXPECTS(worker >= 0, "stage_worker entries must be >= 0");
    if (out.size() <= static_cast<std::size_t>(worker)) out.resize(static_cast<std::size_t>(worker) + 1);
    out[static_cast<std::size_t>(worker)].push_back(s);
  }
  return out;
}

}  // namespace

Schedule gpipe_forward(int stages, int microbatches, std::vector<int> stage_worker) {
  check_sizes(stages, microbatches);
  GF_EXPECTS(stage_worker.empty() || stage_worker.size() == static_cast<std::size_t>(stages),
             "stage_worker needs one worker per stage");
  const auto by_worker = stages_by_worker(stages, stage_worker);
  Program program(by_worker.size());
  for (std::size_t w = 0; w < by_worker.size(); ++w) {
    for (int k : by_worker[w]) {
      for (int m = 0; m < microbatches; ++m) program[w].push_back({Forward, k, m});
    }
  }
  Schedule schedule = link(program, stages, microbatches, std::move(stage_worker));
  schedule.validate();
  return schedule;
}

Schedule gpipe_backward(int stages, int microbatches, const std::vector<bool>& recompute,
                        std::vector<int> stage_worker) {
  check_sizes(stages, microbatches);
  GF_EXPECTS(recompute.size() == static_cast<std::size_t>(microbatches),
             "recompute needs one flag per micro-batch: got " + std::to_string(recompute.size()) +
                 " for " + std::to_string(microbatches));
  GF_EXPECTS(stage_worker.empty() || stage_worker.size() == static_cast<std::size_t>(stages),
             "stage_worker needs one worker per stage");
  const auto by_worker = stages_by_worker(stages, stage_worker);
  Program program(by_worker.size());
  for (std::size_t w = 0; w < by_worker.size(); ++w) {
    for (auto k = by_worker[w].rbegin(); k != by_worker[w].rend(); ++k) {
      for (int m = microbatches - 1; m >= 0; --m) program[w].push_back({Backward, *k, m});
    }
  }
  insert_recomputes(
      program, [&](int, int m) { return static_cast<bool>(recompute[static_cast<std::size_t>(m)]); },
      true);
  Schedule schedule = link(program, stages, microbatches, std::move(stage_worker), {Forward, Loss});
  schedule.validate();
  return schedule;
}

}  // namespace gpipe_fast
