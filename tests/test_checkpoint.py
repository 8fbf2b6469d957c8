"""DCP checkpoints of a pipe (model and optimizer) that reshard: saved at pp=2, loaded into
another balance, pp x dp, one process and the plain model, training on as if uninterrupted."""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from typing import Any

import dcp_cases
import dist_cases
import pytest
import torch
import torch.distributed.checkpoint as dcp
from cluster import Cluster, values
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import gpipe_fast as gf

FLAT = dist_cases.FLAT


@pytest.fixture(scope="module")
def saved(two: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A checkpoint written by 2 processes (pp=2, 1f1b, balance [4, 4]: the tie across
    ranks) after two Adam steps, and the losses of the two steps that followed it."""
    path = str(tmp_path_factory.mktemp("dcp") / "step2")
    replies = values(two.run("dcp_save", path=path, pp=2, dp=1, schedule="1f1b", balance=[4, 4]))
    assert replies[0]["after"] == replies[1]["after"]
    return {"path": path, "after": replies[0]["after"], "ranks": replies}


def _plain_state_keys() -> tuple[set[str], set[str]]:
    net = dist_cases.model(4, ties=dist_cases.CHECKPOINT_TIES)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    net(torch.zeros(1, dist_cases.WIDTH, dtype=torch.float64)).sum().backward()
    opt.step()
    model_state, optim_state = get_state_dict(net, opt, options=FLAT)
    return set(model_state), set(optim_state)


def test_the_keys_are_the_plain_models(saved: dict[str, Any]) -> None:
    model_keys, optim_keys = _plain_state_keys()
    ranks = saved["ranks"]
    assert set(ranks[0]["keys"]) | set(ranks[1]["keys"]) == model_keys
    assert not set(ranks[0]["keys"]) & set(ranks[1]["keys"])  # each layer saved by one rank
    assert set(ranks[0]["optim_keys"]) | set(ranks[1]["optim_keys"]) == optim_keys
    # The tie's optimizer state under the plain model's name for it, by both ranks holding it
    assert "state.0.weight.exp_avg" in ranks[0]["optim_keys"]
    assert "state.0.weight.exp_avg" in ranks[1]["optim_keys"]


def test_resumes_at_pp2_with_another_balance_and_schedule(
    two: Cluster, saved: dict[str, Any]
) -> None:
    replies = values(two.run("dcp_load", path=saved["path"], pp=2, dp=1, schedule="gpipe",
                             balance=[2, 6]))  # fmt: skip
    for reply in replies:
        assert reply["after"] == pytest.approx(saved["after"], rel=1e-12)


def test_resumes_at_pp2_by_dp2(four: Cluster, saved: dict[str, Any]) -> None:
    replies = values(four.run("dcp_load", path=saved["path"], pp=2, dp=2, schedule="zbv",
                              balance=[2, 2, 2, 2]))  # fmt: skip
    for reply in replies:
        assert reply["after"] == pytest.approx(saved["after"], rel=1e-12)


def test_resumes_at_pp2_by_dp2_without_the_flatten_option(
    two: Cluster, four: Cluster, tmp_path: Any
) -> None:
    # Each replica gathers the param groups over its own pp_group, a subgroup of the mesh.
    path = str(tmp_path / "nested")
    values(two.run("dcp_cases.saved_by_pp2", path=path, flat=False, balance=[4, 4]))
    replies = values(four.run("dcp_cases.resumed", path=path, flat=False, pp=2, balance=[2, 6]))
    dcp_cases.assert_resumed(replies, dcp_cases.uninterrupted())


def _train_on(module: nn.Module, step: Any, opt: torch.optim.Optimizer) -> list[float]:
    losses = []
    for i in range(2, 4):
        x, y = dist_cases.batch(8, seed=300 + i)
        opt.zero_grad()
        losses.append(step(module, x, y))
        opt.step()
    return losses


def _load(module: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    model_state, optim_state = get_state_dict(module, opt, options=FLAT)
    state = {"model": model_state, "optim": optim_state}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group here: DCP says it loads alone
        dcp.load(state, checkpoint_id=path)
    set_state_dict(module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=FLAT)  # fmt: skip


def test_resumes_in_one_process(saved: dict[str, Any]) -> None:
    net = dist_cases.model(4, seed=99, ties=dist_cases.CHECKPOINT_TIES)
    pipe = gf.GPipe(net, [3, 5], devices=["cpu"] * 2, chunks=2, schedule="1f1b")
    try:
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
        _load(pipe, opt, saved["path"])
        losses = _train_on(pipe, lambda p, x, y: p.train_step(x, y, nn.functional.mse_loss)
                           .item(), opt)  # fmt: skip
    finally:
        pipe.close()
    assert losses == pytest.approx(saved["after"], rel=1e-12)


def test_resumes_in_the_plain_model(saved: dict[str, Any]) -> None:
    net = dist_cases.model(4, seed=99, ties=dist_cases.CHECKPOINT_TIES)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    _load(net, opt, saved["path"])

    def step(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = nn.functional.mse_loss(module(x), y)
        loss.backward()
        return loss.item()

    assert _train_on(net, step, opt) == pytest.approx(saved["after"], rel=1e-12)


@pytest.mark.parametrize(
    ("layers", "named"),
    [
        (nn.Sequential(nn.Linear(dist_cases.WIDTH, 3), nn.Tanh()), r"model\.0\.weight"),
        (nn.Sequential(OrderedDict(embed=nn.Linear(dist_cases.WIDTH, 5), act=nn.Tanh())),
         r"model\.embed\.(weight|bias)"),
    ],
)  # fmt: skip
def test_a_checkpoint_of_another_model_names_the_keys(
    saved: dict[str, Any], layers: nn.Sequential, named: str
) -> None:
    # A layer of another shape, or of a name the checkpoint lacks: the error names its key.
    pipe = gf.GPipe(copy.deepcopy(layers).double(), [1, 1], devices=["cpu"] * 2)
    try:
        opt = torch.optim.Adam(pipe.parameters())
        with pytest.raises(BaseException, match=named):  # DCP: a BaseException
            _load(pipe, opt, saved["path"])
    finally:
        pipe.close()


def test_get_state_dict_keys_in_one_process_are_the_plain_models() -> None:
    net = dist_cases.model(4, ties=dist_cases.CHECKPOINT_TIES)
    pipe = gf.GPipe(copy.deepcopy(net), [2, 2, 2, 2], devices=["cpu"] * 4, chunks=2)
    try:
        opt = torch.optim.Adam(pipe.parameters())
        x, y = dist_cases.batch(6, seed=1)
        pipe.train_step(x, y, nn.functional.mse_loss)
        opt.step()
        model_state, optim_state = get_state_dict(pipe, opt, options=FLAT)
        nested_model, nested_optim = get_state_dict(pipe, opt)
    finally:
        pipe.close()
    model_keys, optim_keys = _plain_state_keys()
    assert set(model_state) == model_keys and set(nested_model) == model_keys
    assert set(optim_state) == optim_keys
    assert set(nested_optim["state"]) == {k for k in model_keys if k != "4.weight"}


def test_a_rank_dying_while_saving_makes_the_others_raise(tmp_path: Any) -> None:
    cluster = Cluster(2)
    try:
        for q in cluster.requests:
            q.put(("dcp_save_dies", {"path": str(tmp_path / "ckpt"), "dying": 1}))
        (survivor,) = cluster.collect_survivors("dcp_save_dies", {0}, timeout_s=90)
        assert survivor.failed, survivor  # raised, not hung, not "saved"
        assert survivor.seconds < 60, survivor
        cluster.processes[1].join(timeout=30)
        assert cluster.processes[1].exitcode == 5
    finally:
        cluster.close()
