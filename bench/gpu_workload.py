"""The model the GPU scripts measure (Transformer feed-forward blocks), the pipes around it,
and the peak memory of one pipe step."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from gpu_harness import peak_of
from torch import nn

import gpipe_fast as gf

CHECKPOINT_MODES = ("never", "except_last", "always")


class MLPBlock(nn.Module):
    """A Transformer's feed-forward block with its residual: x + W2 gelu(W1 x)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def build_stack(blocks: int, width: int, device: torch.device) -> nn.Sequential:
    """`blocks` MLP blocks, created directly on `device` (no host copy of large models)."""
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(*[MLPBlock(width) for _ in range(blocks)])


def params_per_block(width: int) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in MLPBlock(width).parameters())


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def even_balance(layers: int, cells: int) -> list[int]:
    """Near-equal layers per cell, the larger cells first."""
    if cells < 1 or layers < cells:
        raise ValueError(f"cannot cut {layers} layers into {cells} cells")
    return [layers // cells + (k < layers % cells) for k in range(cells)]


def make_pipe(
    module: nn.Sequential,
    cells: int,
    chunks: int,
    checkpoint: str,
    device: torch.device,
    **options: Any,
) -> gf.GPipe:
    """`module` in `cells` near-equal cells, all on `device`."""
    return gf.GPipe(
        module,
        even_balance(len(module), cells),
        devices=[device] * cells,
        chunks=chunks,
        checkpoint=checkpoint,
        **options,
    )


def supports_recompute_pool() -> bool:
    return "recompute_pool" in inspect.signature(gf.GPipe.__init__).parameters


def cell_memory_stats(pipe: gf.GPipe) -> list[dict[str, Any]] | None:
    return [dict(stats) for stats in pipe.memory_stats()] if hasattr(pipe, "memory_stats") else None


def _pipe_step(pipe: gf.GPipe, x: torch.Tensor) -> Callable[[], dict[str, Any]]:
    def step() -> dict[str, Any]:
        out = pipe(x)
        during = cell_memory_stats(pipe)  # the stash is alive between forward and backward
        out.sum().backward()
        del out
        return {
            "memory_stats_after_forward": during,
            "memory_stats_after_backward": cell_memory_stats(pipe),
        }

    return step


def measure_pipe_peak(
    module: nn.Sequential,
    x: torch.Tensor,
    cells: int,
    chunks: int,
    checkpoint: str,
    device: torch.device,
    **options: Any,
) -> dict[str, Any]:
    """One warm-up step (worker threads, lazy state), then the peak of one measured step."""
    pipe = make_pipe(module, cells, chunks, checkpoint, device, **options)
    try:
        step = _pipe_step(pipe, x)
        step()
        return peak_of(step, device)
    finally:
        pipe.close()
