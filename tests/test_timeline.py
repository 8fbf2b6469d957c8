"""Timeline recording: every task once, in order, after its dependencies; bubble; outputs."""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.api.gpipe import pipeline_of
from gpipe_fast.runtime.timeline import Timeline

from helpers import Sleepy, device_sleep_cycles

K, M = 3, 4

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _recorded_step(
    make_pipe: Any,
    model: nn.Sequential,
    balance: list[int],
    chunks: int,
    checkpoint: str,
    devices: list[str] | None = None,
) -> tuple[Timeline, list[bool]]:
    """One warm-up step, then one recorded step (forward and backward)."""
    devices = devices or ["cpu"] * len(balance)
    pipe = make_pipe(model, balance, devices=devices, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(chunks * 2, 6, dtype=torch.float64, device=devices[0], requires_grad=True)
    pipe(x).sum().backward()
    pipe.record_timeline()
    pipe(x).sum().backward()
    checkpointed = [
        checkpoint == "always" or (checkpoint == "except_last" and m < chunks - 1)
        for m in range(chunks)
    ]
    return pipe.timeline(), checkpointed


def _schedules(cells: int, chunks: int, checkpointed: list[bool]) -> dict[str, Any]:
    return {
        "forward": _C.gpipe_forward(cells, chunks),
        "backward": _C.gpipe_backward(cells, chunks, checkpointed),
    }


def _mlp(layers: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(6, 6) for _ in range(layers)]).double()


def _assert_spans_follow_schedules(
    timeline: Timeline, checkpointed: list[bool], slack_s: float = 0.0
) -> None:
    """Every task once, with its kind, cell and micro-batch; each starts after its
    dependencies and its cell's previous task ended (`slack_s`: allowed error between two
    cells' clocks)."""
    cells, chunks = timeline.cells, timeline.microbatches
    for phase, schedule in _schedules(cells, chunks, checkpointed).items():
        spans = [s for s in timeline.spans if s.phase == phase]
        # Every task of the schedule exactly once, with its kind, cell and micro-batch.
        assert sorted(s.task for s in spans) == list(range(len(schedule.tasks)))
        by_task = {s.task: s for s in spans}
        for task_id, task in enumerate(schedule.tasks):
            span = by_task[task_id]
            assert (span.kind, span.cell, span.microbatch) == (
                _C.actions()[task.action],
                task.stage,
                task.microbatch,
            )
            assert span.start_s <= span.end_s
            for dep in task.deps:  # starts only after its dependencies ended
                slack = 0.0 if by_task[dep].cell == task.stage else slack_s
                assert by_task[dep].end_s <= span.start_s + slack
        for cell in range(cells):  # per cell: the schedule's order, no overlap
            mine = sorted((s for s in spans if s.cell == cell), key=lambda s: (s.start_s, s.end_s))
            assert [s.task for s in mine] == schedule.order(cell)
            for before, after in itertools.pairwise(mine):
                assert before.end_s <= after.start_s


@pytest.mark.parametrize("checkpoint", ["except_last", "always", "never"])
def test_spans_cover_every_task_once_in_order_after_dependencies(
    make_pipe: Any, checkpoint: str
) -> None:
    timeline, checkpointed = _recorded_step(make_pipe, _mlp(K), [1] * K, M, checkpoint)
    assert (timeline.cells, timeline.microbatches) == (K, M)
    assert timeline.clocks == ("host",) * K  # CPU cells: timed on their workers
    _assert_spans_follow_schedules(timeline, checkpointed)
    forward_end = timeline.phase_window("forward")[1]
    assert all(s.start_s >= forward_end for s in timeline.spans if s.phase == "backward")
    assert min(s.start_s for s in timeline.spans) == 0.0
    assert timeline.gap_s >= 0
    for cell in range(K):
        assert 0 < timeline.busy(cell) <= timeline.makespan
    assert 0 <= timeline.bubble() < 1


def test_bubble_arithmetic_on_exact_ticks() -> None:
    """Spans laid on exact fill-drain ticks give exactly (K-1)/(M+K-1), the gap left out."""
    cells, chunks, tick, gap = 4, 6, 1_000_000, 50_000_000
    forward = _C.gpipe_forward(cells, chunks)
    backward = _C.gpipe_backward(cells, chunks, [False] * chunks)
    forward_spans = [
        (i, (t.microbatch + t.stage) * tick, (t.microbatch + t.stage + 1) * tick)
        for i, t in enumerate(forward.tasks)
    ]
    start = (chunks + cells - 1) * tick + gap
    backward_spans = []
    for i, t in enumerate(backward.tasks):
        slot = (chunks - 1 - t.microbatch) + (cells - 1 - t.stage)
        backward_spans.append((i, start + slot * tick, start + (slot + 1) * tick))
    timeline = Timeline.from_runs(
        [("forward", forward, forward_spans), ("backward", backward, backward_spans)]
    )
    ticks_s = (chunks + cells - 1) * tick * 1e-9
    assert timeline.makespan == pytest.approx(2 * ticks_s)
    assert timeline.gap_s == pytest.approx(gap * 1e-9)
    assert timeline.busy(0) == pytest.approx(2 * chunks * tick * 1e-9)
    assert timeline.bubble() == pytest.approx(timeline.ideal_bubble)
    assert timeline.ideal_bubble == pytest.approx((cells - 1) / (chunks + cells - 1))


class _MeetFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, meet):  # type: ignore[no-untyped-def]
        meet.arrive("forward")
        ctx.meet = meet
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        ctx.meet.arrive("backward")
        return grad, None


class _Meet(nn.Module):
    """The only layer of cell `cell` (of two). In each phase, cell 1's task on micro-batch j
    and cell 0's on j + 1 wait for each other at a barrier: both run at once, or the barrier
    breaks and the step fails. Pipelining is then a fact the spans must show, not a timing."""

    def __init__(self, cell: int, chunks: int, barriers: dict[str, list[threading.Barrier]]):
        super().__init__()
        self.cell, self.chunks, self.barriers = cell, chunks, barriers
        self.calls = {"forward": 0, "backward": 0}

    def arrive(self, phase: str) -> None:
        n = self.calls[phase]
        self.calls[phase] += 1
        # Forward runs micro-batches 0..M-1, backward M-1..0, on every step.
        microbatch = n % self.chunks if phase == "forward" else self.chunks - 1 - n % self.chunks
        pair = microbatch - 1 if self.cell == 0 else microbatch
        if 0 <= pair < self.chunks - 1:
            self.barriers[phase][pair].wait(timeout=60)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MeetFunction.apply(x, self)


def test_bubble_of_equal_cost_cells(make_pipe: Any) -> None:
    """Layers that sleep 5 ms so compute dominates overheads. With one micro-batch the cells
    take turns, so the bubble is at least (K-1)/K by construction. With 16, cell 0's task on
    micro-batch j + 1 meets cell 1's on j at a barrier, in both phases: the timeline must show
    each such pair overlapping, and a smaller bubble."""
    cells, chunks = 2, 16
    barriers = {
        phase: [threading.Barrier(2) for _ in range(chunks - 1)]
        for phase in ("forward", "backward")
    }
    one, _ = _recorded_step(
        make_pipe, nn.Sequential(Sleepy(5, 5), Sleepy(5, 5)), [1] * cells, 1, "never"
    )
    meeting = nn.Sequential(
        *[nn.Sequential(_Meet(cell, chunks, barriers), Sleepy(5, 5)) for cell in range(cells)]
    )
    many, _ = _recorded_step(make_pipe, meeting, [1] * cells, chunks, "never")
    assert one.bubble() >= (cells - 1) / cells - 1e-9
    for phase in ("forward", "backward"):
        spans = {(s.cell, s.microbatch): s for s in many.spans if s.phase == phase}
        for j in range(chunks - 1):
            first, second = spans[(0, j + 1)], spans[(1, j)]
            # Both were inside the barrier at once: each started before the other ended.
            assert first.start_s < second.end_s and second.start_s < first.end_s, (phase, j)
    assert 0 <= many.bubble() < one.bubble()


def test_last_step_and_its_backward(make_pipe: Any) -> None:
    pipe = make_pipe(_mlp(2), [1, 1], devices=["cpu", "cpu"], chunks=2)
    pipe.record_timeline()
    x1 = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    out1, out2 = pipe(x1), pipe(x2)
    forward_only = pipe.timeline()  # the last step, before its backward
    assert {s.phase for s in forward_only.spans} == {"forward"}
    (out1.sum() + out2.sum()).backward()
    timeline = pipe.timeline()
    assert len([s for s in timeline.spans if s.phase == "forward"]) == 2 * 2
    # K=2, M=2, "except_last": 4 backward tasks and 2 recomputes (micro-batch 0 only).
    assert len([s for s in timeline.spans if s.phase == "backward"]) == 2 * 2 + 2
    with torch.no_grad():  # a forward-only step replaces it
        pipe(x1)
    assert {s.phase for s in pipe.timeline().spans} == {"forward"}


def test_recording_off_by_default_and_timeline_raises(make_pipe: Any) -> None:
    pipe = make_pipe(_mlp(2), [1, 1], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    pipe(x).sum().backward()
    assert pipeline_of(pipe).executor.last_spans() == []  # nothing timed when off
    with pytest.raises(RuntimeError, match="record_timeline"):
        pipe.timeline()
    pipe.record_timeline()
    with pytest.raises(RuntimeError, match="no step"):
        pipe.timeline()
    pipe(x).sum().backward()
    assert len(pipe.timeline().spans) > 0
    pipe.record_timeline(False)
    with pytest.raises(RuntimeError, match="off"):
        pipe.timeline()
    pipe(x).sum().backward()
    assert pipeline_of(pipe).executor.last_spans() == []


def test_chrome_trace_has_one_event_per_span(make_pipe: Any, tmp_path: Path) -> None:
    timeline, _ = _recorded_step(make_pipe, _mlp(K), [1] * K, M, "except_last")
    path = tmp_path / "step.trace.json"
    timeline.to_chrome_trace(path)
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(timeline.spans)
    for event, span in zip(
        sorted(complete, key=lambda e: (e["ts"], e["tid"])),
        sorted(timeline.spans, key=lambda s: (s.start_s, s.cell)),
        strict=True,
    ):
        assert event["tid"] == span.cell
        assert event["args"]["microbatch"] == span.microbatch
        assert event["cat"] == span.kind
        assert event["dur"] >= 0
    names = [e for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert sorted(e["args"]["name"] for e in names) == [f"cell {k}" for k in range(K)]


def test_plot_writes_a_png(make_pipe: Any, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    timeline, _ = _recorded_step(make_pipe, _mlp(K), [1] * K, M, "except_last")
    path = tmp_path / "timeline.png"
    timeline.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    timeline = gf.Timeline(cells=1, microbatches=1)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        timeline.plot(tmp_path / "timeline.png")


def test_from_runs_checks_the_cells_clocks(tmp_path: Path) -> None:
    schedule = _C.gpipe_forward(2, 1)
    spans = [(0, 0, 10), (1, 20, 30)]
    timeline = Timeline.from_runs([("forward", schedule, spans)], clocks=["host", "cuda"])
    assert timeline.clocks == ("host", "cuda")
    path = tmp_path / "mixed.trace.json"
    timeline.to_chrome_trace(path)
    clocks = {
        e["tid"]: e["args"]["clock"]
        for e in json.loads(path.read_text())["traceEvents"]
        if e["ph"] == "X"
    }
    assert clocks == {0: "host", 1: "cuda"}
    assert Timeline.from_runs([("forward", schedule, spans)]).clocks == ()
    with pytest.raises(ValueError, match="1 clocks for 2 workers"):
        Timeline.from_runs([("forward", schedule, spans)], clocks=["host"])
    with pytest.raises(ValueError, match="clock"):
        Timeline.from_runs([("forward", schedule, spans)], clocks=["host", "tpu"])


@pytest.mark.skipif(not _C.cuda_compiled(), reason="needs a build with the CUDA backend")
def test_cuda_backend_times_cpu_cells_on_the_host_without_cuda_calls() -> None:
    """The cuda backend's clock with host streams (CPU cells, here without any GPU): host
    spans as with the host backend, and not one timing event."""
    executor = _C.Executor(2, "cuda")  # streams default to host streams
    executor.set_recording(True)
    assert executor.worker_clocks() == ["host", "host"]
    schedule = _C.gpipe_forward(2, 3)
    before = time.monotonic_ns()
    executor.run(schedule, lambda kind, cell, m: time.sleep(0.001))
    after = time.monotonic_ns()
    spans = {task: (start, end) for task, start, end in executor.last_spans()}
    assert sorted(spans) == list(range(len(schedule.tasks)))
    for task_id, task in enumerate(schedule.tasks):
        start, end = spans[task_id]
        assert before <= start and end <= after  # the steady clock: time.monotonic_ns's
        assert end - start >= 1_000_000  # the callback's sleep is inside its span
        for dep in task.deps:
            assert spans[dep][1] <= start
    assert executor.live_timing_events == executor.pooled_timing_events == 0
    assert executor.live_events == 0
    executor.close()


# -- CUDA cells: spans from CUDA events ------------------------------------------------------


@needs_cuda
def test_cuda_span_is_the_streams_time_not_the_callbacks() -> None:
    """Two cells sharing cuda:0. Task (cell 0, micro-batch 1) enqueues a device-side sleep
    and returns at once: its span lasts the sleep, and cell 1's consumer, whose host
    callback runs long before the sleep ends, still starts after it on the GPU."""
    cycles, sleep_ms = device_sleep_cycles(50)
    streams = [torch.cuda.Stream(0), torch.cuda.Stream(0)]
    executor = _C.Executor(2, "cuda")
    executor.set_streams([_C.Stream(0, s.cuda_stream) for s in streams])
    executor.set_recording(True)
    assert executor.worker_clocks() == ["cuda", "cuda"]
    schedule = _C.gpipe_forward(2, 3)
    sleeper = next(i for i, t in enumerate(schedule.tasks) if (t.stage, t.microbatch) == (0, 1))
    host_ns: dict[int, int] = {}

    def task(kind: object, cell: int, microbatch: int) -> None:
        started = time.monotonic_ns()
        with torch.cuda.stream(streams[cell]):
            if (cell, microbatch) == (0, 1):
                torch.cuda._sleep(cycles)
            else:
                torch.cuda._sleep(1_000)  # a little work on the stream
        host_ns[cell * 10 + microbatch] = time.monotonic_ns() - started

    pooled = []
    for _ in range(2):
        executor.run(schedule, task)
        assert executor.live_timing_events == 2 * len(schedule.tasks)  # held until read
        spans = {t: (start, end) for t, start, end in executor.last_spans()}
        assert executor.live_timing_events == 0 and executor.live_events == 0
        pooled.append(executor.pooled_timing_events)
    assert pooled == [2 * len(schedule.tasks)] * 2  # the second run reused the first's

    assert host_ns[1] < 0.5 * sleep_ms * 1e6  # the callback only enqueued the sleep
    start, end = spans[sleeper]
    assert end - start >= 0.9 * sleep_ms * 1e6
    for task_id, t in enumerate(schedule.tasks):
        for dep in t.deps:
            assert spans[dep][1] <= spans[task_id][0]
    for cell in range(2):
        order = schedule.order(cell)
        for before, after in itertools.pairwise(order):
            assert spans[before][1] <= spans[after][0]
    executor.close()


class _DeviceSleep(nn.Module):
    """Keeps the current stream busy for `cycles` and passes its input on."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return x * 1.0


@needs_cuda
def test_cuda_cells_timeline_follows_the_schedule_on_the_gpu(make_pipe: Any) -> None:
    cycles, sleep_ms = device_sleep_cycles(10)
    model = nn.Sequential(_DeviceSleep(cycles), nn.Linear(6, 6), nn.Linear(6, 6)).double()
    timeline, checkpointed = _recorded_step(
        make_pipe, model, [1, 2], M, "except_last", devices=["cuda:0", "cuda:0"]
    )
    assert timeline.clocks == ("cuda", "cuda")
    _assert_spans_follow_schedules(timeline, checkpointed)
    sleepers = [s for s in timeline.spans if s.cell == 0 and s.kind in ("forward", "recompute")]
    assert len(sleepers) == M + sum(checkpointed)
    assert all(s.duration_s >= 0.9 * sleep_ms * 1e-3 for s in sleepers)


@needs_cuda
def test_mixed_cpu_and_cuda_cells_share_one_time_axis(make_pipe: Any) -> None:
    """A CPU cell timed on the host feeding a CUDA cell timed by events, and back: the
    order holds across the two clocks, up to the anchor's calibration error."""
    timeline, checkpointed = _recorded_step(
        make_pipe, _mlp(2), [1, 1], M, "except_last", devices=["cpu", "cuda:0"]
    )
    assert timeline.clocks == ("host", "cuda")
    _assert_spans_follow_schedules(timeline, checkpointed, slack_s=200e-6)


@needs_cuda
def test_recording_off_creates_no_timing_events(make_pipe: Any) -> None:
    pipe = make_pipe(_mlp(2).cuda(), [1, 1], devices=["cuda:0", "cuda:0"], chunks=2)
    x = torch.randn(4, 6, dtype=torch.float64, device="cuda", requires_grad=True)
    pipe(x).sum().backward()
    executor = pipeline_of(pipe).executor
    assert executor.pooled_timing_events == 0 and executor.last_spans() == []
    pipe.record_timeline()
    pipe(x).sum().backward()
    assert len(pipe.timeline().spans) > 0
    assert executor.live_timing_events == 0 and executor.live_events == 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zero_bubble"])
def test_train_step_is_recorded_for_every_schedule(
    make_pipe: Any, tmp_path: Path, schedule: str
) -> None:
    workers = 2 if schedule == "interleaved" else 4
    pipe = make_pipe(_mlp(4), [1] * 4, devices=["cpu"] * workers, chunks=3,
                     checkpoint="except_last", schedule=schedule)  # fmt: skip
    x = torch.randn(6, 6, dtype=torch.float64)
    pipe.record_timeline()
    pipe.train_step(x, x, torch.nn.functional.mse_loss)
    timeline = pipe.timeline()
    schedule_run, _ = pipeline_of(pipe).recorded["step"]
    assert (timeline.cells, timeline.workers, timeline.schedule) == (4, workers, schedule)
    assert {s.phase for s in timeline.spans} == {"step"}
    assert sorted(s.task for s in timeline.spans) == list(range(len(schedule_run.tasks)))
    kinds = {s.kind for s in timeline.spans}
    assert {"forward", "loss"} <= kinds
    split = {"backward_input", "backward_weight"}
    assert (split <= kinds) == (schedule == "zero_bubble")
    assert ("backward" in kinds) == (schedule != "zero_bubble")
    for span in timeline.spans:
        assert span.worker == span.cell % workers
    for worker in range(workers):  # each worker runs its program in order, no overlap
        mine = sorted((s for s in timeline.spans if s.worker == worker), key=lambda s: s.start_s)
        assert [s.task for s in mine] == schedule_run.order(worker)
        for before, after in itertools.pairwise(mine):
            assert before.end_s <= after.start_s
    assert 0 <= timeline.bubble() < 1
    trace = tmp_path / f"{schedule}.json"
    timeline.to_chrome_trace(trace)
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(names) == len(timeline.spans)
    assert any(name.startswith("L3.") for name in names)  # the loss of cell 3
    pytest.importorskip("matplotlib")
    path = tmp_path / f"{schedule}.png"
    timeline.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
