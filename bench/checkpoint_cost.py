"""What clipping and a DCP checkpoint cost against a training step, across two processes.

The demo's model (Linear(64, 512) + Tanh, 8 x (Linear(512, 512) + Tanh), Linear(512, 1);
batch 1024, M = 8, Adam) cut into two cells, one per process (pp=2, 1f1b, gloo over
127.0.0.1, one intra-op thread each). Per round, interleaved, each rank times:

- step: train_step (MSE) and optimizer.step();
- clip: pipe.clip_grad_norm_(1.0) after a step's backward (one all-reduce of one number);
- save: get_state_dict(pipe, opt, flatten_optimizer_state_dict) and dcp.save into a fresh
  folder (model and Adam state: weights, exp_avg, exp_avg_sq);
- load: get_state_dict, dcp.load and set_state_dict from that folder.

It prints medians (the slower rank's per round), each against the step, and the bytes each
rank wrote (its own .distcp files; rank 0 also writes the metadata).

    python bench/checkpoint_cost.py [--rounds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_pair import WorkerPair, in_gloo_pair, requests_of

INPUTS, WIDTH, DEPTH, BATCH, CHUNKS = 64, 512, 9, 1024, 8
MEASURES = ("step", "clip", "save", "load")
REPLY_TIMEOUT_S = 300.0


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(INPUTS, WIDTH), nn.Tanh()]
    for _ in range(DEPTH - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    layers.append(nn.Linear(WIDTH, 1))
    return nn.Sequential(*layers)


def worker(rank: int, port: int, requests: Any, replies: Any, parent: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    import gpipe_fast as gf

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    with in_gloo_pair(rank, port, REPLY_TIMEOUT_S, replies):
        model = build_model()
        half = len(model) // 2
        pipe = gf.GPipe(model, [half, len(model) - half], chunks=CHUNKS, schedule="1f1b",
                        pp_group=dist.group.WORLD)  # fmt: skip
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(1)
        x, y = torch.randn(BATCH, INPUTS, generator=generator), torch.randn(BATCH, 1)
        folder = Path(tempfile.mkdtemp(prefix="gpipe-dcp-")) if rank == 0 else None
        replies.put((rank, "ready", None, None))
        for request in requests_of(requests, parent):
            kind, path = request
            start = time.perf_counter()
            value: Any = None
            if kind == "step":
                opt.zero_grad()
                pipe.train_step(x, y, nn.functional.mse_loss)
                opt.step()
            elif kind == "clip":
                pipe.clip_grad_norm_(1.0)
            elif kind == "save":
                model_state, optim_state = get_state_dict(pipe, opt, options=flat)
                dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
                value = sum(f.stat().st_size for f in Path(path).glob(f"__{rank}_*.distcp"))
                if rank == 0:
                    value += (Path(path) / ".metadata").stat().st_size
            elif kind == "load":
                model_state, optim_state = get_state_dict(pipe, opt, options=flat)
                state = {"model": model_state, "optim": optim_state}
                dcp.load(state, checkpoint_id=path)
                set_state_dict(pipe, opt, model_state_dict=state["model"],
                               optim_state_dict=state["optim"], options=flat)  # fmt: skip
            replies.put((rank, kind, (time.perf_counter() - start, value), None))
        pipe.close()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    pair = WorkerPair(worker, REPLY_TIMEOUT_S)
    folder = Path(tempfile.mkdtemp(prefix="gpipe-dcp-bench-"))
    seconds: dict[str, list[float]] = {m: [] for m in MEASURES}
    written: list[int] = [0, 0]
    try:
        pair.ask(("step", ""), "step")  # warm-up
        for round_ in range(args.rounds):
            path = str(folder / f"round{round_}")
            for kind in MEASURES:  # clip needs a step's gradients; load the saved folder
                answers = pair.ask((kind, path), kind)
                seconds[kind].append(max(s for s, _ in answers))
                if kind == "save":
                    written = [b for _, b in answers]
            shutil.rmtree(path, ignore_errors=True)
    finally:
        pair.stop()
        shutil.rmtree(folder, ignore_errors=True)
    step = statistics.median(seconds["step"])
    print(f"pp=2, 1f1b, batch {BATCH}, M={CHUNKS}, Adam; {args.rounds} rounds (medians)")
    print(f"{'':8}{'ms':>10}{'x step':>10}")
    result: dict[str, Any] = {"rounds": args.rounds, "bytes_per_rank": written}
    for kind in MEASURES:
        median = statistics.median(seconds[kind])
        result[kind] = median
        print(f"{kind:8}{median * 1e3:10.1f}{median / step:10.2f}")
    print("bytes written per rank: " + ", ".join(f"rank {r}: {b / 2**20:.1f} MiB"
                                                  for r, b in enumerate(written)))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
