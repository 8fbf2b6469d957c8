"""The demo's workload, in one process or across processes: its model, batches and cells."""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn

from gpipe_fast.demo.unet import batch as unet_batch
from gpipe_fast.demo.unet import unet
from gpipe_fast.schedule.registry import schedule_kind

INPUTS = 32  # features of the synthetic data

Batch = tuple[Tensor, Tensor]


def cells_per_worker(schedule: str) -> int:
    """The cells the demo gives each worker (or process) under `schedule`: the kind's fixed
    number, and 2 where it takes any number (interleaved)."""
    return int(schedule_kind(schedule).stages_per_worker) or 2


def workload(args: argparse.Namespace, device: torch.device) -> tuple[nn.Sequential, list[Batch]]:
    """The model and one batch per step on `device`: the MLP, or the U-Net (--model unet)."""
    if args.model == "unet":
        model = unet()  # first: its weights do not depend on --steps
        return model, [_on(unet_batch(step, args.batch), device) for step in range(args.steps)]
    model = mlp(args.width, args.depth, INPUTS)  # first: as above
    return model, data(args.steps, args.batch, device)


def mlp(width: int, depth: int, inputs: int) -> nn.Sequential:
    """`depth` hidden Linear(width) layers with tanh, one output."""
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def data(steps: int, batch: int, device: torch.device) -> list[Batch]:
    """One mini-batch per step: random inputs and a fixed random teacher's outputs."""
    teacher = mlp(64, 3, INPUTS).requires_grad_(False)
    # Targets of zero mean and unit variance (constants fixed from a probe), so that the loss
    # falls by learning the teacher's function, not only its small offset.
    probe = teacher(torch.randn(4096, INPUTS))
    mean, std = probe.mean(), probe.std()
    batches = []
    for _ in range(steps):
        x = torch.randn(batch, INPUTS)
        batches.append((x.to(device), (teacher(x) - mean) / std))
    return batches


def _on(pair: Batch, device: torch.device) -> Batch:
    return pair[0].to(device), pair[1].to(device)
