"""A small U-Net trained through the pipe: conv encoder and decoder with a skip at every level.

The model (gpipe_fast/demo/unet.py, also the demo's --model unet) is an nn.Sequential of
skippable layers (gpipe_fast.skip): each encoder level stashes its features for the decoder
level of the same size, which pops them and concatenates them with its upsampled input. The
pipe cuts it into cells, so the skips cross cells: the runtime hands each stashed tensor
straight from its cell to the popping cell and its gradient back. The task: denoise random
blobs (a per-pixel regression), on CPU in a few seconds.

    python examples/unet.py [--cells 3] [--steps 60] [--schedule 1f1b] [--timeline out.json]

(One process; skips between processes are not carried yet.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
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

    torch.manual_seed(0)
    model = unet()
    verify_skippables(model)  # the pipe checks it too; here to show it
    cells = args.cells * (2 if args.schedule in ("interleaved", "zbv") else 1)
    pipe = gf.GPipe(model, gf.balance_by_params(cells, model), chunks=args.chunks,
                    devices=["cpu"] * args.cells, schedule=args.schedule)  # fmt: skip
    optimizer = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"U-Net of {len(model)} layers, {parameters:,} parameters, cells {pipe.balance}, "
          f"schedule {args.schedule}, M={args.chunks}")  # fmt: skip
    losses = []
    try:
        for step in range(args.steps):
            noisy, clean = batch(step)
            optimizer.zero_grad()
            if args.timeline is not None and step == args.steps - 1:
                pipe.record_timeline()
            losses.append(pipe.train_step(noisy, clean, nn.functional.mse_loss).item())
            optimizer.step()
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {losses[-1]:.4f}")
        if args.timeline is not None:
            pipe.timeline().to_chrome_trace(args.timeline)
            print(f"timeline: {args.timeline}")
    finally:
        pipe.close()
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
