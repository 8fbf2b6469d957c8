"""The one step path: every step run as one whole schedule, on either side.

It serves train_step, eval_step, and pipe(x) without gradients across processes. A step is
data (a StepRequest: its program, how its batch is split, its loss); it runs on
one of two sides, one process (runtime/one_process.py) or across processes
(distributed/driver.py), which say what the step's share of the batch is, what happens
around this process's run (failure agreement, sums across ranks, sharded cells) and what
loss every rank gets. Ties, skips (in the transport) and the loss scale hook in here once.
pipe(x) with gradients in one process is the other path (runtime/autograd_call.py): its
backward is the user's, through autograd.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gpipe_fast.arguments import check_loss_arguments
from gpipe_fast.nn.items import item_weights
from gpipe_fast.nn.microbatch import Value, gather, loss_weights
from gpipe_fast.runtime.step import Step
from gpipe_fast.runtime.step_request import StepRequest

if TYPE_CHECKING:
    from gpipe_fast.runtime.pipeline import Pipeline


def run_step(pipeline: Pipeline, request: StepRequest, input: Value | None, target: Any) -> Any:
    """Runs `request` on the pipeline's side: the loss of the whole batch on every rank
    (train, evaluate), or the output of the whole batch where the last cell runs (forward;
    None elsewhere). A training step adds the input's gradient into the caller's tensors."""
    loss_fn = request.loss_fn if request.has_loss else None
    if request.has_loss:
        check_loss_arguments(request.loss_fn, request.reduction)
    side = pipeline.side
    needs_target = request.has_loss and pipeline.needs_target(target)
    counting = request.counting if request.has_loss else None
    share = side.share(input, target, request.chunks, needs_target=needs_target, counting=counting)
    items = share.items
    if counting is not None and counting.given is not None and items is None:
        raise ValueError(
            "num_items_in_batch: it divides a loss that averages over counted items, but "
            "the inputs hold no labels to count"
        )
    train = request.program == "train"
    if train:
        schedule, flags = pipeline.schedules.train_step(share.count, request.checkpoint)
        needs_grad = [t.requires_grad for t in share.given]
        step = Step(
            pipeline, share.microbatches, needs_grad, flags, True,
            count=share.count, split=pipeline.split_backward,
        )  # fmt: skip
    else:  # records no graph: nothing needs a gradient, nothing is checkpointed
        schedule = pipeline.schedules.forward_only(share.count, loss=request.has_loss)
        never = [[False] * share.count for _ in pipeline.cells]
        nothing = [False] * len(share.given)
        step = Step(pipeline, share.microbatches, nothing, never, False, count=share.count)
    # A model that divides its own loss by the items (num_items_in_batch) is told them.
    tell = counting.tell if counting is not None and items is not None else None
    if loss_fn is not None:
        if items is not None:
            weights = item_weights(items, divided=tell is not None)
        else:
            weights = loss_weights(share.batch, share.total, request.chunks, request.reduction)
        step.context.set_loss(loss_fn, share.targets, weights, request.loss_scale)
    runner = pipeline.runner
    tied = pipeline.tied

    def this_process() -> Tensor | None:
        if tied:
            tied.before_step()
        local = runner.committed(lambda: runner.train(step, schedule))
        step.context.transport.finish()
        if train:
            side.after_backward()
        if local is not None and items is not None and items.total == 0:
            # The mean over no item at all is undefined, as the plain model's 0/0 says (its
            # gradients stay zero here too: no micro-batch weighs anything).
            local = torch.full_like(local, float("nan"))
        return local  # type: ignore[no-any-return]

    if tell is not None:
        assert items is not None
        tell(max(items.total, 1))  # without any item, no micro-batch's loss is used
    try:
        local = side.run(this_process, backward=train)
    finally:
        if tell is not None:
            tell(None)
    if loss_fn is None:
        last = step.stages[-1]
        return None if last is None else gather(last.outputs)
    loss = side.loss(local)
    if train and share.given:
        accumulate_input_grads(share.given, step.input_needs_grad, step.context.input_grads)
    return loss


def accumulate_input_grads(
    given: Sequence[Tensor], needs: Sequence[bool], microbatch_grads: Sequence[Any]
) -> None:
    """Adds the input's gradient into the caller's tensors, as backward() would."""
    for position, (tensor, wanted) in enumerate(zip(given, needs, strict=True)):
        if not wanted:
            continue
        pieces = [grads[position] if grads is not None else None for grads in microbatch_grads]
        present = [p for p in pieces if p is not None]
        if len(present) < len(pieces):
            continue  # the input did not reach the loss: no gradient, as backward() leaves it
        grad = torch.cat([p.to(device=tensor.device, dtype=tensor.dtype) for p in present])
        torch.autograd.backward(tensor, grad)
