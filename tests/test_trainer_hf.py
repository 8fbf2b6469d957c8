"""examples/trainer_hf.py, PipelineTrainer as a real job: in one process and under torchrun at
--pp 2 it trains, saves a directory that from_pretrained loads alone to generate text, and a
checkpoint it wrote resumes with the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "trainer_hf.py"
STEPS, SAVED = 6, 3
# A tiny LLaMA, so that a job takes seconds on 2 cores (most of it importing transformers).
SMALL = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "16", "--batch", "4",
         "--chunks", "2", "--steps", str(STEPS), "--save-steps", str(SAVED), "--generate", "8",
         "--no-progress"]  # fmt: skip


def _job(folder: Path, *layout: str, resume: bool = False) -> str:
    """Runs the example into `folder` (under torchrun with 2 processes when `layout` is
    given); its output."""
    flags = [*SMALL, "--output-dir", str(folder), *layout, *(["--resume"] if resume else [])]
    command = [sys.executable, str(SCRIPT), *flags]
    if layout:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def _losses(checkpoint: Path) -> dict[int, float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}


def test_one_process_trains_saves_and_generates(tmp_path: Path) -> None:
    stdout = _job(tmp_path)
    assert "split points ['model.layers.1']; pp=1 dp=1" in stdout
    assert "final validation loss" in stdout and "generated: Pipeline parallelism" in stdout
    final = set(os.listdir(tmp_path / "final"))
    assert {"config.json", "model.safetensors", "characters.json"} <= final


def test_pp2_saves_shards_and_a_checkpoint_resumes_with_the_same_losses(tmp_path: Path) -> None:
    stdout = _job(tmp_path / "whole", "--pp", "2")
    assert "pp=2 dp=1" in stdout and "generated: Pipeline parallelism" in stdout
    final = set(os.listdir(tmp_path / "whole" / "final"))
    assert {"model.safetensors.index.json", "model-00001-of-00002.safetensors"} <= final
    uninterrupted = _losses(tmp_path / "whole" / f"checkpoint-{STEPS}")
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))

    # Started again from the checkpoint of step SAVED alone: every later loss, to the bit.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / f"checkpoint-{SAVED}", resumed / f"checkpoint-{SAVED}")
    _job(resumed, "--pp", "2", resume=True)
    assert _losses(resumed / f"checkpoint-{STEPS}") == uninterrupted
