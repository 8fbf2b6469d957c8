// Schedule generators: per-worker programs for gpipe, 1f1b, interleaved, zero-bubble and ZB-V steps.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "gpipe_fast/action.hpp"
#include "gpipe_fast/schedule.hpp"

namespace gpipe_fast {

// What each worker runs, in order: the data a generator produces (printable, comparable).
using Program = std::vector<std::vector<TaskKey>>;

// Which micro-batches drop their activations in forward and rebuild them before backward.
enum class Checkpoint { Never, ExceptLast, Always };

// "never" | "except_last" | "always"; InvalidArgument otherwise.
Checkpoint parse_checkpoint(const std::string& name);

// Needs of a task beyond its action's rule, from what the rule cannot know: which stages
// the model's skip connections join (lowering's matches of a skip receive with its sends).
using ExtraNeeds = std::function<std::vector<Need>(const TaskKey& task)>;

// A schedule running `program`, with each task's dependencies from its action's rule (and
// `extra`, when given). Stage s runs on worker stage_worker[s] (empty: one worker per stage;
// -1: in another process), program[w] runs on worker w and holds only worker w's stages'
// compute tasks (communication tasks may run on any worker). `given` actions are done
// before the run.
Schedule link(const Program& program, int stages, int microbatches,
              std::vector<int> stage_worker = {}, std::vector<ActionId> given = {},
              const ExtraNeeds& extra = nullptr);

// One training step of `stages` stages on `microbatches` micro-batches, a Loss task after
// each forward of the last stage:
// - gpipe: fill-drain, every forward, then the backwards last micro-batch first;
// - 1f1b: K-1-k forwards of warm-up on stage k, then one forward and one backward in turn,
//   then the remaining backwards; at most K-k micro-batches in flight on stage k;
// - zero_bubble: ZB-H1, 1f1b with each backward split into BackwardInput and
//   BackwardWeight, stage k deferring up to k weight gradients into its bubbles;
// - interleaved: Megatron's interleaved 1F1B with `workers` workers and stages/workers
//   stages per worker (stage s on worker s mod workers), micro-batches in groups of
//   `workers` going depth first through a worker's stages; any number of micro-batches
//   (max(1, M / workers) groups of near-equal size when `workers` does not divide M);
// - zbv: ZB-V, two stages per worker in a V (worker w runs stages w and 2W-1-w, so the
//   first and last stage share worker 0), backward split as in zero_bubble, weight
//   gradients deferred into the waits, at most 2W stage activations held per worker.
// Gpipe, 1f1b and zero_bubble run one stage per worker (workers == stages); the registry of
// schedule kinds (kinds.hpp) says where each kind places its stages.
Program gpipe_program(int stages, int microbatches);
Program one_f_one_b_program(int stages, int microbatches);
Program zero_bubble_program(int stages, int microbatches);
Program interleaved_program(int stages, int workers, int microbatches);
Program zbv_program(int stages, int microbatches);

// Adds Recompute tasks for `checkpoint`: "always" recomputes every (stage, micro-batch),
// "except_last" all but those whose backward is their stage's next task after the forward
// (and its loss), "never" none. A Recompute goes before its backward, or before the
// previous backward of its stage when its forward has run by then: the stage rebuilds the
// next micro-batch while it waits for the gradient of this one (one extra micro-batch of
// activations at most).
void add_recompute(Program& program, Checkpoint checkpoint);

// Which (stage, micro-batch) a program recomputes: flags[stage][microbatch].
std::vector<std::vector<bool>> recomputed(const Program& program, int stages, int microbatches);
std::vector<std::vector<bool>> recomputed(const Schedule& schedule);

// The two runs of a fill-drain step driven by pipe(x) and loss.backward(): the forward
// (micro-batch m runs stage k at tick m + k), and the backward, last micro-batch first, with a
// Recompute for each micro-batch flagged in `recompute`, placed ahead as in add_recompute.
// A worker with several stages (`stage_worker`, empty: one each) runs them in turn.
Schedule gpipe_forward(int stages, int microbatches, std::vector<int> stage_worker = {});
Schedule gpipe_backward(int stages, int microbatches, const std::vector<bool>& recompute,
                        std::vector<int> stage_worker = {});

}  // namespace gpipe_fast
