"""Evaluation without gradients: eval_step's forward-only run, and pipe(x) across processes.

Both run the forward-only schedule of the pipe's kind (csrc: forward_only_program), lowered
onto the ranks like a training step: no graph is recorded, no activation is kept for a
backward, and no `.grad` is touched. The pipe's train/eval mode and the caller's autocast
apply as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gpipe_fast.arguments import check_loss_arguments
from gpipe_fast.nn.microbatch import (
    Value,
    as_tensors,
    batch_size,
    gather,
    loss_weights,
    scatter,
    scatter_target,
)
from gpipe_fast.nn.pytree import Tree
from gpipe_fast.runtime.context import LossFn
from gpipe_fast.runtime.pipeline import Pipeline
from gpipe_fast.runtime.step import Step


def eval_step(
    pipeline: Pipeline, input: Value | None, target: Any, loss_fn: LossFn, *, chunks: int,
    reduction: str,
) -> Tensor:  # fmt: skip
    """The whole batch's loss (over every replica with dp_group), weighted as train_step
    weighs it, on every rank; see GPipe.eval_step."""
    check_loss_arguments(loss_fn, reduction)
    if pipeline.cross is not None:
        return _eval_step_across_processes(pipeline, input, target, loss_fn, chunks, reduction)
    given = as_tensors(input, "input")
    batch = batch_size(given, "input")
    with torch.no_grad():
        microbatches = scatter(given[0] if isinstance(input, Tensor) else given, chunks)
        targets = (
            scatter_target(target, batch, chunks)
            if pipeline.needs_target(target)
            else [None] * len(microbatches)
        )
    step = _evaluation(pipeline, microbatches, len(microbatches), len(given))
    step.context.set_loss(loss_fn, targets, loss_weights(batch, batch, chunks, reduction))
    schedule = pipeline.schedules.forward_only(step.count, loss=True)
    if pipeline.tied:
        pipeline.tied.before_step()
    run = pipeline.runner
    return run.committed(lambda: run.train(step, schedule))  # type: ignore[no-any-return]


def forward_across_processes(pipeline: Pipeline, input: Value | None, chunks: int) -> Tree:
    """pipe(x) under no_grad with pp_group: the output of the whole (this replica's) batch
    on the last cell's rank, None on the others. Cell 0's rank needs `input`."""
    assert pipeline.cross is not None, "a pipe across processes has its driver"
    share = pipeline.cross.share(input, None, chunks, needs_target=False)
    step = _evaluation(pipeline, share.microbatches, share.count, len(share.given))
    schedule = pipeline.schedules.forward_only(share.count, loss=False)
    _run_across_processes(pipeline, step, schedule)
    last = step.stages[-1]
    return None if last is None else gather(last.outputs)  # type: ignore[arg-type]


def _eval_step_across_processes(
    pipeline: Pipeline, input: Value | None, target: Any, loss_fn: LossFn, chunks: int,
    reduction: str,
) -> Tensor:  # fmt: skip
    """Every rank's share of an evaluation step (inputs as for train_step)."""
    cross = pipeline.cross
    assert cross is not None
    share = cross.share(input, target, chunks, needs_target=pipeline.needs_target(target))
    step = _evaluation(pipeline, share.microbatches, share.count, len(share.given))
    weights = loss_weights(share.batch, share.total, chunks, reduction)
    step.context.set_loss(loss_fn, share.targets, weights)
    schedule = pipeline.schedules.forward_only(share.count, loss=True)
    return cross.loss(_run_across_processes(pipeline, step, schedule))


def _evaluation(pipeline: Pipeline, microbatches: list[Value], count: int, inputs: int) -> Step:
    """A step that records no graph: nothing needs a gradient and nothing is checkpointed."""
    never = [[False] * count for _ in pipeline.cells]
    return Step(pipeline, microbatches, [False] * inputs, never, False, count=count)


def _run_across_processes(pipeline: Pipeline, step: Step, schedule: Any) -> Tensor | None:
    """Runs this rank's schedule through the pipe's cross-process driver; this rank's
    losses (None without the last cell, or without loss tasks)."""
    assert pipeline.cross is not None
    run = pipeline.runner
    pipeline.start_sharded_step()
    losses = pipeline.cross.run(
        lambda: run.committed(lambda: run.train(step, schedule)),
        step.context.transport,
        backward=False,
    )
    pipeline.end_sharded_step()
    return losses
