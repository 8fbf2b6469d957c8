"""Default split points from a transformers model's pipeline plan (`_pp_plan`): among the
blocks of its ModuleLists, balanced by parameters, named from the model given (a PEFT
wrapper's prefix included); none without a plan."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import trainer_cases as cases

from gpipe_fast.integrations.transformers.split import plan_blocks, plan_split_points


def test_llama_splits_among_its_plans_layers() -> None:
    llama = cases.model("llama")
    assert plan_blocks(llama) == [f"model.layers.{i}" for i in range(4)]
    assert plan_split_points(llama, 2) == ["model.layers.2"]
    assert plan_split_points(llama, 4) == ["model.layers.1", "model.layers.2", "model.layers.3"]
    assert plan_split_points(llama, 1) == []
    assert plan_split_points(llama, 5) is None  # more stages than blocks: gf.pipeline says why


def test_the_embedding_and_head_weigh_with_the_first_and_last_blocks() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    # A vocabulary much larger than a layer: the first and last stages get fewer layers.
    config = LlamaConfig(
        vocab_size=4096, hidden_size=16, intermediate_size=32, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert plan_split_points(model, 3) == ["model.layers.1", "model.layers.7"]


def test_a_model_without_a_plan_gets_none() -> None:
    assert plan_blocks(cases.model("gpt2")) == []
    assert plan_split_points(cases.model("gpt2"), 2) is None


def test_a_peft_wrapper_names_the_blocks_from_itself() -> None:
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(cases.model("llama"),
                               peft.LoraConfig(r=2, target_modules=["q_proj"]))  # fmt: skip
    assert plan_split_points(lora, 2) == ["base_model.model.model.layers.2"]
