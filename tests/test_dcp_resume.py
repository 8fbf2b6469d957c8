"""DCP checkpoints resume exactly, with the guide's plain get_state_dict(pipe, optimizer) and
with flatten_optimizer_state_dict: AdamW in two param groups of their own settings, a weight
tied across ranks, saved at pp=2 (or by the plain model), loaded into each layout the guide
promises; one more step there equals the third step of a run never interrupted."""

from __future__ import annotations

import warnings
from pathlib import Path

import dcp_cases
import pytest
from cluster import Cluster, values

FORMS = pytest.mark.parametrize("flat", [False, True], ids=["default", "flatten"])
Snapshot = dcp_cases.Snapshot


@pytest.fixture(scope="module")
def uninterrupted() -> Snapshot:
    """The plain model after SAVED_AFTER + 1 steps."""
    return dcp_cases.uninterrupted()


@pytest.fixture(scope="module")
def by_pp2(two: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, str]:
    """A checkpoint of each form, saved at pp=2 with balance [4, 4] (the tie across ranks)."""
    paths = {}
    for flat in (False, True):
        paths[flat] = str(tmp_path_factory.mktemp("dcp") / "pp2")
        values(two.run("dcp_cases.saved_by_pp2", path=paths[flat], flat=flat, balance=[4, 4]))
    return paths


@FORMS
@pytest.mark.parametrize(
    ("pp", "balance"),
    [(2, [4, 4]), (2, [6, 2]), (1, [3, 5])],
    ids=["same layout", "the tie on one rank", "pp=1 by dp=2"],
)
def test_resumes_at_pp2_or_dp2(
    two: Cluster, by_pp2: dict[bool, str], uninterrupted: Snapshot, flat: bool, pp: int,
    balance: list[int],
) -> None:  # fmt: skip
    replies = values(two.run("dcp_cases.resumed", path=by_pp2[flat], flat=flat, pp=pp,
                             balance=balance))  # fmt: skip
    dcp_cases.assert_resumed(replies, uninterrupted)


@FORMS
@pytest.mark.parametrize("pipe", [True, False], ids=["pipe of one process", "plain model"])
def test_resumes_in_one_process(
    by_pp2: dict[bool, str], uninterrupted: Snapshot, flat: bool, pipe: bool
) -> None:
    resumed = dcp_cases.resumed_in_one_process(by_pp2[flat], flat, pipe)
    dcp_cases.assert_resumed([resumed], uninterrupted)


@FORMS
def test_a_checkpoint_of_the_plain_model_resumes_at_pp2(
    two: Cluster, tmp_path: Path, uninterrupted: Snapshot, flat: bool
) -> None:
    net = dcp_cases.model(seed=0)
    opt = dcp_cases.optimizer(net)
    dcp_cases.train(net, opt, dcp_cases.plain_step, range(dcp_cases.SAVED_AFTER))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group here: DCP says it saves alone
        dcp_cases.save(net, opt, str(tmp_path / "plain"), flat)
    replies = values(two.run("dcp_cases.resumed", path=str(tmp_path / "plain"), flat=flat,
                             pp=2, balance=[4, 4]))  # fmt: skip
    dcp_cases.assert_resumed(replies, uninterrupted)


def test_groups_that_differ_between_ranks_need_the_flatten_option(two: Cluster) -> None:
    for reply in two.run("dcp_cases.groups_differ", flat=False):
        assert reply.error_type == "ValueError", reply
        assert "param group 0 has lr=0.01 on rank 0 and lr=0.011 on rank 1" in reply.error
        assert "flatten_optimizer_state_dict=True" in reply.error
    for keys in values(two.run("dcp_cases.groups_differ", flat=True)):
        assert "param_groups.0.weight.lr" in keys


def test_a_parameter_in_no_loaded_param_group_is_named(two: Cluster) -> None:
    # Left without its group's lr, it would fail at the next step (or, in a group of the
    # same keys, silently take another group's settings).
    replies = two.run("dcp_cases.load_without", left_out="6.bias")
    assert not replies[0].failed, replies[0]  # rank 0 holds layers 0-3 only
    assert replies[1].error_type == "ValueError", replies[1]
    assert "'6.bias' in none of its param_groups" in replies[1].error
