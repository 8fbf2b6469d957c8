"""A small U-Net trained through the pipe: conv encoder and decoder with a skip at every level.

The model (gpipe_fast/demo/unet.py, also the demo's --model unet) is an nn.Sequential of
skippable layers (gpipe_fast.skip): each encoder level stashes its features for the decoder
level of the same size, which pops them and concatenates them with its upsampled input. The
pipe cuts it into cells, so the skips cross cells: the runtime hands each stashed tensor
straight from its cell to the popping cell and its gradient back. The task: denoise random
blobs (a per-pixel regression), on CPU in a few seconds.

    python examples/unet.py [--cells 3] [--steps 60] [--schedule 1f1b] [--timeline out.json]

Across processes, one cell per process (two with interleaved or zbv), the skips travelling
between them:

    GLOO_SOCKET_IFNAME=lo python -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/unet.py --timeline out.json

(each rank writes its own timeline, out.rank<r>.json; rank 0 prints).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf
from gpipe_fast.demo.unet import batch, unet
from gpipe_fast.skip import verify_skippables

__all__ = ["batch", "main", "unet"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--timeline", type=Path, help="write one step's timeline (Chrome trace)")
    args = parser.parse_args(argv)

    across = int(os.environ.get("WORLD_SIZE", "1")) > 1  # started by torchrun
    if across:
        dist.init_process_group("gloo")
        args.cells = dist.get_world_size()
    rank = dist.get_rank() if across else 0
    say = print if rank == 0 else (lambda *_: None)

    torch.manual_seed(0)  # the same weights on every rank
    model = unet()
    verify_skippables(model)  # the pipe checks it too; here to show it
    cells = args.cells * (2 if args.schedule in ("interleaved", "zbv") else 1)
    where = {"pp_group": dist.group.WORLD} if across else {"devices": ["cpu"] * args.cells}
    pipe = gf.GPipe(model, gf.balance_by_params(cells, model), chunks=args.chunks,
                    schedule=args.schedule, **where)  # fmt: skip
    optimizer = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    parameters = sum(p.numel() for p in model.parameters())
    say(f"U-Net of {len(model)} layers, {parameters:,} parameters, cells {pipe.balance}, "
        f"schedule {args.schedule}, M={args.chunks}"
        + (f", {args.cells} processes" if across else ""))  # fmt: skip
    losses = []
    start = time.perf_counter()
    try:
        for step in range(args.steps):
            noisy, clean = batch(step)
            optimizer.zero_grad()
            if args.timeline is not None and step == args.steps - 1:
                pipe.record_timeline()
            losses.append(pipe.train_step(noisy, clean, nn.functional.mse_loss).item())
            optimizer.step()
            if step % 10 == 0 or step == args.steps - 1:
                say(f"step {step:4d}  loss {losses[-1]:.4f}")
        seconds = time.perf_counter() - start
        if args.timeline is not None:
            path = args.timeline
            if across:  # each rank's own workers: out.json -> out.rank1.json
                path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
            pipe.timeline().to_chrome_trace(path)
            say(f"timeline: {path}")
    finally:
        pipe.close()
        if across:
            dist.destroy_process_group()
    say(f"trained {args.steps} steps in {seconds:.1f} s")
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
