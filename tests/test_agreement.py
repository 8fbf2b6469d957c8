"""Construction arguments agree across the ranks at build, or every rank raises the same
ValueError naming each argument that differs and the ranks on each side; no step runs on a
disagreement, and the process group stays usable."""

from __future__ import annotations

import pytest
from agreement_cases import VARIANTS
from cluster import Cluster, values

from gpipe_fast.distributed.agreement import differences

LEAD = "gpipe_fast: the ranks built this pipe with different arguments"
# What each argument's message says, the odd rank being the last.
SAID = {
    "balance": "balance: {others} gave [2, 2], rank {odd} gave [1, 3]",
    "chunks": "chunks: {others} gave 2, rank {odd} gave 3",
    "schedule": "schedule: {others} gave 'gpipe', rank {odd} gave '1f1b'",
    "checkpoint": "checkpoint: {others} gave 'except_last', rank {odd} gave 'never'",
    "dp_shard": "dp_shard: {others} gave True, rank {odd} gave False",
    "dp_shard_sync": "dp_shard_sync: {others} gave 'per_microbatch', rank {odd} gave 'per_step'",
    "parameters": (
        "the parameters (names and shapes) of each stage: stage 0: {others} {have} 2 tensors, "
        "rank {odd} has 2; the first that differs is '0.weight' [5, 5] on {others}, "
        "'0.weight' [6, 5] on rank {odd}"
    ),
    "split_points": "split_points: {others} gave ['layers.2'], rank {odd} gave ['layers.1']",
}


def _check(said: list[dict[str, str]], arguments: list[str]) -> None:
    world = len(said)
    others = "rank 0" if world == 2 else "ranks " + ", ".join(map(str, range(world - 1)))
    have = "has" if world == 2 else "have"
    for argument in arguments:
        messages = {rank_said[argument] for rank_said in said}
        assert len(messages) == 1, f"{argument}: the ranks raised different errors: {messages}"
        (message,) = messages
        assert message.startswith(LEAD), message
        expected = SAID[argument].format(others=others, odd=world - 1, have=have)
        assert expected in message, message
    assert len({rank_said["then"] for rank_said in said}) == 1  # a step ran after, the same


def test_every_rank_of_two_names_the_argument_that_differs(two: Cluster) -> None:
    arguments = [a for a in VARIANTS if not a.startswith("dp_shard")]
    _check(values(two.run("agreement_cases.disagreeing", arguments=arguments)), arguments)


def test_every_rank_of_pp2_by_dp2_names_the_argument_that_differs(four: Cluster) -> None:
    arguments = ["dp_shard", "dp_shard_sync", "split_points"]
    _check(values(four.run("agreement_cases.disagreeing", arguments=arguments)), arguments)


def test_a_rank_that_never_builds_is_named_at_the_timeout(two: Cluster) -> None:
    try:
        waited, absent = values(two.run("agreement_cases.absent"))
    finally:
        two.reset()  # rank 0's comparison is left pending
    assert absent == "absent"
    assert waited.startswith("gpipe_fast: rank 0 waited 1 s at the pipe's build for rank 1,")


def test_the_message_names_each_difference_and_the_ranks_on_each_side() -> None:
    stage = [("0.weight", (2, 2)), ("0.bias", (2,))]
    given = [
        {"chunks": "2", "parameters": [stage, stage]},
        {"chunks": "2", "parameters": [stage, stage]},
        {"chunks": "4", "parameters": [stage, stage[:1]]},
        {"chunks": "2", "parameters": [stage]},
    ]
    assert differences(given) == (
        f"{LEAD}, which every rank must give alike: chunks: ranks 0, 1, 3 gave 2, rank 2 "
        "gave 4; the parameters (names and shapes) of each stage: stage 1: ranks 0, 1 have 2 "
        "tensors, rank 2 has 1; the first that differs is '0.bias' [2] on ranks 0, 1, none "
        "on rank 2; ranks 0, 1 have 2 stages, rank 3 has 1"
    )


@pytest.mark.parametrize("lazy", [False, True])
def test_each_stage_is_listed_by_name_and_shape(lazy: bool) -> None:
    from torch import nn

    from gpipe_fast.distributed.agreement import stage_parameters

    layer = nn.LazyLinear(3) if lazy else nn.Linear(2, 3)
    cells = [nn.Sequential(layer), nn.Sequential(nn.Tanh())]
    shape = None if lazy else (3, 2)
    assert stage_parameters(cells) == [
        [("0.weight", shape), ("0.bias", (3,) if not lazy else None)],
        [],
    ]
