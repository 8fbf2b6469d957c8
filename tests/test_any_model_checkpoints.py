"""Checkpoints of gf.pipeline pipes use the model's own keys: a DCP checkpoint saved at pp=2
resumes in the plain model, at another split and at pp x dp with the losses of a run never
interrupted (float64); the whole model's state dict loads on each rank; a model built on the
meta device gets memory for this rank's stages only, its rotary buffers right."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import any_model_cases
import any_model_checkpoint_cases as cases
from cluster import Cluster, values
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import gpipe_fast as gf

MODELS = ["llama", "gpt2"]  # GPT-2: its head tied to the embedding, across the two ranks
EXACT = 1e-12


@pytest.fixture(scope="module")
def checkpoints(two: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per model: a DCP checkpoint saved at pp=2 after SAVED_AFTER steps, and each rank's
    reply (losses, keys)."""
    saved = {}
    for model in MODELS:
        path = str(tmp_path_factory.mktemp("dcp") / model)
        saved[model] = {"path": path,
                        "ranks": values(two.run("any_model_checkpoint_cases.saved",
                                                model=model, path=path))}  # fmt: skip
    return saved


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, Any]:
    return {model: cases.uninterrupted(model) for model in MODELS}


def _assert_resumed(ranks: list[dict[str, Any]], want: dict[str, Any]) -> None:
    """The losses of the steps after the checkpoint, and every parameter (under each of its
    names, on whichever ranks hold it) with its AdamW state, as never interrupted. Errors are
    relative to each tensor's norm, floored at 1e-6 of the whole model's: GPT-2's attention
    key bias has no gradient in exact arithmetic, so its values are rounding noise."""
    floors = {part: 1e-6 * torch.stack([s[part].norm() for s in want["state"].values()]).norm()
              for part in ("param", "exp_avg", "exp_avg_sq")}  # fmt: skip
    seen = set()
    for got in ranks:
        assert got["losses"] == pytest.approx(want["losses"][cases.SAVED_AFTER :], rel=EXACT)
        for key, taken in got["state"].items():
            expected = want["state"][key]
            assert taken["step"] == expected["step"], key
            for part, floor in floors.items():
                error = (taken[part] - expected[part]).norm() / max(expected[part].norm(), floor)
                assert error < EXACT, (key, part, error.item())
            seen.add(key)
    assert seen == set(want["state"])


@pytest.mark.parametrize("model", MODELS)
def test_state_dicts_use_the_models_own_keys(
    checkpoints: dict[str, Any], uninterrupted: dict[str, Any], model: str
) -> None:
    ranks, plain = checkpoints[model]["ranks"], cases.plain_keys(model)
    for got in ranks:  # the losses before the checkpoint were the plain model's
        assert got["losses"] == pytest.approx(uninterrupted[model]["losses"][:2], rel=EXACT)
    first = {"llama": "model.layers.0.self_attn.q_proj.weight", "gpt2": "transformer.wte.weight"}
    assert first[model] in ranks[0]["state_dict"]
    assert "lm_head.weight" in ranks[1]["state_dict"]
    for got in ranks:  # pipe.state_dict() and get_state_dict(pipe, opt): this rank's keys
        assert got["model"] == got["state_dict"]
        assert set(got["state_dict"]) <= set(plain["state_dict"])
    assert set().union(*(r["state_dict"] for r in ranks)) == set(plain["state_dict"])
    # The optimizer's state is the plain optimizer's: the tied head under the embedding's name.
    assert set().union(*(r["optim"] for r in ranks)) == set(plain["optim"])
    for got in ranks:
        assert [set(group) for group in got["groups"]] == [set(g) for g in plain["groups"]]


@pytest.mark.parametrize("model", MODELS)
def test_a_pp2_checkpoint_resumes_in_the_plain_model(
    checkpoints: dict[str, Any], uninterrupted: dict[str, Any], model: str
) -> None:
    resumed = cases.resumed_plain(model, checkpoints[model]["path"])
    _assert_resumed([resumed], uninterrupted[model])


@pytest.mark.parametrize("model", MODELS)
def test_a_pp2_checkpoint_resumes_at_another_split(
    two: Cluster, checkpoints: dict[str, Any], uninterrupted: dict[str, Any], model: str
) -> None:
    blocks = {"llama": "model.layers", "gpt2": "transformer.h"}[model]
    replies = values(two.run("any_model_checkpoint_cases.resumed", model=model,
                             path=checkpoints[model]["path"], split_points=[f"{blocks}.1"],
                             pp=2))  # fmt: skip
    _assert_resumed(replies, uninterrupted[model])


def test_a_pp2_checkpoint_resumes_at_pp2_by_dp2(
    four: Cluster, checkpoints: dict[str, Any], uninterrupted: dict[str, Any], full: bool
) -> None:
    if not full:  # four more workers cost a minute on two cores; pp x dp is exact elsewhere
        pytest.skip("the long form (--full)")
    replies = values(four.run("any_model_checkpoint_cases.resumed", model="gpt2",
                              path=checkpoints["gpt2"]["path"],
                              split_points=["transformer.h.3"], pp=2))  # fmt: skip
    _assert_resumed(replies, uninterrupted["gpt2"])


def test_get_and_set_state_dict_in_one_process_again_and_again() -> None:
    # torch asks the pipe's cells which names to leave out once per key and per call.
    model = any_model_cases.llama()
    example = any_model_cases.inputs("llama", 2, 8, 0)
    pipe = gf.pipeline(model, example, ["model.layers.1"], devices=["cpu", "cpu"])
    try:
        opt = cases.optimizer(pipe)
        cases.step_pipe(pipe, opt, "llama", 0)
        for _ in range(2):
            model_state, optim_state = get_state_dict(pipe, opt)
            assert set(model_state) == set(model.state_dict())
            set_state_dict(pipe, opt, model_state_dict=model_state, optim_state_dict=optim_state)
    finally:
        pipe.close()


@pytest.mark.parametrize("model", MODELS)
def test_the_whole_models_state_dict_loads_on_each_rank(two: Cluster, model: str) -> None:
    replies = values(two.run("any_model_checkpoint_cases.loaded", model=model))
    plain = cases.plain_keys(model)["state_dict"]
    for got in replies:
        assert got["missing"] == [] and got["unexpected"] == []
        assert got["differ"] == []
        assert got["loss"] == pytest.approx(got["plain"], rel=EXACT)
    assert set().union(*(r["keys"] for r in replies)) == set(plain)
    # Only GPT-2's tied embedding is on both ranks (the head's rank holds it under the plain
    # model's first name too, so that named_parameters() says that name on every rank).
    tied = {"lm_head.weight", "transformer.wte.weight"}
    assert not set(replies[0]["keys"]) & set(replies[1]["keys"]) - tied


@pytest.mark.parametrize("load", [True, False], ids=["then loaded", "initialised only"])
def test_a_meta_built_model_gets_memory_for_this_ranks_stages_only(
    two: Cluster, load: bool
) -> None:
    replies = values(two.run("any_model_checkpoint_cases.meta_built", load=load))
    plain = cases.plain_run("llama", cases.SAVED_AFTER)
    every = set(plain["params"])
    for got in replies:
        assert got["warnings"] == []  # init_fn filled every tensor, inv_freq included
        assert set(got["on_meta"]) == every - set(got["local"])
        for key, buffer in got["buffers"].items():  # rotary inv_freq: the plain model's
            torch.testing.assert_close(buffer, plain["buffers"][key], rtol=0, atol=0)
    assert set(replies[0]["local"]) | set(replies[1]["local"]) == every
    assert "model.rotary_emb.inv_freq" in replies[0]["buffers"]
    for got in replies:
        if load:  # the plain model's weights: its losses and parameters
            assert got["losses"] == pytest.approx(plain["losses"], rel=EXACT)
            for key, param in got["params"].items():
                torch.testing.assert_close(param, plain["params"][key], rtol=EXACT, atol=1e-15)
        else:  # _init_weights' own draws: a finite loss near uniform over the vocabulary
            assert all(abs(loss - torch.log(torch.tensor(31.0)).item()) < 0.5
                       for loss in got["losses"])  # fmt: skip


def test_a_weight_with_several_names_keeps_the_plain_models_optimizer_key() -> None:
    # T5's `shared` embedding is also encoder.embed_tokens, decoder.embed_tokens and lm_head:
    # the pipe meets it first as encoder.embed_tokens, the plain model as shared.
    model = any_model_cases.t5()
    plain = any_model_cases.t5()
    pipe = gf.pipeline(model, any_model_cases.inputs("t5", 2, 8, 0),
                       any_model_cases.split_points("t5", 3), devices=["cpu"] * 3)  # fmt: skip
    try:
        opt, plain_opt = cases.optimizer(pipe), cases.optimizer(plain)
        for step in range(2):
            cases.step_pipe(pipe, opt, "t5", step)
            cases.step_plain(plain, plain_opt, "t5", step)
        model_state, optim_state = get_state_dict(pipe, opt)
        plain_model_state, plain_optim_state = get_state_dict(plain, plain_opt)
        assert set(model_state) == set(plain_model_state)
        assert set(optim_state["state"]) == set(plain_optim_state["state"])
        assert "shared.weight" in optim_state["state"]
        # The pipe's optimizer state is the plain model's, and goes back into the pipe.
        for key, state in plain_optim_state["state"].items():
            got = optim_state["state"][key]["exp_avg"]
            assert any_model_cases.relative(got, state["exp_avg"]) < EXACT, key
        fresh = cases.optimizer(pipe)
        set_state_dict(pipe, fresh, model_state_dict=model_state, optim_state_dict=optim_state)
        shared = model.shared.weight
        assert torch.equal(fresh.state[shared]["exp_avg"], opt.state[shared]["exp_avg"])
    finally:
        pipe.close()
