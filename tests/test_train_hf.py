"""examples/train_hf.py, transformers' LlamaForCausalLM through gf.pipeline, as a real job: a
checkpoint written at --pp 2 under torchrun resumes in one process (2 CPU cells), with the
uninterrupted run's losses to the bit; its padded, prompt-masked batches train as
the plain model trains on them, step by step."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

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


def test_a_pp2_checkpoint_resumes_in_one_process(tmp_path: Path) -> None:
    stdout, uninterrupted = _job(tmp_path / "uninterrupted", "--pp", "2")
    assert "split points ['model.layers.1']" in stdout and "final validation loss" in stdout
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))
    saved = tmp_path / "uninterrupted" / "ckpt" / f"step-{SAVED}"
    assert sorted(p.name for p in saved.parent.iterdir()) == [f"step-{SAVED}", f"step-{STEPS}"]

    # One process, a pipe of 2 CPU cells (no torchrun): the pp=2 checkpoint resumes there.
    # (At pp=2 again, a transformers model's checkpoint resumes in test_any_model_checkpoints
    # and this example's loop in test_train_lm, each to the bit.)
    stdout, alone = _job(_from_checkpoint(saved, tmp_path / "alone"))
    assert f"step-{SAVED} at step {SAVED}" in stdout and "pp=1" in stdout
    # The same cells, the same micro-batches: the same float32 sums in the same order.
    assert alone == {step: uninterrupted[step] for step in range(SAVED + 1, STEPS + 1)}


def _example() -> Any:
    """examples/train_hf.py as a module (its folder on sys.path, for train_lm)."""
    folder = str(SCRIPT.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("train_hf")


def _plain_losses(flags: list[str]) -> tuple[dict[int, float], float]:
    """The plain LlamaForCausalLM trained as the example trains it (the same weights,
    batches, AdamW groups, clipping and learning rates), on the whole batch in one process:
    the loss of each step, and the validation loss after."""
    example = _example()
    args = example.parse_args(flags)
    corpus = example.Corpus()
    model = example.build_model(corpus.vocab, args)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": args.weight_decay},
         {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: example.lr_factor(s, args.warmup, args.steps)
    )
    losses = {}
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**example.train_batch(corpus, step, args.batch, args)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        scheduler.step()
        losses[step + 1] = loss.item()
    with torch.no_grad():
        val = model(**example.val_batch(corpus, args.val_batch, args)).loss.item()
    return losses, val


def test_padded_prompt_masked_batches_train_as_the_plain_model(tmp_path: Path) -> None:
    # Documents of different lengths, padded to the longest and prompt-masked: micro-batches
    # count very different numbers of tokens, and the pipe's losses are the plain model's.
    example = _example()
    args, corpus = example.parse_args(SMALL), example.Corpus()
    halves = []  # the tokens counted by each step's 2 micro-batches
    for step in range(STEPS):
        batch = example.train_batch(corpus, step, args.batch, args)
        assert batch["attention_mask"].min() == 0  # padded
        halves.append([int((h[:, 1:] != -100).sum()) for h in batch["labels"].chunk(2)])
    assert sum(a != b for a, b in halves) >= STEPS // 2, halves
    flags = [*SMALL, "--dtype", "float64", "--loss-log", str(tmp_path / "loss.jsonl")]
    val = example.main(flags)
    lines = (tmp_path / "loss.jsonl").read_text().splitlines()
    losses = {r["step"]: r["loss"] for r in map(json.loads, lines)}
    plain, plain_val = _plain_losses(flags)
    assert losses == pytest.approx(plain, rel=1e-6)  # float32 losses, float64 gradients
    assert val == pytest.approx(plain_val, rel=1e-6)
