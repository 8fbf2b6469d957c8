// Lowers a schedule's program onto processes: sends, receives and gradient reductions.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "gpipe_fast/generators.hpp"
#include "gpipe_fast/kinds.hpp"
#include "gpipe_fast/schedule.hpp"

namespace gpipe_fast {

// A program whose workers sit in several processes (ranks). Compute workers keep their
// tasks, each followed by the send of what it produced for a stage on another rank (a send
// is posted, not waited for). Each rank gets two communication workers after them (workers
// W + 2 rank and W + 2 rank + 1): one receives the activations other ranks send its stages,
// the other their gradients and (with reduce_grad) sums each stage's gradients over data
// parallelism once its last backward is done.
//
// Skip connections: each (stash stage, pop stage) pair of `skips` whose stages sit on two
// ranks gets its own messages, past the stages in between. The stashing stage's forward is
// followed by SendSkips (one message per such pop stage), and the popping stage's forward
// waits for RecvSkips (one message per such stash stage) on its rank's activation worker;
// in backward, SendSkipGrads after the popping stage's backward, RecvSkipGrads before the
// stashing stage's, on the gradient worker. Pairs on one rank go through its memory.
//
// Inline receives: a rank of `inline_receives` runs each of its receives on the compute
// worker of the receiving stage, right before the first task that needs the message (the
// forward for activations and skips, the backward or input-gradient half for gradients), and
// only its reductions on the gradient worker. Meant for a transport where a receive is a
// copy out of memory shared with the sender, whose sends never wait (a ring with a queue):
// the compute worker would wait for the message anyway, and receiving it there saves a
// thread hand-off per message. Messages may then arrive before they are asked for (the
// transport keeps them aside by tag); the dry run still proves that no rank waits forever.
using SkipPairs = std::vector<std::pair<int, int>>;  // (stash stage, pop stage)

struct Lowered {
  Program program;
  std::vector<int> stage_worker;  // compute worker of each stage
  std::vector<int> worker_rank;   // rank of each worker, communication workers included
  int compute_workers = 0;
  SkipPairs skips;  // the pairs across ranks: their receives wait for these sends
};

// `program`: one list per compute worker; stage s on worker stage_worker[s] (empty: one
// each); compute worker w on rank worker_rank[w] (empty: all on rank 0). Each rank's
// receives run in the order their data is ready in the schedule simulated with a forward
// (and recompute) of 1, a backward of 2 (halves of 1) and a free loss; ties go by (flow,
// boundary, micro-batch). That is the order of the sends on the sending worker, so the
// transfers from one rank to another come in the same order on both sides.
Lowered lower(const Program& program, int stages, int microbatches,
              std::vector<int> stage_worker = {}, std::vector<int> worker_rank = {},
              bool reduce_grad = false, const SkipPairs& skips = {},
              const std::vector<int>& inline_receives = {});

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
                       bool reduce_grad, int rank, const SkipPairs& skips = {},
              const std::vector<int>& inline_receives = {});

// The training step of `kind` (`stages` stages on `workers` compute workers, placed by the
// kind, recomputes for `checkpoint`) lowered with compute worker w on rank worker_rank[w].
Lowered lower_schedule(const std::string& kind, int stages, int workers, int microbatches,
                       Checkpoint checkpoint, std::vector<int> worker_rank, bool reduce_grad,
                       const SkipPairs& skips = {},
              const std::vector<int>& inline_receives = {});

// Rank `rank`'s validated schedule of that step, once every rank's schedule together has
// passed the dry run (a receive waits for its send: no rank can wait forever on another).
Schedule rank_schedule(const std::string& kind, int stages, int workers, int microbatches,
                       Checkpoint checkpoint, std::vector<int> worker_rank, bool reduce_grad,
                       int rank, const SkipPairs& skips = {},
              const std::vector<int>& inline_receives = {});

// Rank `rank`'s validated forward-only schedule of `kind` (forward_only_program), lowered and
// dry-run like rank_schedule: sends after the forwards, no gradient and no reduction.
Schedule rank_forward_schedule(const std::string& kind, int stages, int workers,
                               int microbatches, bool loss, std::vector<int> worker_rank,
                               int rank, const SkipPairs& skips = {},
              const std::vector<int>& inline_receives = {});

}  // namespace gpipe_fast
