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

from gpipe_fast.distributed.dist_transport import DistTransport
from gpipe_fast.nn.microbatch import Value, as_tensors, batch_size, gather, scatter
from gpipe_fast.runtime.inputs import check_loss_arguments, loss_weights, rank_share, scatter_target
from gpipe_fast.runtime.pipeline import Pipeline
from gpipe_fast.runtime.step import LossFn, Step


def eval_step(
    pipeline: Pipeline, input: Value | None, target: Any, loss_fn: LossFn, *, chunks: int,
    reduction: str,
) -> Tensor:  # fmt: skip
    """The whole batch's loss (over every replica with dp_group), weighted as train_step
    weighs it, on every rank; see GPipe.eval_step."""
    check_loss_arguments(loss_fn, reduction)
    if pipeline.groups is not None:
        return _eval_step_across_processes(pipeline, input, target, loss_fn, chunks, reduction)
    given = as_tensors(input, "input")
    batch = batch_size(given, "input")
    with torch.no_grad():
        microbatches = scatter(given[0] if isinstance(input, Tensor) else given, chunks)
        targets = scatter_target(target, batch, chunks)
    step = _evaluation(pipeline, microbatches, len(microbatches), len(given))
    _set_loss(step, loss_fn, targets, loss_weights(batch, batch, chunks, reduction))
    schedule = pipeline.schedules.forward_only(step.count, loss=True)
    if pipeline.tied:
        pipeline.tied.before_step()
    return pipeline._committed(lambda: step.train(schedule))  # type: ignore[no-any-return]


def forward_across_processes(pipeline: Pipeline, input: Value | None, chunks: int) -> Value | None:
    """pipe(x) under no_grad with pp_group: the output of the whole (this replica's) batch
    on the last cell's rank, None on the others. Cell 0's rank needs `input`."""
    share = rank_share(pipeline, input, None, chunks, needs_target=False)
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
    groups = pipeline.groups
    assert groups is not None
    share = rank_share(pipeline, input, target, chunks, needs_target=True)
    step = _evaluation(pipeline, share.microbatches, share.count, len(share.given))
    weights = loss_weights(share.batch, share.total, chunks, reduction)
    _set_loss(step, loss_fn, share.targets, weights)
    schedule = pipeline.schedules.forward_only(share.count, loss=True)
    local = _run_across_processes(pipeline, step, schedule)
    try:
        return groups.loss(local)
    except BaseException as error:
        pipeline.task_failed(error)
        raise


def _evaluation(pipeline: Pipeline, microbatches: list[Value], count: int, inputs: int) -> Step:
    """A step that records no graph: nothing needs a gradient and nothing is checkpointed."""
    never = [[False] * count for _ in pipeline.cells]
    return Step(pipeline, microbatches, [False] * inputs, never, False, count=count)


def _set_loss(step: Step, loss_fn: LossFn, targets: list[Any], weights: list[float]) -> None:
    context = step.context
    context.loss_fn = loss_fn
    context.targets = targets
    context.loss_weights = weights


def _run_across_processes(pipeline: Pipeline, step: Step, schedule: Any) -> Tensor | None:
    """Runs this rank's schedule and waits for its sends; a failure is told to every rank.
    This rank's losses (None without the last cell, or without loss tasks)."""
    try:
        if pipeline.tied:
            pipeline.tied.before_step()
        local = pipeline._committed(lambda: step.train(schedule))
        transport = step.context.transport
        if isinstance(transport, DistTransport):
            transport.finish()
    except BaseException as error:
        pipeline.task_failed(error)
        raise
    return local  # type: ignore[no-any-return]
