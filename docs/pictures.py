"""Draws the guide's pictures into docs/images: each schedule's simulated timeline (equal task
costs), a recorded step of the demo, and one of the U-Net across two processes with its skip
transfers. Run from the repository root: python docs/pictures.py (needs matplotlib)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.schedule.registry import SCHEDULES, actions, schedule_kind

IMAGES = Path(__file__).resolve().parent / "images"
STAGES, MICROBATCHES = 4, 8
# Relative task costs: a backward is two forwards (or its input and weight halves, one each).
COSTS = {"forward": 1.0, "recompute": 1.0, "backward": 2.0, "backward_input": 1.0,
         "backward_weight": 1.0, "loss": 0.25}  # fmt: skip


def simulated(kind: str) -> gf.Timeline:
    """The schedule's timeline as the native simulator predicts it with COSTS."""
    per_worker = schedule_kind(kind).stages_per_worker  # 0: any number; interleaved, zbv: 2
    workers = STAGES // 2 if per_worker != 1 else STAGES
    schedule = _C.make_schedule(kind, STAGES, workers, MICROBATCHES, "never")
    names = actions()
    costs = [COSTS.get(names[task.action], 0.0) for task in schedule.tasks]
    run = _C.simulate(schedule, costs)
    unit_ns = 1_000_000  # a forward is drawn as 1 ms
    spans = [
        (task, int(run.start[task] * unit_ns), int(run.end[task] * unit_ns))
        for task in range(len(schedule.tasks))
    ]
    return gf.Timeline.from_runs([("step", schedule, spans)], schedule=kind)


def recorded() -> gf.Timeline:
    """One recorded 1f1b step of a small MLP on two CPU cells."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)))
    pipe = gf.GPipe(model, [4, 4], devices=["cpu"] * 2, chunks=8, schedule="1f1b")
    x, y = torch.randn(256, 256), torch.randn(256, 256)
    try:
        for _ in range(3):  # warm up, then record
            pipe.train_step(x, y, nn.functional.mse_loss)
        pipe.record_timeline()
        pipe.train_step(x, y, nn.functional.mse_loss)
        return pipe.timeline()
    finally:
        pipe.close()


def unet_across_processes(path: Path) -> None:
    """The demo's U-Net on two processes (its recorded step's timeline, every rank's rows)."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "gpipe_fast", "demo", "--model", "unet",
                   "--processes", "2", "--steps", "20", "--out", out]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        shutil.copy(Path(out) / "timeline.png", path)


def main() -> int:
    IMAGES.mkdir(exist_ok=True)
    for kind in SCHEDULES:
        path = IMAGES / f"schedule-{kind}.png"
        simulated(kind).plot(str(path))
        print(f"wrote {path}")
    path = IMAGES / "demo-timeline.png"
    recorded().plot(str(path))
    print(f"wrote {path}")
    path = IMAGES / "unet-processes-timeline.png"
    unet_across_processes(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
