"""Recompute pool on vs off on one GPU: gf.GPipe(recompute_pool=True) against PyTorch's caching
allocator, per cell count and checkpoint mode: peaks, reserved - allocated, device use."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import gpu_harness as harness
import gpu_peak_memory
import torch
from gpu_workload import CHECKPOINT_MODES, build_stack, measure_pipe_peak, supports_recompute_pool
from reporting import fmt_mib, markdown_table

NAME = "recompute_pool"


@dataclass(frozen=True)
class Config:
    model: gpu_peak_memory.Config  # the same model and settings as the peak-memory script
    time_box_s: float


SCALES = {
    name: Config(gpu_peak_memory.SCALES[name], time_box_s)
    for name, time_box_s in (("full", 45), ("quick", 30), ("smoke", 10))
}


def measure(device: torch.device, config: Config) -> harness.Section:
    cfg = config.model
    if not supports_recompute_pool():
        reason = "this build's GPipe has no recompute_pool option"
        return harness.Section({"reason": reason}, f"not measured: {reason}", "unavailable")
    module = build_stack(cfg.blocks, cfg.width, device)
    x = torch.randn(cfg.batch, cfg.width, device=device)
    module(x).sum().backward()  # gradients allocated once, outside the measured steps
    configs = [
        (cells, mode, pool)
        for cells in cfg.cells
        for mode in CHECKPOINT_MODES
        for pool in (False, True)
    ]
    measured: dict[tuple[int, str, bool], list[dict[str, Any]]] = {key: [] for key in configs}
    deadline = time.monotonic() + config.time_box_s
    for repeat in range(cfg.repeats):
        for cells, mode, pool in harness.rotated(configs, repeat):
            if measured[(cells, mode, pool)] and time.monotonic() > deadline:
                continue
            options = {"recompute_pool": True} if pool else {}
            try:
                result = measure_pipe_peak(module, x, cells, cfg.chunks, mode, device, **options)
            except (TypeError, ValueError, RuntimeError) as error:
                if device.type == "cuda" or not pool:
                    raise
                # A CPU smoke run: the pool is for CUDA cells, a build may refuse it on CPU.
                reason = f"recompute_pool=True on {device}: {type(error).__name__}: {error}"
                return harness.Section({"reason": reason}, f"not measured: {reason}", "unavailable")
            measured[(cells, mode, pool)].append(result)
            print(
                f"  K={cells} {mode} pool={'on' if pool else 'off'}: peak reserved "
                f"{fmt_mib(result['peak_reserved'])} MiB",
                flush=True,
            )
    rows, entries = [], []
    for cells, mode, pool in configs:
        runs = measured[(cells, mode, pool)]
        allocated = [r["peak_allocated"] for r in runs if r["peak_allocated"] is not None]
        reserved = [r["peak_reserved"] for r in runs if r["peak_reserved"] is not None]
        peak_allocated = max(allocated) if allocated else None
        peak_reserved = max(reserved) if reserved else None
        fragmentation = (
            peak_reserved - peak_allocated
            if peak_reserved is not None and peak_allocated is not None
            else None
        )
        used = [r["device_used_after"] for r in runs if r.get("device_used_after") is not None]
        stats = runs[-1].get("memory_stats_after_backward") if runs else None
        rebuilt = [
            c["recompute_peak_bytes"]
            for c in stats or []
            if c.get("recompute_peak_bytes") is not None
        ]
        entry = {
            "cells": cells,
            "mode": mode,
            "recompute_pool": pool,
            "runs": runs,
            "peak_allocated": peak_allocated,
            "peak_reserved": peak_reserved,
            "reserved_minus_allocated": fragmentation,
            "device_used_after_step": max(used) if used else None,
            "recompute_peak_bytes_max_cell": max(rebuilt) if rebuilt else None,
        }
        entries.append(entry)
        rows.append(
            (
                cells,
                mode,
                "on" if pool else "off",
                fmt_mib(peak_allocated),
                fmt_mib(peak_reserved),
                fmt_mib(fragmentation),
                fmt_mib(entry["device_used_after_step"]),
                fmt_mib(entry["recompute_peak_bytes_max_cell"]),
            )
        )
    table = markdown_table(
        (
            "K",
            "checkpoint",
            "recompute pool",
            "peak allocated MiB",
            "peak reserved MiB",
            "reserved - allocated MiB",
            "device used after step MiB",
            "recompute_peak_bytes (max cell) MiB",
        ),
        rows,
    )
    table += (
        f"\n\nthe model of gpu_peak_memory.py: {cfg.blocks} x MLPBlock({cfg.width}), batch "
        f"{cfg.batch}, M={cfg.chunks}; reserved - allocated uses torch's two peaks, which may "
        "fall at different moments of the step; device used = cudaMemGetInfo's total - free "
        "after the step (the CUDA context, torch's cache and any native pool arenas)"
    )
    return harness.Section({"results": entries}, table)


measurement, main = harness.scaled_script(__file__, __doc__, NAME, SCALES, measure)


if __name__ == "__main__":
    sys.exit(main())
