"""Pretrained directories read and written per rank: a model built on the meta device takes
each rank's tensors from a save_pretrained directory (ties across ranks included); a pipe's
model saved by every rank loads with from_pretrained, in one file or sharded with an index;
a PEFT adapter trained at pp=2 is saved whole."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import trainer_cases as cases
from cluster import Cluster, values

import gpipe_fast as gf
from gpipe_fast.integrations.transformers import load_pretrained, save_pretrained


def cpu_pipe(net: torch.nn.Module, **kwargs: object) -> gf.ModelPipe:
    ids = torch.randint(1, cases.VOCAB, (2, cases.LENGTH))
    return gf.pipeline(net, {"input_ids": ids, "labels": ids}, devices=["cpu", "cpu"], chunks=2,
                       **kwargs)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pretrained_weights_load_into_a_model_built_on_meta(family: str, two: Cluster,
                                                            tmp_path: Path) -> None:  # fmt: skip
    saved = cases.model(family)
    saved.save_pretrained(tmp_path)
    reference = saved.state_dict()
    ranks = values(two.run("trainer_cases.pretrained_into_meta", family=family,
                           folder=str(tmp_path)))  # fmt: skip
    for index, rank in enumerate(ranks):
        assert rank["missing"] == []
        for key, tensor in rank["state"].items():
            assert torch.equal(tensor, reference[key]), key
        # Each rank holds its stages only: the other stages' parameters never left meta. The
        # one exception: the rank of GPT-2's head holds the tied weight under the plain
        # model's first name too (the embedding's), whose module there is another stage's.
        tied = {"transformer.wte.weight"} if family == "gpt2" and index == 1 else set()
        assert rank["meta"] and set(rank["meta"]) & set(rank["state"]) == tied
    # GPT-2's head, on the last rank, was read under the embedding's name: the only one saved.
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as saved_file:
        assert ("lm_head.weight" in saved_file.keys()) == (family == "llama")
    assert "lm_head.weight" in ranks[1]["state"]
    assert ranks[0]["loss"] == ranks[1]["loss"]


def test_a_directory_lacking_tensors_is_named(tmp_path: Path) -> None:
    net = cases.model("llama")
    state = {k: v for k, v in net.state_dict().items() if "layers.3" not in k}
    net.save_pretrained(tmp_path, state_dict=state)
    pipe = cpu_pipe(cases.model("llama"))
    with pytest.warns(UserWarning, match=r"no values for 9 tensor\(s\).*model\.layers\.3"):
        missing = load_pretrained(pipe, tmp_path)
    pipe.close()
    assert len(missing) == 9 and all("layers.3" in key for key in missing)


def test_a_folder_without_weights_is_refused(tmp_path: Path) -> None:
    pipe = cpu_pipe(cases.model("llama"))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors.*pytorch_model\.bin"):
        load_pretrained(pipe, tmp_path)
    pipe.close()


def test_one_process_writes_one_file_or_shards_with_an_index(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    net = cases.model("gpt2")
    pipe = cpu_pipe(net)
    save_pretrained(net, pipe, tmp_path / "model", max_shard_size=4000)  # ~14 files of 4 kB
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and files <= set(os.listdir(tmp_path / "model"))
    assert "lm_head.weight" not in index["weight_map"]  # tied: saved as the embedding
    save_pretrained(net, pipe, tmp_path / "model")  # again, in one file: the shards go
    assert sorted(os.listdir(tmp_path / "model")) == [
        "config.json", "generation_config.json", "model.safetensors"]  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    for key, tensor in pipe.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    pipe.close()


def test_a_lora_adapter_trained_at_pp2_is_saved_whole(two: Cluster, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    rank0 = values(two.run("trainer_cases.adapter_saved", folder=str(tmp_path)))[0]
    assert "adapter_config.json" in rank0["files"]
    assert sorted(rank0["saved"]) == sorted(rank0["trained"]) and len(rank0["saved"]) == 16
    for key, tensor in rank0["saved"].items():  # each rank's 8, as trained (float64)
        torch.testing.assert_close(tensor, rank0["trained"][key], rtol=0, atol=1e-12)


def test_nothing_warns_in_one_process(tmp_path: Path) -> None:
    net = cases.model("llama")
    pipe = cpu_pipe(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net.save_pretrained(tmp_path)  # every stage is here: the model is the trained one
    pipe.close()
