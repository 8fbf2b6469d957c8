"""The demo job runs end to end with tiny options, writes its timeline, and explains its
throughput with consistent figures (no wall-clock bounds: only how the figures relate)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from gpipe_fast import _C
from gpipe_fast.demo import report
from gpipe_fast.demo.job import arguments, cells_per_worker, run_demo
from gpipe_fast.runtime.timeline import TaskSpan, Timeline
from gpipe_fast.schedule.registry import builtin_schedules, placement, schedule_kind

SCHEDULES = builtin_schedules()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The folder the demo ran in, and what it printed."""
    folder = tmp_path_factory.mktemp("demo")
    command = [sys.executable, "-m", "gpipe_fast", "demo", "--steps", "5", "--width", "32"]
    command += ["--depth", "2", "--batch", "64", "--chunks", "4", "--lr", "1e-2", "--out", "out"]
    # From an empty folder, so the installed package is imported, not the source tree.
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=folder, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return folder, result.stdout


def _line(stdout: str, start: str) -> str:
    """The paragraph starting with `start`, its wrapped lines (indented) joined again."""
    lines = stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(start)]
    assert len(starts) == 1, f"want one line starting {start!r} in:\n{stdout}"
    paragraph = [lines[starts[0]]]
    for line in lines[starts[0] + 1 :]:
        if not line.startswith("  "):
            break
        paragraph.append(line.strip())
    return " ".join(paragraph)


def _number(text: str) -> float:
    return float(text.replace(",", "").rstrip("%x"))


def test_demo_writes_the_timeline(demo: tuple[Path, str]) -> None:
    folder, stdout = demo
    assert str(Path("out") / "timeline.trace.json") in stdout
    events = json.loads((folder / "out" / "timeline.trace.json").read_text())["traceEvents"]
    assert any(event["ph"] == "X" for event in events)


def test_demo_prints_lines_of_at_most_100_columns(demo: tuple[Path, str]) -> None:
    _, stdout = demo
    assert max(len(line) for line in stdout.splitlines()) <= 100


def test_demo_trains_both_models_on_the_same_data(demo: tuple[Path, str]) -> None:
    _, stdout = demo
    assert "K=2 cells" in _line(stdout, "gpipe_fast demo:")
    assert "same initial weights, data and optimizer" in _line(stdout, "against the plain model")
    loss = _line(stdout, "loss:")
    pipe, plain = re.findall(r"(\d+\.\d+) -> (\d+\.\d+)", loss)
    assert float(pipe[1]) < float(pipe[0])  # the exit code says so too
    # Same weights, data and maths: the losses agree up to float rounding.
    assert [float(v) for v in pipe] == pytest.approx([float(v) for v in plain], rel=1e-3)


def test_demo_throughput_ratio_matches_its_figures(demo: tuple[Path, str]) -> None:
    _, stdout = demo
    found = re.search(
        r"gpipe_fast ([\d,]+) samples/s, plain model ([\d,]+) samples/s: ([\d.]+)x",
        _line(stdout, "throughput:"),
    )
    assert found is not None
    pipe, plain, ratio = map(_number, found.groups())
    assert pipe > 0 and plain > 0
    assert ratio == pytest.approx(pipe / plain, rel=0.02, abs=0.01)
    verdict = _line(stdout, "verdict:")
    assert f"({ratio:.2f}x the plain model)" in verdict
    assert ("slower here" in verdict) == (ratio < 1.0)
    assert "does not fit one device" in verdict or "does not explain it" in verdict


def test_demo_breakdown_table_is_consistent(demo: tuple[Path, str]) -> None:
    _, stdout = demo
    setup = _line(stdout, "gpipe_fast demo:").rsplit("threads per cell: ", 1)[1]
    threads, reason = setup.split(" ", 1)  # the count, then why: "(2 cores shared by ...)"
    assert reason.startswith("(") and reason.endswith(")")
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["worker", "cells"])
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [row[:2] for row in rows] == [["0", "0"], ["1", "1"]]  # worker, its cell
    for row in rows:
        assert row[2] == threads  # pipe.threads_per_cell, or "default"
        # The tasks of 1f1b's step on the worker: forwards, backwards, the recomputes of
        # except_last, and on the last cell the losses.
        step = _C.make_schedule("1f1b", 2, 2, 4, "except_last")
        assert int(row[3]) == sum(task.worker == int(row[0]) for task in step.tasks)
        per_task = [_number(row[4]), _number(row[6])]  # compute/task, overhead/task in ms
        assert row[5] == row[7] == "ms"
        assert per_task[0] > 0 and per_task[1] >= 0
        shares = [_number(share) for share in row[8:]]
        assert len(shares) == 4 and all(0 <= share <= 100 for share in shares)
        assert 0 < shares[0] <= 100  # compute
        assert sum(shares) == pytest.approx(100, abs=0.3)


def test_demo_bubble_line_is_consistent(demo: tuple[Path, str]) -> None:
    _, stdout = demo
    bubble = _line(stdout, "bubble:")
    found = re.search(
        r"measured ([\d.]+)% of worker time \(idle and hand-offs: ([\d.]+)% \+ ([\d.]+)%\), "
        r"ideal ([\d.]+)% for 1f1b with K=2, M=4 \(\(K-1\)/\(M\+K-1\)\), ([\d.]+)% with",
        bubble,
    )
    assert found is not None, bubble
    measured, idle, handoffs, ideal, simulated = map(float, found.groups())
    assert 0 <= measured < 100 and 0 <= simulated < 100
    assert measured == pytest.approx(idle + handoffs, abs=0.15)
    assert ideal == 20.0  # (K-1)/(M+K-1) = 1/5


def test_demo_trains_the_unet_whose_skips_cross_cells(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "gpipe_fast", "demo", "--model", "unet", "--steps", "6",
               "--batch", "16", "--chunks", "4", "--lr", "3e-3", "--out", "out"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr  # 0: the pipe's loss fell
    assert "K=2 cells" in _line(result.stdout, "gpipe_fast demo:")
    # Each cell timed alone, the decoder cell with the skips the encoder cell stashed for it.
    assert _line(result.stdout, "bubble:").startswith("bubble: measured")
    assert (tmp_path / "out" / "timeline.trace.json").exists()


# -- every schedule, the help, the picture -----------------------------------------------------


def _run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The demo run in this process (no interpreter to start): its exit code and output."""
    code = run_demo(argv)
    return code, capsys.readouterr().out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_demo_trains_with_every_schedule_and_draws_it(
    schedule: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--schedule", schedule, "--steps", "5", "--width", "32", "--depth", "2", "--batch",
            "64", "--chunks", "4", "--lr", "1e-2", "--out", str(tmp_path)]  # fmt: skip
    code, stdout = _run_in_process(argv, capsys)
    assert code == 0, stdout  # the pipe's loss fell
    per_worker = cells_per_worker(schedule)
    setup = _line(stdout, "gpipe_fast demo:")
    assert f"schedule {schedule!r}, K={2 * per_worker} cells" in setup
    # The pipe trained as the plain model did: its train_step is the plain model's step.
    pipe, plain = re.findall(r"(\d+\.\d+) -> (\d+\.\d+)", _line(stdout, "loss:"))
    assert [float(v) for v in pipe] == pytest.approx([float(v) for v in plain], rel=1e-3)
    # A row per worker with the cells the schedule places on it.
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["worker", "cells"])
    rows = [line.split()[:2] for line in lines[header + 1 : header + 3]]
    where = placement(schedule, 2 * per_worker, 2)
    cells = [",".join(str(c) for c, w in enumerate(where) if w == worker) for worker in (0, 1)]
    assert rows == [["0", cells[0]], ["1", cells[1]]]
    assert f"for {schedule} with K={2 * per_worker}" in _line(stdout, "bubble:")
    # The step recorded is a train_step of that schedule, and the picture says so.
    events = json.loads((tmp_path / "timeline.trace.json").read_text())["traceEvents"]
    assert {e["args"]["phase"] for e in events if e["ph"] == "X"} == {"step"}
    title = ElementTree.parse(tmp_path / "timeline.svg").getroot().find(f"{_SVG}text")
    assert title is not None and title.text is not None
    assert title.text.startswith(f"gpipe_fast step, schedule {schedule}:")
    assert str(tmp_path / "timeline.svg") in _line(stdout, "timeline picture:")


_SVG = "{http://www.w3.org/2000/svg}"


def test_demo_help_names_every_schedule_and_its_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        run_demo(["--help"])
    assert exited.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse's wrapping undone

    def has(words: str) -> bool:
        return "".join(words.split()) in text

    for schedule in SCHEDULES:
        assert has(f"{schedule}: {schedule_kind(schedule).summary}")
    assert has("in one process and across processes (default 1f1b)")
    assert not has("one process only")  # --model unet runs across processes too
    assert has("(default except_last)") and has("timeline.svg")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_demo_takes_every_schedule_across_processes(schedule: str) -> None:
    args = arguments(["--processes", "2", "--schedule", schedule])
    assert (args.processes, args.schedule, args.batch) == (2, schedule, 1024)


def test_demo_refuses_cells_across_processes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        arguments(["--processes", "2", "--cells", "3"])
    assert exited.value.code == 2
    assert "--cells is for one process" in capsys.readouterr().err


def _one_task() -> Timeline:
    span = TaskSpan("step", "forward", 0, 0, 0.0, 1e-3, task=0, worker=0)
    return Timeline(cells=1, microbatches=1, spans=[span], schedule="1f1b")


def test_the_picture_needs_no_matplotlib(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timeline = _one_task()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert report.write_timeline(timeline, tmp_path, "a note") == [tmp_path / "timeline.svg"]
    assert not (tmp_path / "timeline.png").exists()
    stdout = " ".join(capsys.readouterr().out.split())
    assert f"timeline picture: {tmp_path / 'timeline.svg'} (open it in a web browser" in stdout
    assert "schedule 1f1b" in (tmp_path / "timeline.svg").read_text()


def test_the_picture_is_a_png_too_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    timeline = _one_task()
    written = report.write_timeline(timeline, tmp_path, "a note")
    assert written == [tmp_path / "timeline.svg", tmp_path / "timeline.png"]
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
