"""bench/any_model.py at toy size: it runs both libraries across two processes and writes a
record with every section, cell and timing field (no time is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent


def test_toy_run_writes_the_whole_record(tmp_path: Path) -> None:
    out = tmp_path / "any_model.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "any_model.py"), "--toy", "--skip-four",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["mode"] == "toy" and record["models"] == ["llama"]

    timing = record["sections"]["step_time"]
    names = {"gpipe_fast 1f1b", "torch 1f1b", "gf.GPipe 1f1b, nn.Sequential"}
    assert set(timing["medians_ms"]) == names
    assert all(value > 0 for value in timing["medians_ms"].values())
    assert set(timing["speedup_over_torch"]) == {"1f1b"}
    assert {"frontend_share", "new_length_first_ms", "new_length_next_ms", "targets"} <= set(timing)
    # Every contender trained the same model on the same batch: the same first loss.
    losses = list(timing["first_step_loss"].values())
    assert losses == pytest.approx([losses[0]] * len(losses), rel=1e-4)

    cells = record["sections"]["capabilities"]["models"]
    assert set(cells) == {"gpipe_fast/llama", "torch/llama"}
    columns = {"builds", "2 stages exact", "4 stages exact", "tie exact", "uneven batch",
               "new sequence length"}  # fmt: skip
    for key, entry in cells.items():
        assert set(entry["cells"]) == columns, key
        assert entry["cells"]["4 stages exact"]["outcome"] == "not run"  # --skip-four
        assert entry["cells"]["tie exact"]["outcome"] == "n/a"  # LLaMA ties nothing
    # gf.pipeline's promise, as the script measures it (tests/test_any_model.py proves it).
    ours = cells["gpipe_fast/llama"]["cells"]
    for column in ("2 stages exact", "uneven batch", "new sequence length"):
        assert ours[column]["outcome"] == "exact", (column, ours[column])
    assert "| llama | torch |" in record["tables"]["capabilities"]
