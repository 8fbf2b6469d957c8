"""A small U-Net trained through the pipe: conv encoder and decoder with a skip at every level.

The model is an nn.Sequential of skippable layers (gpipe_fast.skip): each encoder level
stashes its features for the decoder level of the same size, which pops them and concatenates
them with its upsampled input. The pipe cuts it into cells, so the skips cross cells: the
runtime hands each stashed tensor straight from its cell to the popping cell and its gradient
back. The task: denoise random blobs (a per-pixel regression), on CPU in a few seconds.

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
from gpipe_fast.skip import Namespace, pop, skippable, stash, verify_skippables


def _block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1), nn.GroupNorm(1, outputs),
                         nn.ReLU())  # fmt: skip


@skippable(stash=["skip"])
class Encode(nn.Module):
    """Features at this level (stashed for the decoder), then half the resolution."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.block = _block(inputs, outputs)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        features = self.block(x)
        yield stash("skip", features)
        return nn.functional.max_pool2d(features, 2)


@skippable(pop=["skip"])
class Decode(nn.Module):
    """Twice the resolution, joined with the encoder's features of that size."""

    def __init__(self, inputs: int, skip: int, outputs: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(inputs, skip, 2, stride=2)
        self.block = _block(2 * skip, outputs)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        features = yield pop("skip")
        return self.block(torch.cat([self.up(x), features], dim=1))


def unet(widths: tuple[int, ...] = (8, 16, 32)) -> nn.Sequential:
    """Encoders down `widths`, a bottleneck, decoders back up, a 1x1 output convolution;
    each encoder/decoder pair in a namespace of its own (one class used at every level)."""
    spaces = [Namespace() for _ in widths]
    layers: list[nn.Module] = []
    inputs = 1
    for width, ns in zip(widths, spaces, strict=True):
        layers.append(Encode(inputs, width).isolate(ns))
        inputs = width
    layers.append(_block(inputs, 2 * inputs))
    inputs *= 2
    for width, ns in zip(reversed(widths), reversed(spaces), strict=True):
        layers.append(Decode(inputs, width, width).isolate(ns))
        inputs = width
    layers.append(nn.Conv2d(inputs, 1, 1))
    return nn.Sequential(*layers)


def batch(step: int, size: int = 16, pixels: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy images of random Gaussian blobs, and the clean blobs (the same for a step)."""
    generator = torch.Generator().manual_seed(step)
    grid = torch.linspace(-1, 1, pixels)
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")
    centres = torch.rand(size, 2, 1, 1, generator=generator) * 1.6 - 0.8
    radius = torch.rand(size, 1, 1, generator=generator) * 0.3 + 0.1
    clean = torch.exp(-((xx - centres[:, 0]) ** 2 + (yy - centres[:, 1]) ** 2) / radius**2)
    noisy = clean + 0.3 * torch.randn(clean.shape, generator=generator)
    return noisy.unsqueeze(1), clean.unsqueeze(1)


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
