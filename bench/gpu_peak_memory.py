"""Peak memory of one training step per checkpoint mode on one GPU, against an estimate after
the GPipe paper's O(N + (L/K) x (N/M)) built from quantities measured on the plain model."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import gpu_harness as harness
import torch
from gpu_workload import CHECKPOINT_MODES, build_stack, measure_pipe_peak, parameter_bytes
from reporting import fmt, fmt_mib, markdown_table, ratio
from torch import nn

NAME = "peak_memory"


@dataclass(frozen=True)
class Config:
    width: int
    blocks: int
    batch: int
    cells: tuple[int, ...]
    chunks: int
    repeats: int
    time_box_s: float


SCALES = {
    "full": Config(
        width=1024, blocks=32, batch=8192, cells=(1, 2, 4), chunks=8, repeats=2, time_box_s=45
    ),
    "quick": Config(
        width=512, blocks=16, batch=4096, cells=(1, 4), chunks=8, repeats=1, time_box_s=30
    ),
    # CPU only, for tests: the code path at toy sizes (no memory statistics on the CPU).
    "smoke": Config(width=16, blocks=4, batch=16, cells=(1, 2), chunks=2, repeats=1, time_box_s=10),
}


@dataclass(frozen=True)
class MemoryModel:
    """What the peak-memory estimates are made of, all measured on the plain model."""

    weights_and_grads_bytes: int  # parameters + their gradients
    boundary_bytes_per_sample: float  # one sample of a cell's input
    activation_bytes_per_sample_per_layer: float  # kept for backward by one layer
    layers: int
    batch: int


def estimate_bytes(
    model: MemoryModel, mode: str, cells: int, chunks: int, *, rebuilding_cells: int = 1
) -> float:
    """Peak bytes of one training step, after the GPipe paper's O(N + (L/K) x (N/M)).

    - "plain": weights and gradients + all layers' activations for the whole batch.
    - "never": the same plus the stashed cell inputs (N samples x boundary x K cells).
    - "always": weights and gradients + stashed cell inputs + the activations that
      `rebuilding_cells` cells rebuild at once, each for one micro-batch through its L/K layers
      (the paper counts one: one cell per accelerator; K cells sharing one GPU may rebuild
      concurrently, up to K).
    - "except_last": weights and gradients + stashed inputs + the last micro-batch's
      activations through all L layers, kept at the end of the forward (its backward runs
      first and frees them), or the rebuilt activations if more.
    """
    if cells < 1 or chunks < 1 or not 1 <= rebuilding_cells <= cells:
        raise ValueError(f"cells={cells}, chunks={chunks}, rebuilding_cells={rebuilding_cells}")
    fixed = model.weights_and_grads_bytes
    per_layer_sample = model.activation_bytes_per_sample_per_layer
    whole_batch = model.layers * model.batch * per_layer_sample
    if mode == "plain":
        return fixed + whole_batch
    stash = cells * model.batch * model.boundary_bytes_per_sample
    if mode == "never":
        return fixed + stash + whole_batch
    micro_batch = model.batch / chunks
    rebuilt = rebuilding_cells * (model.layers / cells) * micro_batch * per_layer_sample
    if mode == "always":
        return fixed + stash + rebuilt
    if mode == "except_last":
        last_micro_batch = model.layers * micro_batch * per_layer_sample
        return fixed + stash + max(last_micro_batch, rebuilt)
    raise ValueError(f"unknown mode {mode!r}")


def activation_bytes_per_sample_per_layer(
    module: nn.Sequential, x: torch.Tensor, device: torch.device
) -> float | None:
    """Bytes a forward of the plain model keeps for its backward, per sample and layer:
    allocated memory with the graph alive minus before the forward (None on CPU: no stats)."""
    if device.type != "cuda":
        return None
    harness.release_memory(device)
    before = torch.cuda.memory_allocated(device)
    out = module(x)
    harness.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    out.sum().backward()
    del out
    return (after - before) / (len(module) * x.shape[0])


def measure(device: torch.device, cfg: Config) -> harness.Section:
    module = build_stack(cfg.blocks, cfg.width, device)
    x = torch.randn(cfg.batch, cfg.width, device=device)

    def plain_step() -> None:
        module(x).sum().backward()

    plain_step()  # gradients exist from here on: part of the fixed weights_and_grads
    activation = activation_bytes_per_sample_per_layer(module, x, device)
    model = MemoryModel(
        weights_and_grads_bytes=2 * parameter_bytes(module),
        boundary_bytes_per_sample=cfg.width * x.element_size(),
        activation_bytes_per_sample_per_layer=activation if activation is not None else math.nan,
        layers=cfg.blocks,
        batch=cfg.batch,
    )
    configs = [("plain", 1)] + [(mode, cells) for cells in cfg.cells for mode in CHECKPOINT_MODES]
    measured: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in configs}
    deadline = time.monotonic() + cfg.time_box_s
    for repeat in range(cfg.repeats):
        for mode, cells in harness.rotated(configs, repeat):
            if measured[(mode, cells)] and time.monotonic() > deadline:
                continue  # time box: keep one measurement of every configuration
            if mode == "plain":
                result = harness.peak_of(plain_step, device)
            else:
                result = measure_pipe_peak(module, x, cells, cfg.chunks, mode, device)
            measured[(mode, cells)].append(result)
            print(
                f"  {mode} K={cells}: peak allocated {fmt_mib(result['peak_allocated'])} MiB",
                flush=True,
            )

    rows, entries = [], []
    for mode, cells in configs:
        runs = measured[(mode, cells)]
        peaks = [r["peak_allocated"] for r in runs if r["peak_allocated"] is not None]
        reserved = [r["peak_reserved"] for r in runs if r["peak_reserved"] is not None]
        peak = max(peaks) if peaks else None
        paper = estimate_bytes(model, mode, cells, cfg.chunks)
        one_gpu = estimate_bytes(model, mode, cells, cfg.chunks, rebuilding_cells=cells)
        stash = None
        stats = runs[0].get("memory_stats_after_forward") if runs else None
        if stats:
            stash = sum(cell["stash_bytes"] for cell in stats)
        entry = {
            "mode": mode,
            "cells": cells,
            "chunks": cfg.chunks if mode != "plain" else 1,
            "runs": runs,
            "peak_allocated": peak,
            "peak_reserved": max(reserved) if reserved else None,
            "estimate_paper": paper,
            "estimate_one_gpu": one_gpu,
            "measured_vs_paper": ratio(peak, paper),
            "measured_vs_one_gpu": ratio(peak, one_gpu),
            "stash_bytes_after_forward": stash,
        }
        entries.append(entry)
        rows.append(
            (
                mode,
                cells if mode != "plain" else "-",
                fmt_mib(entry["peak_allocated"]),
                fmt_mib(entry["peak_reserved"]),
                fmt_mib(paper),
                fmt(entry["measured_vs_paper"], 2),
                fmt_mib(one_gpu),
                fmt(entry["measured_vs_one_gpu"], 2),
                fmt_mib(stash),
            )
        )
    table = markdown_table(
        (
            "mode",
            "K",
            "peak allocated MiB",
            "peak reserved MiB",
            "estimate (paper) MiB",
            "measured / paper",
            "estimate (K cells rebuilding) MiB",
            "measured / that",
            "stash after forward MiB",
        ),
        rows,
    )
    table += (
        f"\n\n{cfg.blocks} x MLPBlock({cfg.width}), batch N={cfg.batch}, M={cfg.chunks}, all cells "
        f"on {device}; weights+grads {fmt_mib(model.weights_and_grads_bytes)} MiB, activations "
        f"{fmt(None if activation is None else activation / 1024, 2)} KiB per sample per layer "
        "(measured on the plain model), boundary "
        f"{model.boundary_bytes_per_sample:.0f} B per sample"
    )
    return harness.Section({"memory_model": model, "results": entries}, table)


measurement, main = harness.scaled_script(__file__, __doc__, NAME, SCALES, measure)


if __name__ == "__main__":
    sys.exit(main())
