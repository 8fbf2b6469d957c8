"""gf.pipeline in training and evaluation mode: pipe.train() and pipe.eval() reach the model's
own forward and glue on every stage (a glue dropout, Whisper's and BART's encoders), and
pipe.training says which; torch's evaluation fast path (nn.TransformerEncoder's nested
tensors) gives the plain model's outputs through the pipe."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gpipe_fast as gf

EXACT = 1e-12


class _GlueDropout(nn.Module):
    """A forward that reads self.training in its glue, as BART's and Whisper's encoders do."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, ids: Tensor) -> Tensor:
        h = F.dropout(self.emb(ids), p=0.5, training=self.training)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _lm_loss(out: Any, ids: Tensor) -> Tensor:
    logits = out if isinstance(out, Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def test_eval_and_train_reach_the_glue_and_pipe_training_tells_the_truth() -> None:
    torch.manual_seed(0)
    model = _GlueDropout().double()
    plain = copy.deepcopy(model).eval()
    ids = torch.randint(0, 64, (8, 12))
    pipe = gf.pipeline(model, ids[:2], ["layers.1"], devices=["cpu", "cpu"], chunks=4)
    try:
        pipe.eval()
        assert not pipe.training and not model.training
        assert not any(m.training for m in [*model.modules(), *pipe.modules()])
        with torch.inference_mode():
            want = _lm_loss(plain(ids), ids).item()
            assert pipe.eval_step(ids, ids, _lm_loss).item() == pytest.approx(want, rel=EXACT)
            torch.testing.assert_close(pipe(ids), plain(ids), rtol=EXACT, atol=EXACT)
        pipe.train()
        assert pipe.training and model.training
        with torch.no_grad():
            assert pipe.eval_step(ids, ids, _lm_loss).item() != pytest.approx(want, rel=1e-6)
        # The model's own eval() then pipe.train(): the dropout is on again.
        model.eval()
        assert not pipe.training  # the model's mode is the pipe's
        pipe.train()
        assert pipe.train_step(ids, ids, _lm_loss).item() != pytest.approx(want, rel=1e-6)
        # And the model's own eval() alone: the next step runs in evaluation mode.
        model.eval()
        with torch.no_grad():
            assert pipe.eval_step(ids, ids, _lm_loss).item() == pytest.approx(want, rel=EXACT)
    finally:
        pipe.close()


def _whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                           max_source_positions=16, max_target_positions=32, use_cache=False,
                           pad_token_id=0, decoder_start_token_id=1, eos_token_id=2,
                           bos_token_id=1, dropout=0.2)  # fmt: skip
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(config).double()


def _bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, use_cache=False, dropout=0.2,
                        max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    return BartForConditionalGeneration(config).double()


def _batch(name: str) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(3)
    decoder = torch.randint(3, 64, (8, 6), generator=generator)
    if name == "whisper":
        features = torch.randn(8, 8, 32, generator=generator, dtype=torch.float64)
        return {"input_features": features, "decoder_input_ids": decoder}
    return {"input_ids": torch.randint(3, 64, (8, 10), generator=generator),
            "decoder_input_ids": decoder}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "points"),
    [
        ("whisper", ["model.encoder.layers.1"]),
        ("whisper", ["model.encoder.layers.1", "model.decoder.layers.0", "model.decoder.layers.1"]),
        ("bart", ["model.encoder.layers.1"]),
    ],
    ids=["whisper", "whisper-4-stages", "bart"],
)
def test_an_encoders_dropout_follows_the_pipes_mode(name: str, points: list[str]) -> None:
    pytest.importorskip("transformers")
    model = {"whisper": _whisper, "bart": _bart}[name]()
    plain = copy.deepcopy(model).eval()
    batch = _batch(name)
    target = batch["decoder_input_ids"]
    example = {k: v[:2] for k, v in batch.items()}
    pipe = gf.pipeline(model, example, points, devices=["cpu"] * (len(points) + 1), chunks=4)
    try:
        pipe.eval()
        with torch.no_grad():
            got = pipe.eval_step(batch, target, _lm_loss).item()
            logits = pipe(**batch).logits
            plain_logits = plain(**batch).logits
        assert got == pytest.approx(_lm_loss(plain_logits, target).item(), rel=EXACT)
        torch.testing.assert_close(logits, plain_logits, rtol=EXACT, atol=EXACT)
        # Training in evaluation mode (dropout off): exact against the plain model.
        loss = pipe.train_step(batch, target, _lm_loss)
        want = _lm_loss(plain(**batch), target)
        want.backward()
        assert loss.item() == pytest.approx(want.item(), rel=EXACT)
        grads = dict(plain.named_parameters())
        # A key projection's bias has no gradient in exact arithmetic: rounding noise, whose
        # error is measured against the whole gradient's size.
        floor = 1e-6 * torch.stack([p.grad.norm() for p in grads.values()
                                    if p.grad is not None]).norm()  # fmt: skip
        for key, param in pipe.named_parameters():
            if grads[key].grad is not None:
                scale = torch.maximum(grads[key].grad.norm(), floor)
                assert (param.grad - grads[key].grad).norm() / scale < 1e-10, key
    finally:
        pipe.close()


class _Encoder(nn.Module):
    """nn.TransformerEncoder under a padding mask, whose evaluation fast path packs the batch
    into a nested tensor for its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=True)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: Tensor, pad: Tensor) -> Tensor:
        return self.head(self.encoder(self.emb(ids), src_key_padding_mask=pad))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # the plain model's
@pytest.mark.parametrize("point", ["encoder.layers.1", "head"])
@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode])
def test_transformer_encoder_in_evaluation_with_a_padding_mask(point: str, grad_off: Any) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (8, 10))
    pad = torch.arange(10)[None, :] >= torch.tensor([10, 7, 4, 10, 9, 3, 6, 10])[:, None]
    torch.manual_seed(0)
    model = _Encoder().double()
    plain = copy.deepcopy(model).eval()
    pipe = gf.pipeline(model, (ids[:2], pad[:2]), [point], devices=["cpu", "cpu"], chunks=4)
    try:
        pipe.eval()
        with grad_off():
            got, want = pipe(ids, pad), plain(ids, pad)
        # The fast path leaves padded positions at zero; the others are the model's.
        torch.testing.assert_close(got[~pad], want[~pad], rtol=1e-10, atol=1e-10)
    finally:
        pipe.close()


def modes_across(rank: int, world: int) -> dict[str, Any]:
    """A Cluster case: _GlueDropout at pp=2, pipe.eval() on each rank: the loss of an
    eval_step and the plain model's in evaluation mode, and pipe.training on this rank."""
    from dist_cases import groups

    pp_group, _, _ = groups(2, 1)
    torch.manual_seed(0)
    model = _GlueDropout().double()
    plain = copy.deepcopy(model).eval()
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    pipe = gf.pipeline(model, ids[:2], ["layers.1"], chunks=4, pp_group=pp_group, timeout=60)
    try:
        pipe.eval()
        with torch.no_grad():
            loss = pipe.eval_step(ids, ids, _lm_loss).item()
        return {"loss": loss, "plain": _lm_loss(plain(ids), ids).item(),
                "training": pipe.training or model.training}  # fmt: skip
    finally:
        pipe.close()


def test_eval_reaches_the_glue_on_every_rank(two: Any) -> None:
    from cluster import values

    for got in values(two.run("test_any_model_modes.modes_across")):
        assert not got["training"]
        assert got["loss"] == pytest.approx(got["plain"], rel=EXACT)
