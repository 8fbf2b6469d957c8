"""Mixture-of-experts models as transformers builds them through gf.pipeline: the default
experts kernel (grouped_mm) planned in float32, the auxiliary router loss
(output_router_logits) exact against the plain model on the same micro-batches, and the
kernel that reads values on the host refused, naming the kernels that work."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import gpipe_fast as gf

VOCAB = 64


def _mixtral(dtype: torch.dtype, experts: str | None, **config: Any) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    use_cache=False, num_local_experts=4, num_experts_per_tok=2,
                    router_jitter_noise=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**settings, **config)).to(dtype)
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


def _per_micro_batch(plain: nn.Module, batch: dict[str, torch.Tensor], chunks: int) -> float:
    """The plain model's loss on each micro-batch in turn, backward each (the auxiliary loss is
    not linear in the batch: a pipe, as gradient accumulation, computes it per micro-batch)."""
    total = 0.0
    columns = zip(*(v.chunk(chunks) for v in batch.values()), strict=True)
    parts = [dict(zip(batch, values, strict=True)) for values in columns]
    for part in parts:
        loss = plain(**part).loss * len(part["input_ids"]) / len(batch["input_ids"])
        loss.backward()
        total += loss.item()
    return total


def _worst(pipe: Any, plain: nn.Module) -> float:
    grads = dict(plain.named_parameters())
    return max(
        ((p.grad - grads[n].grad).norm() / grads[n].grad.norm().clamp_min(1e-30)).item()
        for n, p in pipe.named_parameters()
    )


@pytest.mark.parametrize("points", [["model.layers.2"], ["model.layers.1.mlp"]])
def test_the_auxiliary_router_loss_is_exact(points: list[str]) -> None:
    model = _mixtral(torch.float64, "batched_mm", output_router_logits=True,
                     router_aux_loss_coef=0.5)  # fmt: skip
    plain = copy.deepcopy(model)
    ids = torch.randint(2, VOCAB, (8, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    pipe = gf.pipeline(model, {k: v[:2] for k, v in batch.items()}, points,
                       devices=["cpu", "cpu"], chunks=4)  # fmt: skip
    try:
        # reduction="mean": each micro-batch's loss (its tokens' mean plus its auxiliary
        # loss) weighted by its rows, as the reference below (the model's own loss counting,
        # the default, is tests/test_model_items.py's).
        loss = pipe.train_step(batch, None, lambda out, _: out.loss, reduction="mean")
        want = _per_micro_batch(plain, batch, 4)
        # transformers computes the loss in float32 whatever the model's dtype; the gradients
        # are float64, and exact.
        assert loss.item() == pytest.approx(want, rel=1e-6)
        assert _worst(pipe, plain) < 1e-12
        assert plain(**batch).aux_loss.item() > 0  # the auxiliary loss is there to compare
    finally:
        pipe.close()


def test_the_default_loss_gives_the_router_loss_the_labels_shares_whatever_the_chunks() -> None:
    """The default reduction (the model's own loss, counted by labels) with the router loss on:
    each micro-batch's loss, its auxiliary part included, weighs its share of the labels, so
    the token part is the whole batch's mean and the auxiliary part is not added once per
    micro-batch (as num_items_in_batch would leave it: a weight growing with chunks)."""
    model = _mixtral(torch.float64, "batched_mm", output_router_logits=True,
                     router_aux_loss_coef=0.5)  # fmt: skip
    plain = copy.deepcopy(model)
    ids = torch.randint(2, VOCAB, (8, 12), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    for row, keep in enumerate([12, 3, 9, 5, 12, 2, 7, 12]):  # padding: shares differ
        labels[row, keep:] = -100
    batch = {"input_ids": ids, "labels": labels}
    counts = [(part[:, 1:] != -100).sum().item() for part in labels.chunk(4)]
    want = 0.0
    for part_ids, part_labels, count in zip(ids.chunk(4), labels.chunk(4), counts, strict=True):
        loss = plain(input_ids=part_ids, labels=part_labels).loss * count / sum(counts)
        loss.backward()
        want += loss.item()
    pipe = gf.pipeline(model, {k: v[:2] for k, v in batch.items()}, ["model.layers.2"],
                       devices=["cpu", "cpu"], chunks=4)  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # weighing is the exact way here: no warning
            loss = pipe.train_step(batch, None, lambda out, _: out.loss)
        assert loss.item() == pytest.approx(want, rel=1e-6)
        assert _worst(pipe, plain) < 1e-12
    finally:
        pipe.close()


def test_the_default_experts_kernel_is_planned_in_float32() -> None:
    model = _mixtral(torch.float32, None)
    assert model.config._experts_implementation == "grouped_mm"
    plain = copy.deepcopy(model)
    ids = torch.randint(2, VOCAB, (8, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    pipe = gf.pipeline(model, {k: v[:2] for k, v in batch.items()}, ["model.layers.2"],
                       devices=["cpu", "cpu"], chunks=4)  # fmt: skip
    try:
        loss = pipe.train_step(batch, None, lambda out, _: out.loss, reduction="mean")
        assert loss.item() == pytest.approx(_per_micro_batch(plain, batch, 4), rel=1e-5)
        assert _worst(pipe, plain) < 1e-4  # float32 rounding
    finally:
        pipe.close()


def test_experts_that_read_values_on_the_host_are_refused_naming_the_kernels_that_work() -> None:
    model = _mixtral(torch.float64, "eager")
    ids = torch.randint(2, VOCAB, (2, 12))
    with pytest.raises(ValueError, match=r"inside 'model\.layers\.0\.mlp\.experts'.*"
                       r"set_experts_implementation\('batched_mm'\)"):  # fmt: skip
        gf.pipeline(model, {"input_ids": ids}, ["model.layers.2"], devices=["cpu", "cpu"])
