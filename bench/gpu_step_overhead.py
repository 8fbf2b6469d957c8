"""Step overhead on one GPU: gf.GPipe (K cells, M micro-batches) against the plain module whose
layers it wraps, interleaved round by round; target: K=1, M=1 within 2% of the plain step."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gpu_harness as harness
import torch
from gpu_workload import build_stack, make_pipe
from reporting import fmt, markdown_table, median, paired_ratio, ratio, verdict

import gpipe_fast as gf

NAME = "step_overhead"
TARGET = 1.02  # GPipe with one cell may cost at most 2% over the plain module


@dataclass(frozen=True)
class Config:
    width: int
    blocks: int
    batch: int
    cells: tuple[int, ...]
    chunks: tuple[int, ...]
    checkpoints: tuple[str, ...]
    rounds: int
    warmup: int
    min_rounds: int
    time_box_s: float


SCALES = {
    "full": Config(
        width=2048,
        blocks=8,
        batch=4096,
        cells=(1, 2, 4),
        chunks=(1, 4, 8),
        checkpoints=("never", "always"),
        rounds=15,
        warmup=2,
        min_rounds=3,
        time_box_s=75,
    ),
    "quick": Config(
        width=1024,
        blocks=4,
        batch=2048,
        cells=(1, 2),
        chunks=(1, 4),
        checkpoints=("never", "always"),
        rounds=6,
        warmup=1,
        min_rounds=3,
        time_box_s=30,
    ),
    # CPU only, for tests: the code path at toy sizes.
    "smoke": Config(
        width=16,
        blocks=4,
        batch=16,
        cells=(1, 2),
        chunks=(1, 2),
        checkpoints=("never", "always"),
        rounds=1,
        warmup=1,
        min_rounds=1,
        time_box_s=10,
    ),
}


def label(cells: int, chunks: int, checkpoint: str) -> str:
    return f"gpipe K={cells} M={chunks} {checkpoint}"


def measure(device: torch.device, cfg: Config) -> harness.Section:
    module = build_stack(cfg.blocks, cfg.width, device)
    x = torch.randn(cfg.batch, cfg.width, device=device)
    pipes: dict[str, tuple[int, int, str, gf.GPipe]] = {}
    try:
        steps: dict[str, Callable[[], float]] = {
            "plain": harness.timed(lambda: module(x).sum().backward(), device)
        }
        for chunks in cfg.chunks:
            if chunks > 1:  # what splitting the batch costs without any pipeline

                def in_turn(chunks: int = chunks) -> None:
                    for micro in x.chunk(chunks):
                        module(micro).sum().backward()

                steps[f"plain, {chunks} micro-batches in turn"] = harness.timed(in_turn, device)
        for cells in cfg.cells:
            for chunks in cfg.chunks:
                for checkpoint in cfg.checkpoints:
                    name = label(cells, chunks, checkpoint)
                    # Every pipe wraps the same layers: one copy of the weights for all.
                    pipe = make_pipe(module, cells, chunks, checkpoint, device)
                    pipes[name] = (cells, chunks, checkpoint, pipe)
                    steps[name] = harness.timed(lambda pipe=pipe: pipe(x).sum().backward(), device)

        # The pipes must compute what the plain module does before their times mean anything.
        with torch.no_grad():
            want = module(x)
            scale = want.abs().max().item() or 1.0
            differences = {
                name: (pipe(x) - want).abs().max().item() / scale
                for name, (_, _, _, pipe) in pipes.items()
            }
        del want

        samples = harness.interleaved_rounds(
            steps,
            rounds=cfg.rounds,
            warmup=cfg.warmup,
            min_rounds=cfg.min_rounds,
            deadline=time.monotonic() + cfg.time_box_s,
            on_round=lambda done, total: print(f"  round {done}/{total}", flush=True),
        )
    finally:
        for _, _, _, pipe in pipes.values():
            pipe.close()

    plain = median(samples["plain"])
    contenders: dict[str, dict[str, Any]] = {}
    rows = []
    for name, values in samples.items():
        cells, chunks, checkpoint = pipes[name][:3] if name in pipes else (None, None, None)
        entry = {
            "cells": cells,
            "chunks": chunks,
            "checkpoint": checkpoint,
            "samples_s": values,
            "median_s": median(values),
            "vs_plain": ratio(median(values), plain),
            "paired_vs_plain": paired_ratio(values, samples["plain"]),
            "max_relative_difference": differences.get(name),
        }
        contenders[name] = entry
        rows.append(
            (
                name,
                fmt(entry["median_s"] * 1e3, 1),
                fmt(entry["vs_plain"], 3),
                fmt(entry["paired_vs_plain"], 3),
                fmt(entry["max_relative_difference"], 6) if name in pipes else "",
            )
        )
    key = label(1, 1, "never")
    k1 = contenders.get(key, {}).get("paired_vs_plain", math.nan)
    summary = {
        "contender": key,
        "paired_vs_plain": k1,
        "target_at_most": TARGET,
        "verdict": verdict(k1, TARGET, at_most=True),
    }
    table = markdown_table(
        ("contender", "median ms", "vs plain", "paired vs plain", "max rel. diff vs plain"), rows
    )
    table += (
        f"\n\nK=1, M=1, checkpoint never: {fmt(k1, 3)} of the plain module's step "
        f"(target <= {TARGET}): {summary['verdict']}; "
        f"{len(samples['plain'])} rounds; workload {cfg.blocks} x MLPBlock({cfg.width}), "
        f"batch {cfg.batch}, forward + sum().backward(), synchronised per step"
    )
    return harness.Section(
        {"rounds": len(samples["plain"]), "contenders": contenders, "k1": summary}, table
    )


measurement, main = harness.scaled_script(__file__, __doc__, NAME, SCALES, measure)


if __name__ == "__main__":
    sys.exit(main())
