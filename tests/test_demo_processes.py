"""The demo across processes: it trains, reports every rank, and draws one timeline of all."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cluster import Cluster, values
from torch import nn

from gpipe_fast.demo import report
from gpipe_fast.demo.job import arguments, cells_per_worker
from gpipe_fast.demo.processes import bubble_of_own_tasks, communication_ms, merged_timeline
from gpipe_fast.demo.workload import workload
from gpipe_fast.runtime.timeline import TaskSpan
from gpipe_fast.schedule.registry import builtin_schedules, placement

SCHEDULES = builtin_schedules()


def test_demo_across_two_processes(tmp_path: Path) -> None:
    # zbv: two cells per process, in a V, and the backward split in halves.
    command = [sys.executable, "-m", "gpipe_fast", "demo", "--processes", "2", "--steps", "6"]
    command += ["--width", "32", "--depth", "3", "--batch", "64", "--lr", "1e-2", "--out", "out"]
    command += ["--schedule", "zbv"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output  # the loss fell
    stdout = result.stdout.replace("\n  ", " ")  # its paragraphs' wrapped lines joined
    assert max(len(line) for line in result.stdout.splitlines()) <= 100
    assert "(gloo over 127.0.0.1, 2 cells each), model 'mlp', schedule 'zbv'" in stdout
    assert "torchrun --nproc-per-node 2" in stdout
    assert re.search(r"throughput: [\d,]+ samples/s", stdout), output
    assert "rank 0 computes" in stdout and "rank 1 computes" in stdout
    assert re.search(r"bubble [\d.]+% \(ideal [\d.]+% with equal stages; [\d.]+% with these "
                     r"stages' own task times", stdout), output  # fmt: skip
    assert "tensors between processes: shared memory (" in stdout, output
    events = json.loads((tmp_path / "out" / "timeline.trace.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    # Over shared memory each compute worker takes its messages itself: no receiving rows.
    assert set(names.values()) == {"rank 0 compute", "rank 1 compute"}
    spans = [e for e in events if e["ph"] == "X"]
    kinds = {e["cat"] for e in spans}
    assert {"forward", "backward_input", "backward_weight", "loss", "send_forward",
            "recv_forward"} <= kinds  # fmt: skip
    cells = {(names[e["tid"]], e["args"]["cell"]) for e in spans if e["cat"] == "forward"}
    assert cells == {("rank 0 compute", 0), ("rank 0 compute", 3), ("rank 1 compute", 1),
                     ("rank 1 compute", 2)}  # fmt: skip
    svg = (tmp_path / "out" / "timeline.svg").read_text()
    assert "gpipe_fast step, schedule zbv: 4 cells on 2 workers" in svg


def test_the_unet_across_two_processes_sends_its_skips_between_them(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "gpipe_fast", "demo", "--model", "unet", "--processes", "2"]
    command += ["--steps", "8", "--batch", "16", "--out", "out"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output  # the loss fell
    assert "model 'unet'" in result.stdout
    trace = json.loads((tmp_path / "out" / "timeline.trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    rows = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    # The encoder cell's skips go straight to the decoder's process, and their gradients back:
    # their own sends and receives on the timeline, on the ranks at either end.
    where = {(e["cat"], rows[e["tid"]]) for e in spans}
    assert ("send_skips", "rank 0 compute") in where, where
    assert ("recv_skips", "rank 1 compute") in where
    assert ("send_skip_grads", "rank 1 compute") in where
    assert ("recv_skip_grads", "rank 0 compute") in where


def _span(kind: str, cell: int, start: float, end: float, worker: int) -> TaskSpan:
    return TaskSpan("step", kind, cell, 0, start, end, worker=worker)


def test_merged_timeline_puts_each_ranks_workers_on_rows_of_their_own() -> None:
    rank0 = [_span("forward", 0, 1.0, 2.0, 0), _span("send_forward", 0, 2.0, 2.5, 0)]
    rank1 = [_span("recv_forward", 1, 1.5, 2.6, 1), _span("forward", 1, 2.6, 3.0, 0)]
    timeline = merged_timeline([rank0, rank1], cells=2, microbatches=1, schedule="1f1b")
    # A row per worker that ran a task, and per compute worker.
    assert timeline.row_names == (
        "rank 0 compute", "rank 1 compute", "rank 1 receiving activations",
    )  # fmt: skip
    assert [(s.kind, s.worker) for s in timeline.spans] == [
        ("forward", 0), ("recv_forward", 2), ("send_forward", 0), ("forward", 1),
    ]  # fmt: skip
    assert timeline.spans[0].start_s == 0.0  # the earliest span starts the step
    # The bubble counts the computing rows only; communication is reported apart.
    assert timeline.compute_rows() == [0, 1]
    assert communication_ms(timeline, 0) == pytest.approx((500.0, 0.0))
    assert communication_ms(timeline, 1) == pytest.approx((0.0, 1100.0))


def test_a_receive_on_the_compute_worker_counts_as_idle_in_the_bubble() -> None:
    # Over shared memory rank 1's compute worker waits for its message itself.
    rank0 = [_span("forward", 0, 0.0, 1.0, 0), _span("send_forward", 0, 1.0, 1.0, 0)]
    rank1 = [_span("recv_forward", 1, 0.0, 1.0, 0), _span("forward", 1, 1.0, 2.0, 0)]
    timeline = merged_timeline([rank0, rank1], cells=2, microbatches=1, schedule="gpipe")
    assert timeline.row_names == ("rank 0 compute", "rank 1 compute")
    assert timeline.working(1) == pytest.approx(1.0)
    assert timeline.busy(1) == pytest.approx(2.0)
    # Two rows over 2 s, each working 1 s: half of it idle.
    assert timeline.bubble() == pytest.approx(0.5)


def test_the_bubble_of_the_stages_own_tasks_leaves_communication_out() -> None:
    # gpipe, 2 stages, 1 micro-batch: F0 F1 L1 B1 B0 one after another (forward 1 s, loss
    # 1 s, backward 2 s): 7 s of work on 2 rows over a 7 s makespan, half of it idle,
    # however long the receives took.
    rank0 = [_span("forward", 0, 0.0, 1.0, 0), _span("backward", 0, 20.0, 22.0, 0)]
    rank1 = [
        _span("recv_forward", 1, 0.0, 10.0, 0),
        _span("forward", 1, 10.0, 11.0, 0),
        _span("loss", 1, 11.0, 12.0, 0),
        _span("backward", 1, 12.0, 14.0, 0),
    ]
    timeline = merged_timeline([rank0, rank1], cells=2, microbatches=1, schedule="gpipe")
    assert bubble_of_own_tasks(timeline, "never") == pytest.approx(0.5)
    assert timeline.bubble() > 0.5  # the measured step waited on top of that


# -- every schedule, on the suite's two persistent processes -----------------------------------

_ARGV = ["--steps", "3", "--width", "16", "--depth", "3", "--batch", "32", "--chunks", "4",
         "--lr", "1e-2", "--seed", "3"]  # fmt: skip


def _plain_losses() -> list[float]:
    """The demo's model trained as a plain model on the same batches, with the same Adam."""
    args = arguments(["--processes", "2", *_ARGV])
    torch.manual_seed(args.seed)
    model, data = workload(args, torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_trains_across_processes_as_the_plain_model(
    two: Cluster, schedule: str, tmp_path: Path
) -> None:
    reports = values(two.run("demo_cases.train_rank", argv=[*_ARGV, "--schedule", schedule]))
    cells = 2 * cells_per_worker(schedule)
    assert [len(r["balance"]) for r in reports] == [cells, cells]
    # Each rank ran the forwards of the cells the schedule places on it.
    where = placement(schedule, cells, 2)
    for rank, result in enumerate(reports):
        ran = {s.cell for s in result["spans"] if s.kind == "forward"}
        assert ran == {cell for cell in range(cells) if where[cell] == rank}
    # Every rank has the step's loss, the plain model's (float32: the micro-batches' sums).
    assert reports[0]["losses"] == reports[1]["losses"]
    assert reports[0]["losses"] == pytest.approx(_plain_losses(), rel=1e-5)
    timeline = merged_timeline([r["spans"] for r in reports], cells, 4, schedule)
    assert 0 <= bubble_of_own_tasks(timeline, "except_last") < 1
    report.write_timeline(timeline, tmp_path, "every rank's workers")
    svg = (tmp_path / "timeline.svg").read_text()
    assert f"gpipe_fast step, schedule {schedule}: {cells} cells on 2 workers" in svg
