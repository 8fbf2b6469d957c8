"""Skippable layers inside gf.GPipe: skips within a cell work; across cells await the runtime."""

from __future__ import annotations

import pytest
import torch
from skip_models import WIDTH, Down, Up, unet
from torch import nn

from gpipe_fast.skip import Namespace, verify_skippables

from helpers import assert_same_run, pipe_run, reference_run

NOT_WIRED = "skips across cells of a pipe: runtime not yet wired"


def _pairs_inside_cells() -> nn.Sequential:
    ns1, ns2 = Namespace(), Namespace()
    return nn.Sequential(
        Down().isolate(ns1), Up().isolate(ns1), Down().isolate(ns2), Up().isolate(ns2)
    ).double()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[4], [2, 2]])
def test_skips_inside_cells(make_pipe, balance: list[int], checkpoint: str) -> None:
    # Each stash/pop pair lies within one cell: the cell's worker thread runs both in one
    # forward (and both again in a recomputation), so the thread's own tracker suffices.
    module = _pairs_inside_cells()
    verify_skippables(module)
    x = torch.randn(7, WIDTH, dtype=torch.float64)
    want = reference_run(module, x)
    pipe = make_pipe(
        module, balance, devices=["cpu"] * len(balance), chunks=3, checkpoint=checkpoint
    )
    assert_same_run(pipe_run(pipe, module, x), want)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("balance", [[2, 3], [1, 3, 1]])
def test_skips_across_cells(make_pipe, balance: list[int], checkpoint: str) -> None:
    # Today cell k's pop finds nothing on its worker thread ("'down' has not been
    # stashed"); once the runtime installs a CellSkipTracker per (cell, micro-batch) and
    # carries layout.sends(k) on, this passes and strict=True asks to drop the marker.
    module = unet(2).double()
    x = torch.randn(7, WIDTH, dtype=torch.float64)
    want = reference_run(module, x)
    pipe = make_pipe(
        module, balance, devices=["cpu"] * len(balance), chunks=3, checkpoint=checkpoint
    )
    assert_same_run(pipe_run(pipe, module, x), want)
