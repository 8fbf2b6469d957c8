// Lowers a schedule's program onto processes: sends, receives and gradient reductions.
#pragma once

#include <vector>

#include "gpipe_fast/generators.hpp"
#include "gpipe_fast/schedule.hpp"

namespace gpipe_fast {

// A program whose workers sit in several processes (ranks). Compute workers keep their
// tasks, each followed by the send of what it produced for a stage on another rank (a send
// is posted, not waited for). Each rank gets two communication workers after them (workers
// W + 2 rank and W + 2 rank + 1): one receives the activations other ranks send its stages,
// the other their gradients and (with reduce_grad) sums each stage's gradients over data
// parallelism once its last backward is done.
struct Lowered {
  Program program;
  std::vector<int> stage_worker;  // compute worker of each stage
  std::vector<int> worker_rank;   // rank of each worker, communication workers included
  int compute_workers = 0;
};

// `program`: one list per compute worker; stage s on worker stage_worker[s] (empty: one
// each); compute worker w on rank worker_rank[w] (empty: all on rank 0). Each rank's
// receives run in the order their data is ready in the schedule simulated with a forward
// (and recompute) of 1, a backward of 2 (halves of 1) and a free loss; ties go by (flow,
// boundary, micro-batch). That is the order of the sends on the sending worker, so the
// transfers from one rank to another come in the same order on both sides.
Lowered lower(const Program& program, int stages, int microbatches,
              std::vector<int> stage_worker = {}, std::vector<int> worker_rank = {},
              bool reduce_grad = false);

// The schedule of every rank at once (for the dry run: a receive waits for its send).
Schedule link_all(const Lowered& lowered, int stages, int microbatches);

// Rank `rank`'s own schedule: its compute workers, then its communication workers, numbered
// from 0 in that order; other ranks' stages at -1. Dependencies on other ranks' tasks are
// met by communication and left out.
Schedule link_rank(const Lowered& lowered, int stages, int microbatches, int rank);

// Rank `rank`'s schedule of `program` lowered onto ranks (link_rank), once the schedule of
// every rank at once (link_all) has been validated: no deadlock across processes, whatever
// the program (a training step, or the forward-only run of an evaluation).
Schedule rank_schedule(const Program& program, int stages, int microbatches,
                       std::vector<int> stage_worker, std::vector<int> worker_rank,
                       bool reduce_grad, int rank);

}  // namespace gpipe_fast
