"""The two autograd nodes through which loss.backward() drives a pipe(x) step's backward.

`Exit` sits on the pipe's output and only stores the incoming gradient, returning at once
(it may run on a CUDA device thread of the autograd engine, which must never block).
`Enter` receives a zero-size CPU gradient from `Exit`, so the engine runs it on the thread
that called backward(), where it is safe to wait for the stages' workers. Waiting on an
engine device thread instead could deadlock: a worker may need work that the engine queued on
that very thread.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gpipe_fast.nn.pytree import tensors_of
from gpipe_fast.runtime.runner import Runner
from gpipe_fast.runtime.step import Step


class Enter(torch.autograd.Function):
    """Entry of the step's graph: its backward drives the pipelined backward on the caller's
    thread (its only incoming gradient is a zero-size CPU tensor)."""

    @staticmethod
    def forward(ctx: Any, runner: Runner, step: Step, phony: Tensor, *inputs: Tensor) -> Tensor:
        ctx.runner = runner
        ctx.step = step
        ctx.input_meta = [(t.device, t.dtype) for t in inputs]
        return torch.empty(0)  # the phony: carries no data, only the edge to Exit

    @staticmethod
    def backward(ctx: Any, _grad: Tensor) -> Any:
        step: Step = ctx.step
        microbatch_grads = ctx.runner.backward(step, step.exit_grads)
        ctx.step = ctx.runner = step.exit_grads = None
        grads: list[Tensor | None] = []
        tracked = [i for i, needs in enumerate(step.input_needs_grad) if needs]
        for position, (device, dtype) in zip(tracked, ctx.input_meta, strict=True):
            pieces = [g[position] for g in microbatch_grads]
            present = [p for p in pieces if p is not None]
            if len(present) < len(pieces):
                grads.append(None)
            else:
                grads.append(torch.cat([p.to(device=device, dtype=dtype) for p in present]))
        return (None, None, None, *grads)


class Exit(torch.autograd.Function):
    """The pipe's output: gathers the last stage's micro-batches; its backward only hands the
    gradient to the step and returns, so it never blocks an autograd device thread."""

    @staticmethod
    def forward(ctx: Any, step: Step, phony: Tensor) -> Any:
        outputs, step.gathered = step.gathered, ()
        ctx.step = step
        # Each micro-batch's size: that of its first tensor (gather checked they agree).
        ctx.sizes = [tensors_of(o)[0].size(0) for o in step.last_stage().outputs]
        ctx.integral = [not o.is_floating_point() for o in outputs]
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        step: Step = ctx.step
        step.check_backward_once()
        split = [
            g.split(ctx.sizes) if not skip else [None] * len(ctx.sizes)
            for g, skip in zip(grads, ctx.integral, strict=True)
        ]
        step.exit_grads = [tuple(column[m] for column in split) for m in range(len(ctx.sizes))]
        return None, torch.empty(0)  # a CPU gradient: Enter runs on the caller's thread
