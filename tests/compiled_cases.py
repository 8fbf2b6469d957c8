"""Compiled blocks for test_compiled.py: a counting torch.compile backend, a model of compiled
blocks with dropout, its compiled reference run micro-batch by micro-batch, and the case the
Cluster's workers run."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gpipe_fast as gf
from gpipe_fast.nn.microbatch import split_sizes
from gpipe_fast.nn.randomness import draw_step_seed, task_seed

WIDTH = 8


class Counting:
    """A torch.compile backend that counts the graphs it compiles and their runs; each graph
    is compiled by `inner`: "eager" (the graph as traced, run op by op), "aot_eager"
    (AOTAutograd: forward and backward each one function) or "inductor"."""

    def __init__(self, inner: str = "eager") -> None:
        self.inner = inner
        self.graphs = 0
        self.runs = 0
        self._lock = threading.Lock()  # the stages' threads run graphs at once

    def __deepcopy__(self, memo: dict[int, Any]) -> Counting:
        return self  # a copy of a compiled module counts with the original's backend

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable:
        self.graphs += 1
        if self.inner == "eager":
            compiled = graph.forward
        else:
            from torch._dynamo.backends.registry import lookup_backend

            compiled = lookup_backend(self.inner)(graph, example_inputs)

        def run(*args: Any) -> Any:
            with self._lock:
                self.runs += 1
            return compiled(*args)

        return run


class Block(nn.Module):
    """A residual MLP block with dropout inside: what gets compiled."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        hidden = F.dropout(F.gelu(self.up(self.norm(x))), self.dropout, self.training)
        return x + self.down(hidden)


def model(backend: Counting, *, blocks: int = 4, dropout: float = 0.25, seed: int = 0,
          compile_as: str = "torch.compile") -> nn.Sequential:  # fmt: skip
    """Linear, `blocks` compiled Blocks (torch.compile(block), or block.compile()), Linear; in
    float64, the same weights for the same seed."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(4, WIDTH)]
    for _ in range(blocks):
        block = Block(WIDTH, dropout)
        if compile_as == "torch.compile":
            layers.append(torch.compile(block, backend=backend))
        else:
            block.compile(backend=backend)
            layers.append(block)
    layers.append(nn.Linear(WIDTH, 3))
    return nn.Sequential(*layers).double()


def batch(size: int, seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(size, 3, generator=generator, dtype=torch.float64)
    return x, y


def reference(net: nn.Sequential, balance: list[int], x: Tensor, y: Tensor, chunks: int,
              seed: int) -> Tensor:  # fmt: skip
    """What a pipe of `net` cut by `balance` must give for a train_step called right after
    torch.manual_seed(seed): the same layers run micro-batch by micro-batch, each cell's part
    on the default generator seeded as the pipe seeds that task (from the step's seed, drawn
    first), the mean-squared losses weighted by their rows. Returns the loss; the gradients
    are in net's parameters."""
    torch.manual_seed(seed)
    step_seed = draw_step_seed()
    ends = list(itertools.accumulate(balance))
    sizes = split_sizes(len(x), chunks)
    total = torch.zeros((), dtype=x.dtype, device=x.device)
    for m, (xm, ym) in enumerate(zip(x.split(sizes), y.split(sizes), strict=True)):
        hidden = xm
        for k, (start, end) in enumerate(zip([0, *ends], ends, strict=False)):
            torch.manual_seed(task_seed(step_seed, k, m))
            for layer in net[start:end]:
                hidden = layer(hidden)
        loss = F.mse_loss(hidden, ym) * (len(xm) / len(x))
        loss.backward()
        total += loss.detach()
    return total


def relative(got: Tensor, want: Tensor | None) -> float:
    assert want is not None
    return ((got - want).abs().max() / want.abs().max()).item()


def train(rank: int, world: int, *, schedule: str, checkpoint: str, balance: list[int],
          chunks: int) -> dict[str, Any]:  # fmt: skip
    """A train_step of compiled blocks with dropout at pp=`world` against the compiled
    reference run in this process; the graphs compiled and runs of the pipe's blocks, and
    the forward and recompute tasks this rank ran."""
    backend = Counting()
    x, y = batch(8, seed=3)
    net = model(backend)
    pipe = gf.GPipe(net, balance, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                    pp_group=torch.distributed.group.WORLD, timeout=60)  # fmt: skip
    try:
        pipe.record_timeline()
        torch.manual_seed(11)
        loss = pipe.train_step(x, y, F.mse_loss)
        tasks = sum(s.kind in ("forward", "recompute") for s in pipe.timeline().spans)
    finally:
        pipe.close()
    graphs, runs = backend.graphs, backend.runs
    plain = model(Counting())
    want = reference(plain, balance, x, y, chunks, seed=11)
    wanted = dict(plain.named_parameters())
    local = [(name, p.grad) for name, p in net.named_parameters() if p.grad is not None]
    worst = max(relative(grad, wanted[name].grad) for name, grad in local)
    return {
        "loss": loss.item(), "want": want.item(), "worst": worst, "graphs": graphs,
        "runs": runs, "tasks": tasks, "parameters": len(local),
    }  # fmt: skip
