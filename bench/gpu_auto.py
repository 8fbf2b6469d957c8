"""schedule="auto" on one GPU: the tuning's step exact, nothing moved, and its pick's speed.

On `--device` (two cells sharing it), an MLP in float64 checks that the first train_step of
an "auto" pipe equals the plain model's and that a second ``pipe.tune()`` leaves every
gradient tensor as it was; then in float32 (8 x Linear(4096), batch 1024) the tuned pipe,
the defaults and the tuning's three best measured candidates run interleaved, round by
round, synchronised, and their medians are printed with the tuning's report (its calibrated
plan against the tuned pipe's consecutive steps).

    python bench/gpu_auto.py [--device cuda:0] [--rounds 10] [--smoke-cpu]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from torch import nn

import gpipe_fast as gf


def _mlp(width: int, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(8)]
    return nn.Sequential(*layers).to(dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_exact(device: torch.device) -> None:
    module = _mlp(64, torch.float64)
    plain = copy.deepcopy(module).to(device)
    x = torch.randn(32, 64, dtype=torch.float64, device=device)
    y = torch.randn(32, 64, dtype=torch.float64, device=device)
    pipe = gf.GPipe(module, devices=[device, device], schedule="auto", chunks="auto",
                    checkpoint="auto")  # fmt: skip
    try:
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        want = nn.functional.mse_loss(plain(x), y)
        want.backward()
        worst = max(
            ((p.grad - q.grad).norm() / q.grad.norm()).item()  # type: ignore[operator]
            for p, q in zip(pipe.parameters(), plain.parameters(), strict=True)
        )
        print(f"float64 on {device}: chose {pipe.tuning.choice}; loss {loss.item():.12g} "
              f"against {want.item():.12g}; worst relative gradient error {worst:.2e}")  # fmt: skip
        assert abs(loss.item() - want.item()) <= 1e-12 * abs(want.item()) and worst < 1e-10
        held = [(p.grad, p.grad.clone()) for p in pipe.parameters()]  # type: ignore[union-attr]
        pipe.tune(x, y, nn.functional.mse_loss, progress=False)
        assert all(p.grad is g and torch.equal(g, v)
                   for p, (g, v) in zip(pipe.parameters(), held, strict=True))  # fmt: skip
        print("a second tune() left every gradient tensor as it was: ok")
    finally:
        pipe.close()


def _timed(pipe: Any, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    for param in pipe.parameters():
        param.grad = None
    _sync(device)
    start = time.perf_counter()
    pipe.train_step(x, y, nn.functional.mse_loss)
    _sync(device)
    return time.perf_counter() - start


def compare(device: torch.device, width: int, batch: int, rounds: int) -> None:
    module = _mlp(width, torch.float32)
    x = torch.randn(batch, width, device=device)
    y = torch.randn(batch, width, device=device)
    devices = [device, device]
    tuned = gf.GPipe(module, devices=devices, schedule="auto", chunks="auto",
                     checkpoint="auto")  # fmt: skip
    start = time.perf_counter()
    tuning = tuned.tune(x, y, nn.functional.mse_loss)
    print(f"\nfloat32, 8 x Linear({width}), batch {batch}: tuning took "
          f"{time.perf_counter() - start:.1f} s\n{tuning}")  # fmt: skip
    contenders: dict[str, Any] = {"auto": tuned, "defaults": gf.GPipe(module, devices=devices)}
    best = sorted(tuning.measured, key=lambda c: c.measured_s)[:3]
    for candidate in best:
        config = candidate.config
        contenders[str(config)] = gf.GPipe(
            module, list(config.cut.balance), devices=devices,
            schedule=config.cut.schedule, chunks=config.chunks, checkpoint=config.checkpoint,
        )  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for index in range(rounds + 1):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = _timed(contenders[name], x, y, device)
            if index:
                times[name].append(seconds)
    consecutive = [_timed(tuned, x, y, device) for _ in range(rounds)]
    auto = statistics.median(times["auto"])
    for name in names:
        median = statistics.median(times[name])
        print(f"  {name}: {median * 1e3:.2f} ms ({median / auto:.3f} of auto)")
    if tuning.plan is not None:
        steady, predicted = statistics.median(consecutive), tuning.plan.step_time
        print(f"  the chosen plan predicts {predicted * 1e3:.2f} ms; consecutive steps take "
              f"{steady * 1e3:.2f} ms ({predicted / steady:.3f})")  # fmt: skip
    for pipe in contenders.values():
        pipe.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--smoke-cpu", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke_cpu else args.device)
    check_exact(device)
    width, batch = (128, 64) if args.smoke_cpu else (4096, 1024)
    compare(device, width, batch, 3 if args.smoke_cpu else args.rounds)


if __name__ == "__main__":
    main()
