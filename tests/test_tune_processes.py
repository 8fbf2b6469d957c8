"""schedule/chunks/checkpoint "auto" across two processes: one choice on every rank, the cells
kept (at a train_step) or moved with their values (at pipe.tune), nothing of the model moved."""

from __future__ import annotations

import pytest
from cluster import Cluster, values

CASES = "tune_cases"


def test_every_rank_tunes_at_the_first_step_and_agrees(two: Cluster) -> None:
    replies = values(two.run(f"{CASES}.first_step_tunes", timeout_s=300.0))
    assert replies[0]["choice"] == replies[1]["choice"]
    assert replies[0]["measured"] == replies[1]["measured"]
    assert replies[0]["seconds"] == replies[1]["seconds"]  # the slowest rank's, agreed
    for reply in replies:
        # At a train_step the cells stay where they are (the optimizer holds them).
        assert (reply["layers"], reply["balance"]) == tuple(reply["before"])
        # Exact against the plain model on the micro-batches chosen (how many depends on the
        # timings: BatchNorm's statistics are each micro-batch's own).
        assert reply["error"] < 1e-12
        assert reply["signatures"] == 1


def test_a_given_chunks_stays_and_the_step_is_exact_on_its_micro_batches(two: Cluster) -> None:
    # BatchNorm normalises each micro-batch by its own rows: with two, the step differs from
    # the whole batch at once (by far), whichever schedule and checkpointing were chosen.
    replies = values(two.run(f"{CASES}.first_step_tunes", timeout_s=300.0, chunks=2))
    assert replies[0]["choice"] == replies[1]["choice"]
    for reply in replies:
        assert reply["chunks"] == 2
        assert reply["error"] < 1e-12


def test_tune_moves_layers_with_their_values_and_gradients(two: Cluster) -> None:
    replies = values(two.run(f"{CASES}.tune_moves_layers", timeout_s=300.0))
    assert replies[0]["choice"] == replies[1]["choice"]
    layers = [set(reply["layers"]) for reply in replies]
    assert layers[0].isdisjoint(layers[1]) and len(layers[0] | layers[1]) == 10
    assert any(reply["layers"] != reply["owned_before"] for reply in replies)  # layers moved
    for reply in replies:
        assert reply["values_equal"]  # from the rank that ran each layer, not this one's copy
        assert reply["grads_moved"]
        assert reply["error"] < 1e-12


@pytest.mark.parametrize(("transport", "kind"), [("", "shared memory"), ("gloo", "gloo")])
def test_a_new_signature_retunes_on_every_rank(two: Cluster, transport: str, kind: str) -> None:
    # After the first step, cell 0's rank tells its input's signature with the batch size.
    replies = values(two.run(f"{CASES}.signatures_agree", timeout_s=300.0, transport=transport))
    first, second = (reply["steps"] for reply in replies)
    assert [s["choice"] for s in first] == [s["choice"] for s in second]
    assert [s["signatures"] for s in first] == [1, 2, 2]
    assert first[0]["choice"] == first[2]["choice"]  # back to the first batch: its choice
    for step in first + second:
        assert step["transport"] == kind
        assert step["loss_error"] < 1e-6  # the step ran again on the new signature's choice
    for reply in replies:
        assert reply["untouched"]


def test_a_pp_by_dp_mesh_tunes_as_one(four: Cluster) -> None:
    replies = values(four.run(f"{CASES}.mesh_agrees", timeout_s=300.0))
    assert len({reply["choice"] for reply in replies}) == 1
    assert len({tuple(reply["seconds"]) for reply in replies}) == 1
    for reply in replies:
        assert reply["error"] < 1e-12


def test_a_step_refused_after_the_tuning_fails_on_every_rank(two: Cluster) -> None:
    replies = values(two.run(f"{CASES}.refused_after_tuning", timeout_s=300.0))
    assert replies[0]["error"] == "ValueError" and "input: rank 0" in replies[0]["message"]
    assert replies[1]["error"] == "PeerFailure"
