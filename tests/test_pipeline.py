"""The caller's thread-local state reaches the workers; workers persist and are joined."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import gpipe_fast as gf


class _Record(nn.Module):
    """Records what its worker thread sees."""

    def __init__(self, log: list[dict[str, object]]) -> None:
        super().__init__()
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(
            {
                "threads": torch.get_num_threads(),
                "autocast": torch.is_autocast_enabled("cpu"),
                "grad": torch.is_grad_enabled(),
            }
        )
        return x


def test_autocast_reaches_workers(make_pipe) -> None:
    log: list[dict[str, object]] = []
    module = nn.Sequential(nn.Linear(4, 4), _Record(log), nn.Linear(4, 4))
    pipe = make_pipe(module, [2, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="never")
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(x)
        want = module(x)
    assert out.dtype == want.dtype == torch.bfloat16
    assert all(entry["autocast"] for entry in log)
    out.float().sum().backward()
    assert module[0].weight.grad is not None


def test_no_grad_reaches_workers(make_pipe) -> None:
    log: list[dict[str, object]] = []
    module = nn.Sequential(nn.Linear(4, 4), _Record(log))
    pipe = make_pipe(module, [1, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="never")
    with torch.no_grad():
        pipe(torch.randn(4, 4))
    assert log and not any(entry["grad"] for entry in log)
    log.clear()
    pipe(torch.randn(4, 4))
    assert log and all(entry["grad"] for entry in log)


def test_each_cpu_cell_gets_its_share_of_cores(make_pipe) -> None:
    log: list[dict[str, object]] = []
    pipe = make_pipe(nn.Sequential(_Record(log), _Record(log)), [1, 1], devices=["cpu", "cpu"])
    cores = len(os.sched_getaffinity(0))
    want = None if os.environ.get("OMP_NUM_THREADS") else max(1, cores // 2)
    assert pipe.threads_per_cell == want
    before = torch.get_num_threads()
    pipe(torch.randn(2, 3))
    if want is not None:
        assert [entry["threads"] for entry in log] == [want, want]
    assert torch.get_num_threads() == before  # the caller's own setting is untouched


def test_workers_persist_across_steps_and_close_joins_them(make_pipe) -> None:
    # By thread id, not by count: a thread of another test's objects that starts or ends
    # meanwhile (the full suite's process holds many) must not read as the pipe's.
    def native_threads() -> set[str]:
        return set(os.listdir("/proc/self/task"))

    before = native_threads()
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    pipe = make_pipe(module, [1, 1, 1], devices=["cpu"] * 3, chunks=4)
    pipe(torch.randn(8, 4)).sum().backward()
    started = native_threads() - before
    assert len(started) >= 3  # a worker per cell at least
    for _ in range(30):
        pipe(torch.randn(8, 4)).sum().backward()
    now = native_threads()
    assert started <= now  # the same workers, step after step
    assert len(now - before - started) < 3  # and none kept per step (30 steps)
    pipe.close()
    assert len(started & native_threads()) <= len(started) - 3  # the 3 workers joined


def test_interpreter_exits_with_live_pipes(tmp_path) -> None:
    # Pipes never closed, one with a finished step and one mid-graph (backward never run):
    # the interpreter must still exit at once and cleanly.
    script = textwrap.dedent(
        """
        import torch
        from torch import nn
        import gpipe_fast as gf
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        pipe = gf.GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
        pipe(torch.randn(4, 4)).sum().backward()
        other = gf.GPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), [1, 1],
                         devices=["cpu", "cpu"], chunks=2)
        pending = other(torch.randn(4, 4))
        print("done")
        """
    )
    # From an empty folder, so the installed package is imported, not the source tree.
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"


def test_copying_a_pipe_is_a_clear_type_error(make_pipe) -> None:
    import copy
    import pickle

    import pytest

    pipe = make_pipe(nn.Sequential(nn.Linear(2, 2)), [1], devices=["cpu"])
    with pytest.raises(TypeError, match="deep-copied"):
        copy.deepcopy(pipe)
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(pipe)
    assert isinstance(pipe, gf.GPipe)


class _BackwardThread(torch.autograd.Function):
    """Identity that records which thread runs its backward."""

    @staticmethod
    def forward(ctx, x, log):  # type: ignore[no-untyped-def]
        ctx.log = log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        import threading

        ctx.log.append(threading.get_ident())
        return grad, None


class _RecordBackward(nn.Module):
    def __init__(self, log: list[int]) -> None:
        super().__init__()
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BackwardThread.apply(x, self.log)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_each_cells_backward_runs_on_its_worker(make_pipe, checkpoint: str) -> None:
    import threading

    first: list[int] = []
    second: list[int] = []
    module = nn.Sequential(nn.Linear(4, 4), _RecordBackward(first), _RecordBackward(second))
    pipe = make_pipe(module, [2, 1], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint)
    pipe(torch.randn(6, 4)).sum().backward()
    assert len(first) == len(second) == 3  # one backward per micro-batch and cell
    assert len(set(first)) == 1 and len(set(second)) == 1  # each cell on one thread...
    assert set(first) != set(second)  # ...its own...
    assert threading.get_ident() not in set(first) | set(second)  # ...not the caller's


def test_missing_native_core_fails_loudly(tmp_path) -> None:
    # The package's Python files without the compiled _C: importing must fail, naming it.
    import shutil

    import gpipe_fast

    source = os.path.dirname(gpipe_fast.__file__)
    shutil.copytree(source, tmp_path / "gpipe_fast", ignore=shutil.ignore_patterns("_C*.so"))
    # -I -S: no PYTHON* variables, no current folder and no .pth files, so no editable-install
    # finder can supply the real _C behind the copy's back; the copy comes first on an explicit
    # path that keeps this interpreter's own folders (torch and the rest).
    search_path = [str(tmp_path), *(entry for entry in sys.path if entry)]
    importer = "import sys; sys.path[:0] = sys.argv[1:]; import gpipe_fast"
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", importer, *search_path],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "native core (gpipe_fast._C) is missing" in result.stderr
