"""Parameters shared by cells (a tied embedding and head): exact gradients in one process, the
user's parameter holding the sum; the helpers that find and re-tie them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from dist_cases import tied_model, tokens
from torch import nn

from gpipe_fast.nn.tied import find_ties, retie


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, target)


def test_find_ties_names_each_cell_holding_a_parameter() -> None:
    model = tied_model()
    cells = [model[0:1], model[1:3], model[3:4]]
    (tie,) = find_ties(cells)
    assert tie.places == [(0, "0.weight"), (2, "3.weight")]
    assert tie.cells == [0, 2]
    assert find_ties([model[1:3]]) == []


def test_retie_shares_again_after_materialising() -> None:
    with torch.device("meta"):
        model = tied_model()
    cells = [model[0:1], model[3:4]]
    ties = find_ties(cells)
    cells = [cell.to_empty(device="cpu") for cell in cells]  # each gets tensors of its own
    assert cells[0][0].weight is not cells[1][0].weight
    retie(cells, ties, [True, True])
    assert cells[0][0].weight is cells[1][0].weight


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble", "interleaved", "zbv"])
def test_tied_embedding_and_head_on_different_cells(make_pipe: Any, schedule: str) -> None:
    model = tied_model()
    reference = copy.deepcopy(model)
    x, y = tokens(12)
    want = loss_fn(reference(x), y)
    want.backward()
    devices = ["cpu"] * (2 if schedule in ("interleaved", "zbv") else 4)
    pipe = make_pipe(model, [1, 1, 1, 1], devices=devices, chunks=3, schedule=schedule)
    loss = pipe.train_step(x, y, loss_fn)
    torch.testing.assert_close(loss, want.detach())
    # The user's own parameter holds the gradient of both uses.
    assert model[0].weight is model[3].weight
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)
    torch.testing.assert_close(model[1].weight.grad, reference[1].weight.grad)


def test_tied_parameter_through_pipe_call_and_backward(make_pipe: Any) -> None:
    model = tied_model()
    reference = copy.deepcopy(model)
    x, y = tokens(8)
    loss_fn(reference(x), y).backward()
    pipe = make_pipe(model, [1, 2, 1], devices=["cpu"] * 3, chunks=4)
    loss_fn(pipe(x), y).backward()
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)
    assert sorted(pipe.state_dict()) == sorted(reference.state_dict())


def test_shared_buffers_are_still_refused(make_pipe: Any) -> None:
    norm = nn.BatchNorm1d(4)
    other = nn.BatchNorm1d(4)
    other.running_mean = norm.running_mean
    with pytest.raises(ValueError, match=r"buffer '1.running_mean' of cell 1 is shared"):
        make_pipe(nn.Sequential(norm, other), [1, 1], devices=["cpu"] * 2)
