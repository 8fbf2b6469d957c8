"""Each CPU cell's threads: the user's setting is never overridden; else the cores shared out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gpipe_fast.device import host

CPU = torch.device("cpu")


@pytest.fixture
def unset(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No OMP_NUM_THREADS, 8 cores, and the caller's thread count restored afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(host, "cpu_cores", lambda: 8)
    before = torch.get_num_threads()
    monkeypatch.setattr(host, "_IMPORT_THREADS", before)
    monkeypatch.setattr(host, "_SHARED_THREADS", None)
    yield
    torch.set_num_threads(before)


def test_the_cores_are_shared_by_the_cells(unset: None) -> None:
    threads = host.threads_per_cell([CPU] * 4)
    assert threads.per_cell == 2
    assert threads.reason == "8 cores shared by 4 CPU cells"


def test_the_cores_are_shared_by_the_hosts_processes(unset: None) -> None:
    threads = host.threads_per_cell([CPU, CPU], processes=2, one_worker=True)
    assert threads.per_cell == 4  # one worker per process
    assert threads.reason == "8 cores shared by 2 processes of this job on this host"
    replicas = host.threads_per_cell([CPU, CPU], processes=2)  # dp alone: a worker per cell
    assert replicas.per_cell == 2
    assert "2 processes of this job on this host x 2 CPU cells" in replicas.reason


def test_an_explicit_count_wins(unset: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = host.threads_per_cell([CPU] * 2, given=3)
    assert threads == host.Threads(3, "threads_per_cell=3, as given")


def test_omp_num_threads_is_kept(unset: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = host.threads_per_cell([CPU] * 2, processes=2, one_worker=True)
    assert threads.per_cell is None and "OMP_NUM_THREADS=1" in threads.reason


def test_torch_set_num_threads_is_kept(unset: None) -> None:
    torch.set_num_threads(1 if torch.get_num_threads() != 1 else 2)
    threads = host.threads_per_cell([CPU] * 2, processes=2, one_worker=True)
    assert threads.per_cell is None
    assert f"torch.set_num_threads({torch.get_num_threads()}) was called" in threads.reason


def test_cuda_cells_keep_torchs_setting(unset: None) -> None:
    assert host.threads_per_cell([torch.device("cuda", 0)]).per_cell is None


def test_the_callers_threads_get_the_processes_share_when_nothing_is_set(unset: None) -> None:
    threads = host.threads_per_cell([CPU, CPU], processes=2, one_worker=True)
    shared = host.share_with_caller(threads, processes=2)
    assert torch.get_num_threads() == 4
    assert shared.per_cell == 4
    assert shared.reason.endswith("this process's own threads too (torch.set_num_threads(4))")
    # That count is the pipe's, not the user's: the next pipe shares the cores again.
    assert host.user_threads(None) is None


def test_the_callers_threads_are_left_alone_when_set_or_alone(
    unset: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = torch.get_num_threads()
    one = host.threads_per_cell([CPU], processes=1)
    assert host.share_with_caller(one, processes=1) == one  # one process: PyTorch's default
    assert torch.get_num_threads() == before
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    kept = host.threads_per_cell([CPU, CPU], processes=2, one_worker=True)
    assert host.share_with_caller(kept, processes=2) == kept
    assert torch.get_num_threads() == before


def test_intra_op_threads_are_restored() -> None:
    before = torch.get_num_threads()
    with host.intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with host.intra_op_threads(None):
        assert torch.get_num_threads() == before
