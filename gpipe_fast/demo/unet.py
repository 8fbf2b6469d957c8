"""A small U-Net whose skips cross cells, and its denoising data: the demo's --model unet."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from gpipe_fast.skip import Namespace, Skippable, pop, skippable, stash


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


def _skippable(layer: nn.Module) -> Skippable:
    # @skippable made the class a Skippable; type checkers do not apply class decorators.
    return cast(Skippable, layer)


def unet(widths: tuple[int, ...] = (8, 16, 32)) -> nn.Sequential:
    """Encoders down `widths`, a bottleneck, decoders back up, a 1x1 output convolution;
    each encoder/decoder pair in a namespace of its own (one class used at every level)."""
    spaces = [Namespace() for _ in widths]
    layers: list[nn.Module] = []
    inputs = 1
    for width, ns in zip(widths, spaces, strict=True):
        layers.append(_skippable(Encode(inputs, width)).isolate(ns))
        inputs = width
    layers.append(_block(inputs, 2 * inputs))
    inputs *= 2
    for width, ns in zip(reversed(widths), reversed(spaces), strict=True):
        layers.append(_skippable(Decode(inputs, width, width)).isolate(ns))
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
