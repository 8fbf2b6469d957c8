"""pipe(x) in one process: the fill-drain forward now, its backward when autograd reaches it.

The forward runs micro-batch m on stage k at tick m + k; the user's `loss.backward()` runs
the fill-drain backward through the nodes of bridge.py::

    forward, K=3, M=4                     backward, checkpoint="always" (R: Recompute)
    tick   0   1   2   3   4   5          stage 2: R3 R2 B3 R1 B2 R0 B1 B0
    stage0 F0  F1  F2  F3                 stage 1:    R3 R2 .. B3 R1 B2 R0 B1 B0
    stage1     F0  F1  F2  F3             stage 0:       R3 R2 .. .. B3 R1 ...
    stage2         F0  F1  F2  F3

Every other step runs as one schedule through Pipeline.run (runtime/pipeline.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gpipe_fast.nn.checkpoint import recomputed_microbatches
from gpipe_fast.nn.microbatch import Value, as_tensors, gather, scatter
from gpipe_fast.nn.pytree import Tree, map_tensors, tensors_of, with_tensors
from gpipe_fast.runtime.bridge import Enter, Exit
from gpipe_fast.runtime.step import Step

if TYPE_CHECKING:
    from gpipe_fast.runtime.pipeline import Pipeline

# pipe(x) with gradients cannot serve a pipe of several processes: loss.backward() on one rank
# would not reach the other ranks' cells, nor sum the replicas' gradients.
GROUPS_NEED_STEPS = (
    "gpipe_fast: a pipe with pp_group or dp_group cannot run pipe(x) with gradients "
    "(loss.backward() would not reach the other ranks); on every rank, train with "
    "pipe.train_step(x, target, loss_fn) and evaluate with pipe.eval_step(x, target, loss_fn), "
    "or run pipe(x) under torch.no_grad() for the output"
)


def autograd_call(
    pipeline: Pipeline, input: Value, chunks: int, checkpoint: str, training: bool
) -> Tree:
    """The output of pipe(x), whose backward (when grad mode records one) runs the pipe's
    fill-drain backward, recomputing the micro-batches `checkpoint` drops in training."""
    if pipeline.cross is not None and (torch.is_grad_enabled() or pipeline.layout.multi_process):
        raise RuntimeError(GROUPS_NEED_STEPS)  # without gradients: Pipeline.run
    with torch.no_grad():
        microbatches = scatter(input, chunks)
    given = as_tensors(input, "input")
    track = torch.is_grad_enabled() and (
        any(pipeline.learns) or any(t.requires_grad for t in given)
    )
    input_needs_grad = [track and t.requires_grad for t in given]
    flags = recomputed_microbatches(checkpoint if training else "never", len(microbatches))
    step = Step(
        pipeline, microbatches, input_needs_grad, [flags] * len(pipeline.cells), track,
        transport=pipeline.make_transport(),
    )  # fmt: skip
    if track:
        pipeline.live_steps.add(step)
    pipeline.side.before_step()
    runner = pipeline.runner
    sharding = pipeline.sharding  # replicas under no_grad (dp_group alone): FSDP's gathers
    if sharding is not None:
        sharding.start_step()
    with runner.committed():
        outputs = runner.forward(step)
    if sharding is not None:
        sharding.check_order()
        sharding.reshard()
    if not track:
        return gather(outputs)
    gathered = gather([map_tensors(Tensor.detach, o) for o in outputs])
    step.gathered = tensors_of(gathered)
    if not step.gathered:
        return gathered  # no tensor: nothing for a backward to reach, as in the plain model
    inputs = [t for t, needs in zip(given, input_needs_grad, strict=True) if needs]
    phony = Enter.apply(runner, step, pipeline.phony, *inputs)
    result = Exit.apply(step, phony)
    # The output's structure and other leaves as gathered, its tensors from Exit.
    return with_tensors(gathered, tensors_of(result))
