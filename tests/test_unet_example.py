"""examples/unet.py: a conv U-Net whose skips cross cells trains through the pipe, exactly."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_fast as gf

_spec = importlib.util.spec_from_file_location(
    "unet_example", Path(__file__).resolve().parent.parent / "examples" / "unet.py"
)
assert _spec is not None and _spec.loader is not None
unet_example: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unet_example)


@pytest.mark.parametrize(("schedule", "devices"), [("1f1b", 3), ("zero_bubble", 3), ("zbv", 2)])
def test_the_pipe_computes_the_plain_unets_loss_and_gradients(
    make_pipe: Any, schedule: str, devices: int
) -> None:
    torch.manual_seed(0)
    plain = unet_example.unet().double()
    cells = 2 * devices if schedule == "zbv" else devices
    pipe = make_pipe(copy.deepcopy(plain), gf.balance_by_params(cells, plain), chunks=4,
                     devices=["cpu"] * devices, schedule=schedule)  # fmt: skip
    noisy, clean = (t.double() for t in unet_example.batch(step=7, size=10))
    want = nn.functional.mse_loss(plain(noisy), clean)
    want.backward()
    loss = pipe.train_step(noisy, clean, nn.functional.mse_loss)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=0)
    grads = pipe.state_dict(keep_vars=True)
    for name, param in plain.state_dict(keep_vars=True).items():
        if param.grad is not None:
            torch.testing.assert_close(grads[name].grad, param.grad, rtol=1e-8, atol=1e-11,
                                       msg=name)  # fmt: skip


def test_the_example_learns_and_writes_its_timeline(tmp_path: Path, capsys: Any) -> None:
    trace = tmp_path / "unet.json"
    assert unet_example.main(["--steps", "30", "--timeline", str(trace)]) == 0
    out = capsys.readouterr().out
    first, last = (float(v) for v in out.strip().splitlines()[-1].split()[1::2])
    assert last < 0.2 * first, out  # denoising the blobs: the loss falls fivefold
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("F" in str(e.get("name", "")) for e in events)


def test_the_example_across_two_processes_trains_as_in_one(tmp_path: Path, capsys: Any) -> None:
    # torchrun, one cell per process: the U-Net's skips travel between the processes, and
    # every step's loss (printed) is the one-process pipe's with the same two cells.
    example = Path(__file__).resolve().parent.parent / "examples" / "unet.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(example), "--steps", "12",
               "--timeline", str(tmp_path / "unet.json")]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                            cwd=tmp_path, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert unet_example.main(["--cells", "2", "--steps", "12"]) == 0
    alone = capsys.readouterr().out

    def losses(out: str) -> list[str]:
        return [line for line in out.splitlines() if line.startswith(("step", "loss"))]

    assert losses(result.stdout) == losses(alone), result.stdout
    assert "2 processes" in result.stdout
    for rank in (0, 1):  # each rank's timeline holds its end of the skips' transfers
        events = json.loads((tmp_path / f"unet.rank{rank}.json").read_text())["traceEvents"]
        kinds = {e.get("cat") for e in events}
        assert ("send_skips" if rank == 0 else "recv_skips") in kinds, kinds
