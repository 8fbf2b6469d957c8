"""Models built on the meta device: every tensor gets its layer's initialisation, or init_fn's,
or a load; a tensor that none reached is named, and the pipe refuses to run until it is set."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import gpt
import meta_cases
import pytest
import torch
from torch import nn

from gpipe_fast.nn.materialize import materialize


class Scale(nn.Module):
    """A layer initialised in __init__ only (no reset_parameters)."""

    def __init__(self, size: int = 1000) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((size,), 0.5))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.w


def _meta_scale_model() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(1000, 1000), Scale())


def _build_quietly(make_pipe: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_pipe(*args, **kwargs)


def test_a_layer_without_reset_parameters_is_named_and_the_pipe_refuses(make_pipe: Any) -> None:
    with pytest.warns(UserWarning, match=r"1\.w \(Scale\).*init_fn"):
        pipe = make_pipe(_meta_scale_model(), balance=[1, 1], devices=["cpu"] * 2)
    x = torch.randn(2, 1000)
    with pytest.raises(RuntimeError, match=r"1\.w \(Scale\).*init_fn"):
        pipe(x)
    with pytest.raises(RuntimeError, match=r"hold no values yet"):
        pipe.train_step(x, torch.randn(2, 1000), nn.functional.mse_loss)
    # The Linear has a reset_parameters of its own: its weights are real and in its bounds.
    weight = pipe[0].weight
    assert not weight.isnan().any()
    assert 0 < weight.abs().max() <= 1000**-0.5


def test_init_fn_reaches_every_module(make_pipe: Any) -> None:
    def init_fn(module: nn.Module) -> None:
        if isinstance(module, Scale):
            nn.init.constant_(module.w, 0.5)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: everything was initialised
        pipe = make_pipe(_meta_scale_model(), [1, 1], devices=["cpu"] * 2, init_fn=init_fn)
    assert torch.equal(pipe[1].w, torch.full((1000,), 0.5))
    x = torch.randn(3, 1000)
    reference = nn.Sequential(nn.Linear(1000, 1000), Scale())
    reference.load_state_dict(pipe.state_dict())
    torch.testing.assert_close(pipe(x), reference(x))


@pytest.mark.parametrize("how", ["load the tensor", "load the model", "set by hand"])
def test_a_load_or_a_value_set_by_hand_lets_the_pipe_run(make_pipe: Any, how: str) -> None:
    pipe = _build_quietly(make_pipe, _meta_scale_model(), [1, 1], devices=["cpu"] * 2)
    if how == "load the tensor":
        pipe.load_state_dict({"1.w": torch.full((1000,), 0.25)}, strict=False)
    elif how == "load the model":
        pipe.load_state_dict(nn.Sequential(nn.Linear(1000, 1000), Scale()).state_dict())
    else:
        with torch.no_grad():
            pipe[1].w.fill_(0.25)
    x = torch.randn(2, 1000)
    assert not pipe(x).isnan().any()


def test_a_non_persistent_buffer_is_told_from_what_a_load_fills(make_pipe: Any) -> None:
    # No state dict holds a non-persistent buffer: the advice for it is init_fn (or setting
    # it), and a load of the whole model, which fills the Scale's weight, leaves it named.
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(5, 5), Scale(5), meta_cases.Frequencies()).double()

    with torch.device("meta"):
        meta = build()
    with pytest.warns(UserWarning) as caught:
        pipe = make_pipe(meta, [2, 1], devices=["cpu"] * 2)
    (warning,) = [str(w.message) for w in caught]
    assert "1.w (Scale): their layers have no reset_parameters()" in warning
    assert "the non-persistent buffers (register_buffer(..., persistent=False)) 2.freq " in warning
    pipe.load_state_dict(build().state_dict())  # strict: every key of the state dict loads
    with pytest.raises(RuntimeError) as refused:
        pipe(torch.randn(3, 5, dtype=torch.float64))
    message = str(refused.value)
    assert message.startswith("gpipe_fast: 1 tensor(s) built on the meta device hold no values")
    assert "1.w" not in message
    assert "2.freq (Frequencies): no state dict holds them, so no load can fill them" in message
    assert "init_fn=" in message


def test_init_fn_recreating_a_non_persistent_buffer_runs_exactly(make_pipe: Any) -> None:
    with torch.device("meta"):
        meta = meta_cases.model(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: init_fn filled the buffer
        pipe = make_pipe(meta, [3, 3], devices=["cpu"] * 2, chunks=3, init_fn=meta_cases.refill)
    plain = meta_cases.model(1)
    pipe.load_state_dict(plain.state_dict())
    x, y = meta_cases.batch()
    want = nn.functional.mse_loss(plain(x), y)
    want.backward()
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    grads = dict(plain.named_parameters())
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-12, atol=1e-14)
    assert torch.equal(pipe[1].freq, plain[1].freq)


def test_a_transformers_models_init_weights_fills_its_rotary_buffers(make_pipe: Any) -> None:
    # The advice's example: a transformers model's own _init_weights (of a model built on
    # the meta device from the same config) re-creates the rotary embedding's inv_freq.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip

    class Rotated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(h.size(1))[None].expand(h.size(0), -1)
            cos, sin = self.rotary(h, positions)
            return h * cos + sin

    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), Rotated()).double()

    with torch.device("meta"):
        meta, model = build(), transformers.LlamaModel(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left without values
        pipe = make_pipe(meta, [1, 1], devices=["cpu"] * 2, init_fn=model._init_weights)
    plain = build()
    pipe.load_state_dict(plain.state_dict())
    assert torch.equal(pipe[1].rotary.inv_freq, plain[1].rotary.inv_freq)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), plain(x), rtol=1e-12, atol=0)


def test_a_partial_initialisation_is_caught() -> None:
    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.w[:2] = 1.0  # leaves the rest alone

    with torch.device("meta"):
        cell = nn.Sequential(Half())
    _, left = materialize(cell, torch.device("cpu"), None)
    assert [(u.name, u.module_type) for u in left] == [("0.w", "Half")]


def test_integer_buffers_count_as_initialised_only_with_an_initialisation() -> None:
    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("index", torch.arange(4))

    with torch.device("meta"):
        cell = nn.Sequential(Positions(), nn.BatchNorm1d(4))
    _, left = materialize(cell, torch.device("cpu"), None)
    # BatchNorm's num_batches_tracked is reset by its reset_parameters; the index is not.
    assert [u.name for u in left] == ["0.index"]
    _, left = materialize(cell, torch.device("cpu"), lambda module: None)
    assert left == []


def test_tensors_not_on_the_meta_device_keep_their_values() -> None:
    real = nn.Linear(3, 3)
    want = real.weight.detach().clone()
    with torch.device("meta"):
        other = nn.Linear(3, 3)
    cell, left = materialize(nn.Sequential(real, other), torch.device("cpu"), None)
    assert left == []
    assert torch.equal(cell[0].weight, want)


def test_a_parents_initialisation_runs_after_its_childrens() -> None:
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = nn.Linear(2, 2)

        def reset_parameters(self) -> None:  # overrides the child's, as in its __init__
            nn.init.ones_(self.child.weight)

    with torch.device("meta"):
        cell = nn.Sequential(Parent())
    cell, _ = materialize(cell, torch.device("cpu"), None)
    assert torch.equal(cell[0].child.weight, torch.ones(2, 2))


def test_torch_layers_with_a_private_reset_are_initialised() -> None:
    with torch.device("meta"):
        cell = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0))
    _, left = materialize(cell, torch.device("cpu"), None)
    assert left == []  # nn.MultiheadAttention's in_proj_weight: by its _reset_parameters


def test_a_gpt_on_the_meta_device_trains_exactly_with_its_init_fn(make_pipe: Any) -> None:
    with torch.device("meta"):
        model = gpt.gpt(blocks=2)
    with pytest.warns(UserWarning, match=r"1\.attn\.weight \(Conv1D\)"):
        make_pipe(copy.deepcopy(model), [2, 3], devices=["cpu"] * 2)
    pipe = make_pipe(model, [2, 3], devices=["cpu"] * 2, chunks=3, init_fn=gpt.init_weights)
    assert pipe[0].tokens.weight is pipe[4].weight  # the tie, shared on one device
    reference = gpt.gpt(blocks=2)
    reference.load_state_dict(pipe.state_dict())
    x, y = gpt.batch(6, seed=1)
    want = gpt.loss_fn(reference(x), y)
    want.backward()
    loss = pipe.train_step(x, y, gpt.loss_fn)
    torch.testing.assert_close(loss, want.detach())
    grads = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():  # the model's own names
        torch.testing.assert_close(param.grad, grads[name].grad, msg=name)


def test_init_fn_must_be_callable(make_pipe: Any) -> None:
    with pytest.raises(TypeError, match="init_fn must be callable"):
        make_pipe(nn.Sequential(nn.Linear(2, 2)), [1], devices=["cpu"], init_fn=3)
