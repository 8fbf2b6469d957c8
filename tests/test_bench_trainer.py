"""bench/trainer_overhead.py and bench/pretrained_memory.py at toy size: each runs its
contenders across processes and prints its table (no time or memory is asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parent.parent


def _run(script: str, *flags: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *flags],
                          capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_trainer_overhead_runs_its_three_contenders() -> None:
    # pp=2 x dp=2 (the pipe's every layer of the bench: stages, replicas, DDP over all four).
    out = _run("trainer_overhead.py", "--processes", "4", "--pp", "2", "--width", "64",
               "--layers", "2", "--length", "32", "--steps", "4", "--rounds", "1")  # fmt: skip
    assert "4 processes: pp=2 dp=2" in out, out
    for contender in ("PipelineTrainer", "own loop", "Trainer + DDP"):
        assert re.search(rf"^\| {re.escape(contender)} \| [\d,]+ \|", out, re.MULTILINE), out
    assert "Trainer's machinery around the pipe:" in out


def test_pretrained_memory_measures_both_ways_of_loading() -> None:
    out = _run("pretrained_memory.py", "--width", "64", "--layers", "2", "--vocab", "1000")
    assert re.search(r"^\| from_pretrained on every rank.*\| [\d.]+ \|$", out, re.MULTILINE)
    assert re.search(r"^\| meta device, gf.pipeline, load_pretrained.*\| [\d.]+ \|$", out,
                     re.MULTILINE)  # fmt: skip
