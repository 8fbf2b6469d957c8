"""examples/train_lm.py as a real job: killed mid-run and restarted, it ends with the
uninterrupted run's parameters to the bit; its checkpoints written at pp=2 resume at pp=1 and
at pp=2 x dp=2 with the uninterrupted run's losses; and it learns."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_lm.py"
STEPS = 12
# A tiny model, so that a 2- or 4-process job takes seconds on 2 cores.
SMALL = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "16", "--batch", "8",
         "--chunks", "2", "--steps", str(STEPS), "--warmup", "3", "--checkpoint-every", "4",
         "--no-progress"]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    # torchrun's agent shares its TCPStore with the workers and keeps it across restarts: a
    # restarted gloo job then reads the dead attempt's addresses (pytorch/pytorch#135712).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _torchrun(nproc: int, args: list[str], restarts: int = 0) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={nproc}", f"--max-restarts={restarts}", str(SCRIPT),
                 *args])  # fmt: skip


def _ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def _losses(log: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (before a kill and after the resume) keeps the
    later line, and both must agree anyway (checked by the callers that care)."""
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


def _final(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("rank*.pt")):
        for key, value in torch.load(path).items():
            if key in state:  # dp replicas and tied copies: every copy must be equal
                assert torch.equal(state[key], value), key
            state[key] = value
    return state


def _run_dir(tmp: Path, name: str) -> dict[str, Path]:
    base = tmp / name
    return {"ckpt": base / "ckpt", "log": base / "loss.jsonl", "final": base / "final"}


def _flags(paths: dict[str, Path], *extra: str) -> list[str]:
    return [*SMALL, "--checkpoint-dir", str(paths["ckpt"]), "--loss-log", str(paths["log"]),
            "--save-final", str(paths["final"]), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    paths = _run_dir(tmp_path_factory.mktemp("lm"), "uninterrupted")
    _ok(_torchrun(2, _flags(paths, "--pp", "2")))
    return {**paths, "losses": _losses(paths["log"]), "state": _final(paths["final"])}


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_a_killed_rank_restarted_in_place_ends_bitwise_equal(
    uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    # Rank 1 SIGKILLs itself after step 6 (checkpoints at 4): torchrun --max-restarts 1 starts
    # both ranks again, which resume from step-4 and run to the end.
    paths = _run_dir(tmp_path, "restarted")
    result = _torchrun(2, _flags(paths, "--pp", "2", "--die-at-step", "6"), restarts=1)
    _ok(result)
    assert "dying after step 6" in result.stdout
    assert "resumed from" in result.stdout and "step-4 at step 4" in result.stdout
    lines = [json.loads(line)["step"] for line in paths["log"].read_text().splitlines()]
    # Steps 1-6 (6 unless rank 0 was stopped before logging it), then 5 to the end again.
    assert lines[-(STEPS - 4) :] == list(range(5, STEPS + 1))
    assert lines[: -(STEPS - 4)] in (list(range(1, 7)), list(range(1, 6)))
    assert _losses(paths["log"]) == uninterrupted["losses"]  # every step's loss, exactly
    _assert_same_state(_final(paths["final"]), uninterrupted["state"])


def test_a_job_killed_mid_save_relaunched_by_hand_ends_bitwise_equal(
    uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    # Without torchrun's restart, and killed in the save of step 8 once its own dcp.save has
    # returned: the job fails, step-8 was never declared complete, and the same command
    # resumes from step-4.
    paths = _run_dir(tmp_path, "relaunched")
    killed = _torchrun(2, _flags(paths, "--pp", "2", "--die-at-step", "8", "--die-while-saving"))
    assert killed.returncode != 0
    assert "dying while saving 8" in killed.stdout
    assert sorted(p.name for p in paths["ckpt"].iterdir()) == ["step-4", "step-8.tmp"]
    relaunched = _torchrun(2, _flags(paths, "--pp", "2"))
    _ok(relaunched)
    assert "step-4 at step 4" in relaunched.stdout
    assert _losses(paths["log"]) == uninterrupted["losses"]
    _assert_same_state(_final(paths["final"]), uninterrupted["state"])
    assert sorted(p.name for p in paths["ckpt"].iterdir()) == ["step-12", "step-4", "step-8"]


# Resharding changes where the tied weight's two gradients are added (autograd in one process,
# an all-reduce across ranks) and how dp replicas' gradients are summed: float32 sums in
# another order differ in the last bits, and the next steps carry that on. Measured over
# 8 steps: losses within 2.3e-7 relative (pp2 x dp2; 6e-8 at pp1), parameters within 2e-8
# but for one tensor, below.
RESHARD_RTOL = 1e-6
# The key third of each block's qkv.bias has no gradient in exact arithmetic (softmax does not
# change when the same number is added to every score of a row), so its float gradient is
# rounding noise, which AdamW divides by its own root mean square: a change of summation
# order moves it by up to lr per step (measured: 1.1e-6 after 8 steps, lr <= 3e-3).
KEY_BIAS_ATOL = 1e-4


def _resumed_copy(uninterrupted: dict[str, Any], tmp_path: Path, name: str) -> dict[str, Path]:
    paths = _run_dir(tmp_path, name)
    paths["ckpt"].mkdir(parents=True)
    shutil.copytree(uninterrupted["ckpt"] / "step-4", paths["ckpt"] / "step-4")
    return paths


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (1, ["--pp", "1"]),
        (4, ["--pp", "2", "--dp", "2"]),
        (4, ["--pp", "2", "--dp", "2", "--dp-shard"]),
    ],
    ids=["pp1", "pp2xdp2", "pp2xdp2 sharded"],
)
def test_a_pp2_checkpoint_resumes_at_another_layout(
    uninterrupted: dict[str, Any], tmp_path: Path, nproc: int, layout: list[str]
) -> None:
    paths = _resumed_copy(uninterrupted, tmp_path, "resharded")
    if nproc == 1:
        result = _run([sys.executable, str(SCRIPT), *_flags(paths, *layout)])
    else:
        result = _torchrun(nproc, _flags(paths, *layout))
    _ok(result)
    assert "at step 4" in result.stdout
    got, want = _losses(paths["log"]), uninterrupted["losses"]
    assert sorted(got) == list(range(5, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=RESHARD_RTOL), step
    state = _final(paths["final"])
    assert state.keys() == uninterrupted["state"].keys()
    for key, value in state.items():
        want = uninterrupted["state"][key]
        if key.endswith("qkv.bias"):
            q, k, v = value.chunk(3)
            wq, wk, wv = want.chunk(3)
            torch.testing.assert_close(k, wk, rtol=0, atol=KEY_BIAS_ATOL)
            value, want = torch.cat([q, v]), torch.cat([wq, wv])
        torch.testing.assert_close(value, want, rtol=RESHARD_RTOL, atol=1e-7)


def test_it_learns(tmp_path: Path) -> None:
    # One process, a tiny model: the loss falls below 60% of its first value within 200 steps.
    log = tmp_path / "loss.jsonl"
    _ok(_run([sys.executable, str(SCRIPT), "--layers", "2", "--width", "64", "--context", "16",
              "--batch", "64", "--chunks", "2", "--steps", "200", "--warmup", "10",
              "--lr", "3e-3", "--loss-log", str(log), "--no-progress"], timeout=300))  # fmt: skip
    losses = _losses(log)
    first = losses[1]
    assert min(losses.values()) < 0.6 * first, (first, min(losses.values()))


def test_other_schedules_bf16_and_clipping_run(tmp_path: Path) -> None:
    for schedule in ("zbv", "interleaved", "zero_bubble"):
        result = _run(
            [
                sys.executable,
                str(SCRIPT),
                *SMALL[:-7],
                "--steps",
                "2",
                "--schedule",
                schedule,
                "--bf16",
                "--clip",
                "0.5",
                "--no-progress",
            ]
        )
        _ok(result)
        assert "final validation loss" in result.stdout


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_half_written_checkpoint_is_never_resumed(tmp_path: Path) -> None:
    example = _example()
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / ".metadata").write_text("")
    (tmp_path / "step-8.tmp").mkdir()  # a run killed mid-save leaves this
    (tmp_path / "step-8.tmp" / ".metadata").write_text("")
    (tmp_path / "step-12").mkdir()  # no .metadata: not written by DCP to the end
    assert example.latest_checkpoint(tmp_path) == (4, tmp_path / "step-4")
    assert example.latest_checkpoint(tmp_path / "none") is None


def test_the_data_and_the_learning_rate_depend_on_the_step_alone() -> None:
    example = _example()
    corpus = example.Corpus()
    x1, y1 = corpus.batch(7, 4, 16, seed=0)
    x2, y2 = corpus.batch(7, 4, 16, seed=0)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next characters
    assert not torch.equal(x1, corpus.batch(8, 4, 16, seed=0)[0])
    assert example.lr_factor(0, 10, 100) == pytest.approx(0.1)
    assert example.lr_factor(10, 10, 100) == pytest.approx(1.0)
    assert example.lr_factor(100, 10, 100) == pytest.approx(0.1)
