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
