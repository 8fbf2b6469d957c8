"""bench/compiled.py at toy size: every compiled pipe runs its graphs in one process and across
two, the float64 check is exact, and the record holds every field (no time is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent


def test_smoke_run_writes_the_whole_record(tmp_path: Path) -> None:
    out = tmp_path / "compiled.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "compiled.py"), "--smoke", "--backend", "eager",
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["scale"] == "smoke" and record["backend"] == "eager"
    one, two = record["sections"]["one process"], record["sections"]["two processes"]
    assert {"plain, eager", "plain, compiled"} <= set(one)
    for section in (one, two):
        for schedule in ("1f1b", "zero_bubble"):
            eager = section[f"gf.pipeline {schedule}, eager"]
            compiled = section[f"gf.pipeline {schedule}, compiled"]
            assert eager["median_s"] > 0 and "compiled_vs_eager" in compiled
            # 2 layers x 2 micro-batches ran compiled (summed over the ranks across two).
            assert compiled["compiled_runs_per_step"] == 4
        assert "zero_bubble_vs_1f1b" in section["gf.pipeline zero_bubble, compiled"]
    exact = record["sections"]["exactness"]
    assert exact["loss_relative_difference"] < 1e-12
    assert exact["max_relative_grad_difference"] < 1e-10
    assert exact["compiled_runs"] > 0
