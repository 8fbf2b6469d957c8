// Lowering a program onto ranks: communication workers, their sends, receives and reductions.
#include "gpipe_fast/lower.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {
namespace {

// The actions that carry each message, from the registry's facts (action.hpp: Wire).
struct Carriers {
  ActionId send_activation = sender_of(Message::Activation);
  ActionId recv_activation = receiver_of(Message::Activation);
  ActionId send_skips = sender_of(Message::Skips);
  ActionId recv_skips = receiver_of(Message::Skips);
  ActionId send_gradient = sender_of(Message::Gradient);
  ActionId recv_gradient = receiver_of(Message::Gradient);
  ActionId send_skip_grads = sender_of(Message::SkipGradients);
  ActionId recv_skip_grads = receiver_of(Message::SkipGradients);
  ActionId reduce = receiver_of(Message::ReducedGradients);
};

const Wire& wire_of(ActionId action) { return action_info(action).wire; }

// A task that adds to its stage's gradients: a reduction waits for the last of them.
bool gradient_work(ActionId action) {
  const CostClass cost = action_info(action).cost;
  return cost == CostClass::Backward || cost == CostClass::BackwardInput ||
         cost == CostClass::BackwardWeight;
}

// The order key of a communication task: when its data is ready, then which transfer it
// is. A send and its receive get the same key on their two ranks.
using CommKey = std::tuple<double, int, int, int>;  // (time, flow, boundary, micro-batch)

// Flows in the order their transfers go when ready at the same time: a stage's activation
// before its skips (the order of the sends after its forward), likewise for gradients.
enum Flow { ActivationFlow, SkipFlow, GradientFlow, SkipGradientFlow, ReduceFlow };

// The lowered receives' needs on other ranks' sends that no action rule can name: a skip
// receive waits for the sends of the stages its skips come from (optional needs, so that one
// rank's own schedule, which holds no such send, drops them).
ExtraNeeds skip_matches(const SkipPairs& skips) {
  if (skips.empty()) return nullptr;
  return [skips, c = Carriers{}](const TaskKey& task) {
    std::vector<Need> needs;
    for (const auto& [stash, pop] : skips) {
      if (task.action == c.recv_skips && task.stage == pop) {
        needs.push_back(Need{{{c.send_skips, stash, task.microbatch}}, false});
      } else if (task.action == c.recv_skip_grads && task.stage == stash) {
        needs.push_back(Need{{{c.send_skip_grads, pop, task.microbatch}}, false});
      }
    }
    return needs;
  };
}

}  // namespace

Lowered lower(const Program& program, int stages, int microbatches, std::vector<int> stage_worker,
              std::vector<int> worker_rank, bool reduce_grad, const SkipPairs& skips,
              const std::vector<int>& inline_receives) {
  const Schedule plain = link(program, stages, microbatches, stage_worker);
  plain.validate();
  const int compute = plain.workers();
  if (worker_rank.empty()) worker_rank.assign(static_cast<std::size_t>(compute), 0);
  GF_EXPECTS(worker_rank.size() == static_cast<std::size_t>(compute),
             "worker_rank needs one rank per compute worker: got " +
                 std::to_string(worker_rank.size()) + " for " + std::to_string(compute));
  int ranks = 0;
  for (int rank : worker_rank) {
    GF_EXPECTS(rank >= 0, "worker_rank entries must be >= 0, got " + std::to_string(rank));
    ranks = std::max(ranks, rank + 1);
  }
  auto rank_of_stage = [&](int s) {
    return worker_rank[static_cast<std::size_t>(plain.worker_of(s))];
  };
  // The skips' pairs whose stages sit on two ranks: per stage, the stages at their other end.
  SkipPairs remote;
  std::map<int, std::vector<int>> pops_elsewhere;     // stash stage -> pop stages
  std::map<int, std::vector<int>> stashes_elsewhere;  // pop stage -> stash stages
  for (const auto& [stash, pop] : skips) {
    GF_EXPECTS(stash >= 0 && pop < stages && stash < pop,
               "a skip joins a stash stage to a later pop stage in [0, " +
                   std::to_string(stages) + "), got (" + std::to_string(stash) + ", " +
                   std::to_string(pop) + ")");
    if (rank_of_stage(stash) == rank_of_stage(pop)) continue;
    if (std::find(remote.begin(), remote.end(), std::make_pair(stash, pop)) != remote.end()) continue;
    remote.emplace_back(stash, pop);
    pops_elsewhere[stash].push_back(pop);
    stashes_elsewhere[pop].push_back(stash);
  }

  const SimulatedTimeline timeline = simulate(plain, equal_stage_costs(plain));
  const Carriers c;

  // Each rank's receives and reductions with their order keys; sends follow their producer
  // on its compute worker (a send is posted, never waited for, so it never stalls compute
  // and never waits behind a receive).
  std::vector<std::vector<std::pair<CommKey, TaskKey>>> comm(static_cast<std::size_t>(ranks));
  std::map<std::pair<int, int>, std::vector<TaskKey>> send_after;  // (worker, position) -> its sends
  std::map<int, double> last_gradient;  // stage -> when its last gradient task ends
  std::vector<int> position(plain.tasks().size(), 0);  // in its worker's order
  for (int w = 0; w < compute; ++w) {
    const auto& order = plain.order(w);
    for (std::size_t i = 0; i < order.size(); ++i) position[static_cast<std::size_t>(order[i])] = static_cast<int>(i);
  }
  // A skip receive is ready when the last of its senders' data is: (stage, m) -> time.
  std::map<std::pair<int, int>, double> skips_ready;
  std::map<std::pair<int, int>, double> skip_grads_ready;
  for (std::size_t id = 0; id < plain.tasks().size(); ++id) {
    const Task& task = plain.tasks()[id];
    const double at = timeline.end[id];
    const int s = task.stage;
    const int m = task.microbatch;
    const int here = rank_of_stage(s);
    auto& sends = send_after[{task.worker, position[id]}];
    const Message produced = wire_of(task.action).produces;
    const bool activation = produced == Message::Activation;
    if (activation && s + 1 < stages && rank_of_stage(s + 1) != here) {
      sends.push_back({c.send_activation, s, m});
      comm[static_cast<std::size_t>(rank_of_stage(s + 1))].push_back({CommKey{at, ActivationFlow, s, m}, {c.recv_activation, s + 1, m}});
    }
    if (activation && pops_elsewhere.count(s) != 0) {
      sends.push_back({c.send_skips, s, m});
      for (int pop : pops_elsewhere[s]) {
        double& ready = skips_ready[{pop, m}];
        ready = std::max(ready, at);
      }
    }
    const bool gradient = produced == Message::Gradient;
    if (gradient && s > 0 && rank_of_stage(s - 1) != here) {
      sends.push_back({c.send_gradient, s, m});
      comm[static_cast<std::size_t>(rank_of_stage(s - 1))].push_back({CommKey{at, GradientFlow, s - 1, m}, {c.recv_gradient, s - 1, m}});
    }
    if (gradient && stashes_elsewhere.count(s) != 0) {
      sends.push_back({c.send_skip_grads, s, m});
      for (int stash : stashes_elsewhere[s]) {
        double& ready = skip_grads_ready[{stash, m}];
        ready = std::max(ready, at);
      }
    }
    if (gradient_work(task.action)) {
      double& last = last_gradient[s];
      last = std::max(last, at);
    }
  }
  for (const auto& [key, at] : skips_ready) {
    const auto [s, m] = key;
    comm[static_cast<std::size_t>(rank_of_stage(s))].push_back({CommKey{at, SkipFlow, s, m}, {c.recv_skips, s, m}});
  }
  for (const auto& [key, at] : skip_grads_ready) {
    const auto [s, m] = key;
    comm[static_cast<std::size_t>(rank_of_stage(s))].push_back({CommKey{at, SkipGradientFlow, s, m}, {c.recv_skip_grads, s, m}});
  }
  if (reduce_grad) {
    for (const auto& [s, at] : last_gradient) {
      comm[static_cast<std::size_t>(rank_of_stage(s))].push_back({CommKey{at, ReduceFlow, s, 0}, {c.reduce, s, 0}});
    }
  }

  // The receives of the ranks that take them inline: each goes right before the first
  // task of its stage's compute worker that needs the message.
  std::set<std::tuple<ActionId, int, int>> inlined;  // (action, stage, micro-batch)
  std::vector<char> inline_rank(static_cast<std::size_t>(ranks), 0);
  for (int rank : inline_receives) {
    GF_EXPECTS(rank >= 0 && rank < ranks, "inline_receives names rank " + std::to_string(rank) +
                                              " of " + std::to_string(ranks));
    inline_rank[static_cast<std::size_t>(rank)] = 1;
    for (const auto& [key, task] : comm[static_cast<std::size_t>(rank)]) {
      if (task.action != c.reduce) inlined.insert({task.action, task.stage, task.microbatch});
    }
  }
  auto take = [&](std::vector<TaskKey>& out, TaskKey receive) {
    if (inlined.erase({receive.action, receive.stage, receive.microbatch}) != 0) out.push_back(receive);
  };

  Lowered lowered;
  for (int worker = 0; worker < compute; ++worker) {
    auto& out = lowered.program.emplace_back();
    const auto& order = program[static_cast<std::size_t>(worker)];
    for (std::size_t i = 0; i < order.size(); ++i) {
      const TaskKey& task = order[i];
      const Message consumed = wire_of(task.action).consumes;
      if (consumed == Message::Activation) {
        take(out, {c.recv_activation, task.stage, task.microbatch});
        take(out, {c.recv_skips, task.stage, task.microbatch});
      } else if (consumed == Message::Gradient) {
        take(out, {c.recv_gradient, task.stage, task.microbatch});
        take(out, {c.recv_skip_grads, task.stage, task.microbatch});
      }
      out.push_back(task);
      const auto sends = send_after.find({worker, static_cast<int>(i)});
      if (sends != send_after.end()) out.insert(out.end(), sends->second.begin(), sends->second.end());
    }
  }
  GF_EXPECTS(inlined.empty(), "a receive of an inline rank has no task of its rank that needs it");
  lowered.compute_workers = compute;
  lowered.stage_worker = plain.stage_workers();
  lowered.worker_rank = worker_rank;
  lowered.skips = remote;
  for (int rank = 0; rank < ranks; ++rank) {
    auto& tasks = comm[static_cast<std::size_t>(rank)];
    std::stable_sort(tasks.begin(), tasks.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    // Two communication workers: activations received on one, gradients (and reductions)
    // on the other, so that neither direction waits behind the other's late message.
    std::vector<TaskKey> activations;
    std::vector<TaskKey> gradients;
    for (const auto& [key, task] : tasks) {
      if (inline_rank[static_cast<std::size_t>(rank)] && task.action != c.reduce) continue;
      const Message received = wire_of(task.action).receives;
      const bool forward = received == Message::Activation || received == Message::Skips;
      (forward ? activations : gradients).push_back(task);
    }
    lowered.program.push_back(std::move(activations));
    lowered.program.push_back(std::move(gradients));
    lowered.worker_rank.insert(lowered.worker_rank.end(), 2, rank);
  }
  return lowered;
}

Schedule link_all(const Lowered& lowered, int stages, int microbatches) {
  return link(lowered.program, stages, microbatches, lowered.stage_worker, {},
              skip_matches(lowered.skips));
}

Schedule link_rank(const Lowered& lowered, int stages, int microbatches, int rank) {
  GF_EXPECTS(rank >= 0, "rank must be >= 0, got " + std::to_string(rank));
  // Local numbering: the rank's compute workers in order, then its communication workers.
  std::vector<int> local(lowered.program.size(), -1);
  Program program;
  for (std::size_t w = 0; w < lowered.program.size(); ++w) {
    const bool communication = static_cast<int>(w) >= lowered.compute_workers;
    if (lowered.worker_rank[w] != rank || communication) continue;
    local[w] = static_cast<int>(program.size());
    program.push_back(lowered.program[w]);
  }
  GF_EXPECTS(!program.empty(), "rank " + std::to_string(rank) + " has no stage");
  for (std::size_t w = static_cast<std::size_t>(lowered.compute_workers); w < lowered.program.size(); ++w) {
    if (lowered.worker_rank[w] == rank) {
      local[w] = static_cast<int>(program.size());
      program.push_back(lowered.program[w]);
    }
  }
  std::vector<int> stage_worker;
  for (int s = 0; s < stages; ++s) stage_worker.push_back(local[static_cast<std::size_t>(lowered.stage_worker[static_cast<std::size_t>(s)])]);
  return link(program, stages, microbatches, std::move(stage_worker), {},
              skip_matches(lowered.skips));
}

Schedule rank_schedule(const Program& program, int stages, int microbatches,
                       std::vector<int> stage_worker, std::vector<int> worker_rank,
                       bool reduce_grad, int rank, const SkipPairs& skips,
                       const std::vector<int>& inline_receives) {
  const Lowered lowered = lower(program, stages, microbatches, std::move(stage_worker),
                                std::move(worker_rank), reduce_grad, skips, inline_receives);
  link_all(lowered, stages, microbatches).validate();  // every rank at once: no deadlock
  Schedule schedule = link_rank(lowered, stages, microbatches, rank);
  schedule.validate();
  return schedule;
}

Lowered lower_schedule(const std::string& kind, int stages, int workers, int microbatches,
                       Checkpoint checkpoint, std::vector<int> worker_rank, bool reduce_grad,
                       const SkipPairs& skips, const std::vector<int>& inline_receives) {
  return lower(make_program(kind, stages, workers, microbatches, checkpoint), stages,
               microbatches, placement(kind, stages, workers), std::move(worker_rank),
               reduce_grad, skips, inline_receives);
}

Schedule rank_schedule(const std::string& kind, int stages, int workers, int microbatches,
                       Checkpoint checkpoint, std::vector<int> worker_rank, bool reduce_grad,
                       int rank, const SkipPairs& skips, const std::vector<int>& inline_receives) {
  return rank_schedule(make_program(kind, stages, workers, microbatches, checkpoint), stages,
                       microbatches, placement(kind, stages, workers), std::move(worker_rank),
                       reduce_grad, rank, skips, inline_receives);
}

Schedule rank_forward_schedule(const std::string& kind, int stages, int workers,
                               int microbatches, bool loss, std::vector<int> worker_rank,
                               int rank, const SkipPairs& skips,
                               const std::vector<int>& inline_receives) {
  return rank_schedule(forward_only_program(kind, stages, workers, microbatches, loss), stages,
                       microbatches, placement(kind, stages, workers), std::move(worker_rank),
                       false, rank, skips, inline_receives);
}

}  // namespace gpipe_fast
