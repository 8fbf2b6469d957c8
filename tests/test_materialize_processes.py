"""Models built on the meta device across processes, with a non-persistent buffer (which no
state dict holds): init_fn fills it and the pipe is exact; left unfilled, the refusing rank's
error is every rank's, not a lost batch size on the others."""

from __future__ import annotations

import meta_cases
import pytest
import torch
from cluster import Cluster, values
from torch import nn


@pytest.mark.parametrize(
    ("position", "call", "transport", "late"),
    [
        (1, "train_step", "shared memory", None),
        (4, "eval_step", "shared memory", None),
        (1, "pipe(x)", "shared memory", None),
        # Over gloo a refusing rank takes part in the step's first all-reduce, and so does a
        # rank that finds the refusal already reported when it starts: no rank starts a step
        # another will not run, and no all-reduce is left pending (gloo's destructor of the
        # group would wait for it for ever: a hang when the pipe is collected).
        (1, "train_step", "gloo", None),
        (1, "train_step", "gloo", 1),
        (4, "train_step", "gloo", None),
        (4, "train_step", "gloo", 0),
    ],
)
def test_a_refusing_rank_gives_every_rank_its_cause(
    two: Cluster, position: int, call: str, transport: str, late: int | None
) -> None:
    replies = values(two.run(
        "meta_cases.refused", position=position, call=call, transport=transport, late=late,
        timeout_s=60,
    ))  # fmt: skip
    two.reset()  # a failed step leaves the process group unusable (docs/processes.md)
    assert [r["transport"] for r in replies] == [transport] * 2
    refusing = 0 if position < meta_cases.BALANCE[0] else 1
    kind, message = replies[refusing]["error"]
    # The refusal tells the non-persistent buffer from what a load fills, and names init_fn.
    assert kind == "RuntimeError", message
    assert message.startswith("gpipe_fast: 1 tensor(s) built on the meta device hold no values")
    buffer = f"persistent=False)) {position}.freq (Frequencies): no state dict holds them"
    assert "the non-persistent buffers" in message and buffer in message
    assert "init_fn=" in message
    # The other rank raises the same cause, naming the refusing rank.
    assert replies[1 - refusing]["error"] == (
        "PeerFailure", f"gpipe_fast: the step failed on rank {refusing}: RuntimeError: {message}"
    )  # fmt: skip


@pytest.mark.parametrize(("position", "schedule"), [(1, "1f1b"), (4, "gpipe")])
def test_init_fn_fills_the_buffer_and_the_pipe_is_exact(
    two: Cluster, position: int, schedule: str
) -> None:
    results = values(two.run("meta_cases.filled", position=position, schedule=schedule))
    plain = meta_cases.model(position)
    loss = nn.functional.mse_loss(plain(meta_cases.batch()[0]), meta_cases.batch()[1])
    loss.backward()
    named = dict(plain.named_parameters())
    seen: set[str] = set()
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(loss.item(), rel=1e-12, abs=0), rank
        for name, grad in result["grads"].items():
            got = torch.tensor(grad, dtype=torch.float64)
            torch.testing.assert_close(
                got, named[name].grad, rtol=1e-12, atol=1e-14, msg=f"rank {rank}, {name}"
            )
        seen |= set(result["grads"])
    assert seen == set(named)
    holder = results[0 if position < meta_cases.BALANCE[0] else 1]
    assert holder["buffers"] == {f"{position}.freq": plain[position].freq.tolist()}
