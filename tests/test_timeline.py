"""Timeline recording: every task once, in order, after its dependencies; bubble; outputs."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.timeline import Timeline

from helpers import Sleepy

K, M = 3, 4


def _recorded_step(
    make_pipe: Any, model: nn.Sequential, balance: list[int], chunks: int, checkpoint: str
) -> tuple[Timeline, list[bool]]:
    """One warm-up step, then one recorded step (forward and backward)."""
    pipe = make_pipe(
        model, balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint
    )
    x = torch.randn(chunks * 2, 6, dtype=torch.float64, requires_grad=True)
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


@pytest.mark.parametrize("checkpoint", ["except_last", "always", "never"])
def test_spans_cover_every_task_once_in_order_after_dependencies(
    make_pipe: Any, checkpoint: str
) -> None:
    timeline, checkpointed = _recorded_step(make_pipe, _mlp(K), [1] * K, M, checkpoint)
    assert (timeline.cells, timeline.microbatches) == (K, M)
    for phase, schedule in _schedules(K, M, checkpointed).items():
        spans = [s for s in timeline.spans if s.phase == phase]
        # Every task of the schedule exactly once, with its kind, cell and micro-batch.
        assert sorted(s.task for s in spans) == list(range(len(schedule.tasks)))
        by_task = {s.task: s for s in spans}
        for task_id, task in enumerate(schedule.tasks):
            span = by_task[task_id]
            assert (span.kind, span.cell, span.microbatch) == (
                task.kind.name.lower(),
                task.cell,
                task.microbatch,
            )
            assert span.start_s <= span.end_s
            for dep in task.deps:  # starts only after its dependencies ended
                assert by_task[dep].end_s <= span.start_s
        for cell in range(K):  # per cell: the schedule's order, no overlap
            mine = sorted((s for s in spans if s.cell == cell), key=lambda s: s.start_s)
            assert [s.task for s in mine] == schedule.order(cell)
            for before, after in itertools.pairwise(mine):
                assert before.end_s <= after.start_s
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
        (i, (t.microbatch + t.cell) * tick, (t.microbatch + t.cell + 1) * tick)
        for i, t in enumerate(forward.tasks)
    ]
    start = (chunks + cells - 1) * tick + gap
    backward_spans = []
    for i, t in enumerate(backward.tasks):
        slot = (chunks - 1 - t.microbatch) + (cells - 1 - t.cell)
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


def test_bubble_of_equal_cost_cells(make_pipe: Any) -> None:
    """Layers that sleep 5 ms so timing dominates overheads. Only robust claims: with one
    micro-batch the cells take turns, so the bubble is at least (K-1)/K by construction;
    with 16 it is clearly smaller, and loosely near (K-1)/(M+K-1)."""
    cells = 2

    def sleepy() -> nn.Sequential:
        return nn.Sequential(*[Sleepy(5, 5) for _ in range(cells)])

    one, _ = _recorded_step(make_pipe, sleepy(), [1] * cells, 1, "never")
    many, _ = _recorded_step(make_pipe, sleepy(), [1] * cells, 16, "never")
    assert one.bubble() >= (cells - 1) / cells - 1e-9
    assert 0 <= many.bubble() < one.bubble()
    assert many.bubble() <= many.ideal_bubble + 0.3


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
    assert pipe._pipeline.executor.last_spans() == []  # nothing timed when off
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
    assert pipe._pipeline.executor.last_spans() == []


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
