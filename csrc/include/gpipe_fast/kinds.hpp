// The registry of schedule kinds: each kind's generator, stage placement and facts, by name.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "gpipe_fast/generators.hpp"
#include "gpipe_fast/schedule.hpp"

namespace gpipe_fast {

// The program of a training step of `stages` stages on `workers` workers, without
// recomputes (make_program adds them).
using Generator = std::function<Program(int stages, int workers, int microbatches)>;
// The worker of `stage` when `stages` stages share `workers` workers.
using PlacementRule = std::function<int(int stage, int stages, int workers)>;

// Stage s on worker s mod W: one stage each when stages == workers, else V rounds.
int round_robin(int stage, int stages, int workers);
// Rounds that turn back: round v runs down the workers when v is even, up when odd. With
// two stages per worker, the V: worker w runs stages w and 2W-1-w.
int zigzag(int stage, int stages, int workers);

// Everything the rest of the runtime (and Python) knows about a schedule kind. Adding a
// schedule is a generator and a register_schedule_kind call (the built-in ones: an entry in
// the table of kinds.cpp; from Python: gpipe_fast.register_schedule_kind).
struct ScheduleKind {
  std::string name;
  Generator generate;
  PlacementRule placement;
  int stages_per_worker = 1;  // 0: any number V >= 1 (stages a multiple of the workers)
  bool split_backward = false;  // backward as BackwardInput then BackwardWeight
  std::string summary;
  // Registered at run time (not one of kinds.cpp's): its programs are validated as they are
  // made, naming the kind, and it may be unregistered.
  bool registered = false;
};

// Every kind, in the registry's order (copies: kinds may be added meanwhile).
std::vector<ScheduleKind> schedule_kinds();
// The kind named `name`; InvalidArgument ("schedule must be one of ...") otherwise.
ScheduleKind schedule_kind(const std::string& name);

// Adds `kind` (its `registered` set); InvalidArgument naming it if its name is taken, empty
// or not [a-z0-9_]+, its generator or placement is missing, or stages_per_worker < 0.
void register_schedule_kind(ScheduleKind kind);
// Removes a kind added by register_schedule_kind; InvalidArgument for a built-in or unknown
// one.
void unregister_schedule_kind(const std::string& name);

// InvalidArgument naming the rule unless `kind` runs `stages` stages on `workers` workers.
void check_layout(const ScheduleKind& kind, int stages, int workers);
// The worker of each stage under `kind` (checked as check_layout does).
std::vector<int> placement(const std::string& kind, int stages, int workers);

// The program of `kind` with its recomputes, and its linked, validated schedule (stages on
// the kind's workers).
Program make_program(const std::string& kind, int stages, int workers, int microbatches,
                     Checkpoint checkpoint);
Schedule make_schedule(const std::string& kind, int stages, int workers, int microbatches,
                       Checkpoint checkpoint);

// The forward-only run of an evaluation step (eval_step; pipe(x) across processes): the
// forwards of `kind`'s training program in its order, each forward of the last stage
// followed by its Loss when `loss`, and nothing else (no backward, no recompute). For gpipe,
// 1f1b and zero_bubble that is the fill-drain forward (every stage runs micro-batches 0..M-1
// in turn); for interleaved, the groups of micro-batches go depth first through each
// worker's stages, as in training, so that every worker starts early.
Program forward_only_program(const std::string& kind, int stages, int workers, int microbatches,
                             bool loss = true);
Schedule make_forward_schedule(const std::string& kind, int stages, int workers,
                               int microbatches, bool loss = true);

// The bubble of `kind`'s training step when every stage costs the same and nothing else
// does: its schedule simulated with equal_stage_costs, 1 - work / (workers x makespan).
double ideal_bubble(const std::string& kind, int stages, int workers, int microbatches);

}  // namespace gpipe_fast
