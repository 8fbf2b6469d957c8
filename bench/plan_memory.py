"""Predicted against measured peak memory of a train_step on CPU, one process per case.

For each workload (MLPs of Linear+ReLU on 2 CPU cells, AdamW), schedule and checkpoint mode,
gf.plan predicts the peak bytes of the cells together on one device (both CPU cells live in
one process: ``plan.memory_one_device``), and a fresh process measures it: VmHWM from
/proc/self/status, reset by writing 5 to /proc/self/clear_refs, with glibc told to hand big
blocks straight back (MALLOC_MMAP_THRESHOLD_=65536, MALLOC_ARENA_MAX=2, set before the
process starts), so that the resident set follows live tensors. Two figures per case:

- total: from before the model exists to the peak of the second step (model, AdamW, input,
  train_step and optimizer step), against the whole prediction (the first step's peak,
  "first", is kept apart: it also holds one-off allocations of the runtime and allocator);
- step: from the second step's start (parameters, AdamW's state and the input at rest,
  gradients None) to its peak, against the prediction less those.

    python bench/plan_memory.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reporting import markdown_table

ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
SCHEDULES = ("gpipe", "1f1b", "zero_bubble")
CHECKPOINTS = ("never", "except_last", "always")


@dataclass(frozen=True)
class Case:
    layers: int
    width: int
    batch: int
    chunks: int
    schedule: str
    checkpoint: str
    balance: tuple[int, ...] = ()

    @property
    def workload(self) -> str:
        return f"{self.layers} x Linear({self.width}), batch {self.batch}, M={self.chunks}"


WORKLOADS = ((8, 1024, 256, 8), (8, 256, 4096, 8), (4, 512, 2048, 16))


def model(case: Case) -> nn.Sequential:
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for _ in range(case.layers):
        modules += [nn.Linear(case.width, case.width), nn.ReLU()]
    return nn.Sequential(*modules)


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def child(case: Case) -> dict[str, int]:
    """Runs in a fresh process: the measured bytes (see the module's docstring)."""
    import gc

    import gpipe_fast as gf

    def step(pipe: gf.GPipe, x: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        pipe.train_step(x, x, lambda out, target: out.sum())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # The runtime's threads and pools first, on a model of nothing, so that they are at rest.
    warm = gf.GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1],
                    devices=["cpu", "cpu"], chunks=2, schedule=case.schedule,
                    checkpoint=case.checkpoint)  # fmt: skip
    step(warm, torch.randn(4, 4), torch.optim.AdamW(warm.parameters()))
    warm.close()
    del warm
    gc.collect()
    before = _status("VmRSS")
    _reset_peak()
    net = model(case)
    x = torch.randn(case.batch, case.width)
    pipe = gf.GPipe(net, list(case.balance), devices=["cpu", "cpu"], chunks=case.chunks,
                    schedule=case.schedule, checkpoint=case.checkpoint)  # fmt: skip
    optimizer = torch.optim.AdamW(net.parameters())
    step(pipe, x, optimizer)
    gc.collect()
    rest = _status("VmRSS")
    total = _status("VmHWM")
    _reset_peak()
    step(pipe, x, optimizer)
    second = _status("VmHWM")
    pipe.close()
    return {"total": second - before, "step": second - rest, "first": total - before}


def rank(case: Case) -> dict[str, int]:
    """Runs as rank RANK of 2 processes, one cell each (gloo, the tensors between the cells
    over gloo too, so that no shared-memory ring is in the resident set): this cell's step,
    measured as `child` measures the step of both."""
    import gc

    import torch.distributed as dist

    import gpipe_fast as gf

    dist.init_process_group("gloo")
    try:
        net = model(case)
        x = torch.randn(case.batch, case.width)
        pipe = gf.GPipe(net, list(case.balance), chunks=case.chunks, schedule=case.schedule,
                        checkpoint=case.checkpoint, pp_group=dist.group.WORLD)  # fmt: skip
        optimizer = torch.optim.AdamW(pipe.parameters())

        def step() -> None:
            pipe.train_step(x, x, lambda out, target: out.sum())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        step()
        gc.collect()
        rest = _status("VmRSS")
        _reset_peak()
        step()
        peak = _status("VmHWM")
        pipe.close()
        return {"step": peak - rest}
    finally:
        dist.destroy_process_group()


def measure_cells(case: Case) -> list[int]:
    """Each cell's measured step growth, one process per cell."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import plan_memory as b; "
        "print(json.dumps(b.rank(b.Case(**json.loads(sys.argv[2])))))"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, **ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517",
           "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo",
           "GPIPE_FAST_TRANSPORT": "gloo"}  # fmt: skip
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, here, json.dumps(asdict(case))],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in ranks]
    return [json.loads(out.strip().splitlines()[-1])["step"] for out in outs]


def predict(case: Case) -> tuple[Case, dict[str, int]]:
    import gpipe_fast as gf

    net = model(case)
    x = torch.randn(case.batch, case.width)
    plan = gf.plan(net, x, 2, case.chunks, schedule=case.schedule, checkpoint=case.checkpoint,
                   optimizer="adamw", balance=case.balance or None, repeats=3)  # fmt: skip
    rest = sum(c.params + c.optimizer + c.batch for c in plan.memory)
    balanced = Case(**{**asdict(case), "balance": tuple(plan.balance)})
    cells = [c.peak - c.params - c.optimizer - c.batch for c in plan.memory]
    return balanced, {"total": plan.memory_one_device, "step": plan.memory_one_device - rest,
                      "peak_per_device": plan.peak_memory, "cells": cells}  # type: ignore[dict-item]  # fmt: skip


def measure(case: Case) -> dict[str, int]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import plan_memory as b; "
        "print(json.dumps(b.child(b.Case(**json.loads(sys.argv[2])))))"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, "-c", code, here, json.dumps(asdict(case))],
        env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="the first workload only")
    parser.add_argument("--cells", action="store_true",
                        help="each cell in its own process (2 gloo ranks), per cell")  # fmt: skip
    args = parser.parse_args()
    if args.cells:
        return per_cell(args.json)
    rows: list[dict[str, Any]] = []
    for layers, width, batch, chunks in WORKLOADS[:1] if args.quick else WORKLOADS:
        balance: tuple[int, ...] = ()
        for schedule in SCHEDULES:
            for checkpoint in CHECKPOINTS:
                case = Case(layers, width, batch, chunks, schedule, checkpoint, balance)
                case, predicted = predict(case)
                balance = case.balance  # one balance per workload
                measured = measure(case)
                rows.append({"case": asdict(case), "workload": case.workload,
                             "predicted": predicted, "measured": measured})  # fmt: skip
                print(rows[-1], file=sys.stderr, flush=True)
    header = ["workload", "schedule", "checkpoint", "predicted MiB", "measured MiB",
              "ratio", "step predicted MiB", "step measured MiB", "step ratio"]  # fmt: skip
    mib = 1 << 20
    table = [
        [
            r["workload"], r["case"]["schedule"], r["case"]["checkpoint"],
            f"{r['predicted']['total'] / mib:.1f}", f"{r['measured']['total'] / mib:.1f}",
            f"{r['predicted']['total'] / r['measured']['total']:.3f}",
            f"{r['predicted']['step'] / mib:.1f}", f"{r['measured']['step'] / mib:.1f}",
            f"{r['predicted']['step'] / r['measured']['step']:.3f}",
        ]
        for r in rows
    ]  # fmt: skip
    print(markdown_table(header, table))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


def per_cell(path: str | None) -> int:
    """Each cell's predicted step growth against its own process's (see `rank`)."""
    rows: list[dict[str, Any]] = []
    layers, width, batch, chunks = WORKLOADS[1]
    balance: tuple[int, ...] = ()
    for schedule in ("gpipe", "1f1b"):
        for checkpoint in ("never", "always"):
            case, predicted = predict(Case(layers, width, batch, chunks, schedule, checkpoint,
                                           balance))  # fmt: skip
            balance = case.balance
            measured = measure_cells(case)
            rows.append({"case": asdict(case), "predicted": predicted["cells"],
                         "measured": measured})  # fmt: skip
            print(rows[-1], file=sys.stderr, flush=True)
    mib = 1 << 20
    header = ["schedule", "checkpoint", "cell", "predicted MiB", "measured MiB", "ratio"]
    table = [
        [r["case"]["schedule"], r["case"]["checkpoint"], str(k), f"{p / mib:.1f}",
         f"{m / mib:.1f}", f"{p / m:.3f}"]
        for r in rows
        for k, (p, m) in enumerate(zip(r["predicted"], r["measured"], strict=True))
    ]  # fmt: skip
    print(f"{Case(*WORKLOADS[1], 'gpipe', 'never').workload}, balance {list(balance)}, AdamW")
    print(markdown_table(header, table))
    if path:
        with open(path, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
