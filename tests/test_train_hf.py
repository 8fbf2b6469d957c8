"""examples/train_hf.py, transformers' LlamaForCausalLM through gf.pipeline, as a real job: a
checkpoint written at --pp 2 under torchrun resumes there, and in one process (2 CPU cells),
with the uninterrupted run's losses to the bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_hf.py"
STEPS, SAVED = 6, 3
# A tiny LLaMA, so that a job takes seconds on 2 cores (most of it importing transformers).
SMALL = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "16", "--batch", "8",
         "--chunks", "2", "--steps", str(STEPS), "--warmup", "2", "--checkpoint-every",
         str(SAVED), "--val-batch", "4"]  # fmt: skip


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def _job(folder: Path, *layout: str) -> tuple[str, dict[int, float]]:
    """Runs the example with its checkpoints and loss log in `folder`: its output, and the
    loss of each step it ran."""
    flags = [*SMALL, "--checkpoint-dir", str(folder / "ckpt"), "--loss-log",
             str(folder / "loss.jsonl"), *layout]  # fmt: skip
    if layout:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=2", str(SCRIPT), *flags]  # fmt: skip
    else:
        command = [sys.executable, str(SCRIPT), *flags]
    stdout = _run(command).stdout
    lines = (folder / "loss.jsonl").read_text().splitlines()
    return stdout, {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _from_checkpoint(saved: Path, folder: Path) -> Path:
    shutil.copytree(saved, folder / "ckpt" / saved.name)
    return folder


def test_a_checkpoint_resumes_at_pp2_and_in_one_process(tmp_path: Path) -> None:
    stdout, uninterrupted = _job(tmp_path / "uninterrupted", "--pp", "2")
    assert "split points ['model.layers.1']" in stdout and "final validation loss" in stdout
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))
    saved = tmp_path / "uninterrupted" / "ckpt" / f"step-{SAVED}"
    assert sorted(p.name for p in saved.parent.iterdir()) == [f"step-{SAVED}", f"step-{STEPS}"]

    # The same command, started again from step SAVED: every later loss, to the bit.
    stdout, resumed = _job(_from_checkpoint(saved, tmp_path / "resumed"), "--pp", "2")
    assert f"step-{SAVED} at step {SAVED}" in stdout
    assert resumed == {step: uninterrupted[step] for step in range(SAVED + 1, STEPS + 1)}

    # One process, a pipe of 2 CPU cells (no torchrun): the pp=2 checkpoint resumes there.
    stdout, alone = _job(_from_checkpoint(saved, tmp_path / "alone"))
    assert f"at step {SAVED}" in stdout and "pp=1" in stdout
    # The same cells, the same micro-batches: the same float32 sums in the same order.
    assert alone == {step: uninterrupted[step] for step in range(SAVED + 1, STEPS + 1)}
