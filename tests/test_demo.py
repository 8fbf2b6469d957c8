"""The demo job runs end to end with tiny options, writes its timeline, and explains its
throughput with consistent figures (no wall-clock bounds: only how the figures relate)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest


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
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["cell", "threads"])
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [row[0] for row in rows] == ["0", "1"]
    for row in rows:
        assert row[1] == threads  # pipe.threads_per_cell, or "default"
        tasks = row[2]
        assert int(tasks) == 2 * 4 + 3  # M=4: forward and backward each, 3 recomputes
        per_task = [_number(row[3]), _number(row[5])]  # compute/task, overhead/task in ms
        assert row[4] == row[6] == "ms"
        assert per_task[0] > 0 and per_task[1] >= 0
        shares = [_number(share) for share in row[7:]]
        assert len(shares) == 4 and all(0 <= share <= 100 for share in shares)
        assert 0 < shares[0] <= 100  # compute
        assert sum(shares) == pytest.approx(100, abs=0.3)


def test_demo_bubble_line_is_consistent(demo: tuple[Path, str]) -> None:
    _, stdout = demo
    bubble = _line(stdout, "bubble:")
    found = re.search(
        r"measured ([\d.]+)% of cell time \(idle and hand-offs: ([\d.]+)% \+ ([\d.]+)%\), "
        r"ideal ([\d.]+)% for K=2, M=4 \(\(K-1\)/\(M\+K-1\)\), ([\d.]+)% with",
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
