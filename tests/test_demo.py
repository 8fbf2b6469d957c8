"""The demo job runs end to end with tiny options and writes its timeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_runs_and_writes_the_timeline(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "gpipe_fast", "demo", "--steps", "5", "--width", "16"]
    command += ["--depth", "2", "--out", "out"]
    # From an empty folder, so the installed package is imported, not the source tree.
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loss:" in result.stdout
    assert "bubble of one step (timeline): measured" in result.stdout
    trace = tmp_path / "out" / "timeline.trace.json"
    assert str(Path("out") / "timeline.trace.json") in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event["ph"] == "X" for event in events)
