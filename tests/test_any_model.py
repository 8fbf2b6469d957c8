"""gf.pipeline: unmodified transformers models (LLaMA, GPT-2 and Gemma2 with their tied heads,
Qwen2, BERT, T5) and a vision net pipelined by their own forward, exact against the plain model
in float64, in one process and across processes."""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

pytest.importorskip("transformers")

import any_model_cases as cases
from cluster import Cluster, values
from doc_blocks import run_page

import gpipe_fast as gf
from gpipe_fast import _C

# Stages per worker (0: any number; these tests give such a schedule two).
KINDS = {
    kind.name: kind.stages_per_worker or 2 for kind in _C.schedule_kinds() if not kind.registered
}
SHAPES = [(7, 8), (5, 11)]  # uneven micro-batches; the batch and the sequence length change
EXACT = 1e-12


def _check(results: list[dict[str, Any]], name: str) -> None:
    """Losses, every gradient and the parameters after the steps equal the plain model's;
    between them the processes cover every parameter, under the model's own names."""
    names: set[str] = set()
    exact = cases.TOLERANCE.get(name, EXACT)
    for rank, result in enumerate(results):
        for step, got in enumerate(result["steps"]):
            if got["loss"] is not None:
                assert got["loss"] == pytest.approx(got["plain"], rel=exact), (rank, step)
            assert got["grad_error"] < exact, (rank, step, got["grad_error"])
        assert result["param_error"] < exact, rank
        names |= set(result["names"])
    plain = cases.make_model(name)
    assert names == {key for key, _ in plain.named_parameters(remove_duplicate=False)}
    assert set().union(*(r["keys"] for r in results)) == set(plain.state_dict())


@pytest.mark.parametrize("schedule", list(KINDS))
@pytest.mark.parametrize("name", list(cases.MODELS))
def test_one_process_every_schedule_is_exact(name: str, schedule: str, full: bool) -> None:
    stages = 2 * KINDS[schedule]
    for checkpoint in ("except_last", "always", "never") if full else ("except_last",):

        def make(model: nn.Module, example: dict[str, Any], checkpoint: str = checkpoint) -> Any:
            return gf.pipeline(model, example, cases.split_points(name, stages), chunks=3,
                               devices=["cpu", "cpu"], schedule=schedule,
                               checkpoint=checkpoint)  # fmt: skip

        _check([cases.train_against_plain(name, make, SHAPES)], name)


@pytest.mark.parametrize("name", list(cases.MORE_MODELS))
def test_more_models_in_one_process_are_exact(name: str, full: bool) -> None:
    # T5 in three stages (split in its encoder and in its decoder); the others in two, and in
    # four on two workers with zbv in the long form.
    schedules = ["1f1b"] if name == "t5" or not full else ["1f1b", "zbv"]
    for schedule in schedules:
        points = cases.split_points(name, 3 if name == "t5" else 2 * KINDS[schedule])
        devices = ["cpu"] * (3 if name == "t5" else 2)
        options = {"chunks": 3, "devices": devices, "schedule": schedule}

        def make(model: nn.Module, example: dict[str, Any], points: Any = points,
                 options: Any = options) -> Any:  # fmt: skip
            return gf.pipeline(model, example, points, **options)

        _check([cases.train_against_plain(name, make, SHAPES)], name)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.parametrize("name", [*cases.MODELS, "bert"])
def test_two_processes_are_exact(two: Cluster, name: str, schedule: str) -> None:
    results = values(two.run("any_model_cases.across", model=name, schedule=schedule,
                             stages=2 * KINDS[schedule], pp=2, shapes=SHAPES))  # fmt: skip
    assert [r["transport"] for r in results] == ["shared memory"] * 2
    _check(results, name)


def test_pipeline_and_data_parallel_with_the_head_tied_across_ranks(four: Cluster) -> None:
    results = values(four.run("any_model_cases.across", model="gpt2", schedule="1f1b",
                              stages=2, pp=2, shapes=[(8, 8), (12, 6)]))  # fmt: skip
    _check(results, "gpt2")


def test_names_state_dict_and_loading_are_the_models_own() -> None:
    model = cases.llama()
    plain = copy.deepcopy(model)
    pipe = gf.pipeline(model, {"input_ids": cases.tokens(2, 8, 0)}, ["model.layers.2"])
    try:
        assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in plain.named_parameters()]
        assert set(pipe.state_dict()) == set(plain.state_dict())
        with torch.no_grad():
            for param in plain.parameters():
                param.add_(torch.randn_like(param))
        assert not pipe.load_state_dict(plain.state_dict()).missing_keys
        for key, value in pipe.state_dict().items():
            assert torch.equal(value, plain.state_dict()[key]), key
        assert pipe.split_points == ["model.layers.2"]
    finally:
        pipe.close()


def test_the_models_own_loss_and_output() -> None:
    model = cases.llama()
    plain = copy.deepcopy(model)
    ids = cases.tokens(6, 8, 1)
    example = {"input_ids": ids[:2], "labels": ids[:2], "use_cache": False}
    pipe = gf.pipeline(model, example, ["model.layers.2"], chunks=3, schedule="1f1b")
    try:
        # target None: the model computes its loss from the labels it is given.
        loss = pipe.train_step({"input_ids": ids, "labels": ids, "use_cache": False}, None,
                               lambda output, _: output.loss)  # fmt: skip
        want = plain(input_ids=ids, labels=ids).loss
        want.backward()
        # transformers computes a causal LM's loss in float32 whatever the model's dtype.
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
        grads = dict(plain.named_parameters())
        for key, param in pipe.named_parameters():
            assert cases.relative(param.grad, grads[key].grad) < 1e-5, key
        # pipe(...) returns the model's own output: labels left out, another length.
        other = cases.tokens(5, 11, 2)
        with torch.no_grad():
            output = pipe(input_ids=other, use_cache=False)
            torch.testing.assert_close(output.logits, plain(input_ids=other).logits)
        assert type(output).__name__ == "CausalLMOutputWithPast" and output.loss is None
    finally:
        pipe.close()


def test_split_points_by_parameter_count() -> None:
    model = cases.llama()
    pipe = gf.pipeline(model, {"input_ids": cases.tokens(2, 8, 0)}, num_stages=2)
    try:
        (point,) = pipe.split_points
        assert point.startswith("model.layers.")
        cells = [sum(p.numel() for p in cell.parameters()) for cell in pipe.partitions]
        assert max(cells) / min(cells) < 1.6  # the embedding and head weigh like a block
    finally:
        pipe.close()


class _SlowFirst(nn.Module):
    """Four blocks alike in parameters, the first of which takes far longer to run."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == 0 and not isinstance(x, FakeTensor):
                time.sleep(0.05)
            x = block(x)
        return x


def test_split_points_by_measured_time() -> None:
    model, x = _SlowFirst(), torch.randn(2, 4)
    by_params = gf.pipeline(model, x, num_stages=2)
    by_time = gf.pipeline(model, x, num_stages=2, split_by="time")
    try:
        assert by_params.split_points == ["blocks.2"]
        assert by_time.split_points == ["blocks.1"]  # the slow block alone
    finally:
        by_params.close()
        by_time.close()
    with pytest.raises(ValueError, match="split_by must be one of"):
        gf.pipeline(model, x, num_stages=2, split_by="flops")
    with pytest.raises(ValueError, match="split_by: it chooses split points"):
        gf.pipeline(model, x, ["blocks.1"], split_by="time")
    with torch.device("meta"):
        meta = _SlowFirst()
    with pytest.raises(ValueError, match=r"'blocks\.0\.weight' is on the meta device"):
        gf.pipeline(meta, x, num_stages=2, split_by="time")


def test_bad_split_points_are_named() -> None:
    model = cases.gpt2()
    example = {"input_ids": cases.tokens(2, 8, 0)}
    with pytest.raises(ValueError, match=r"'transformer\.h\.9' names no module.*h\.0'"):
        gf.pipeline(model, example, ["transformer.h.9"])
    with pytest.raises(ValueError, match="in the order the forward calls them"):
        gf.pipeline(model, example, ["transformer.h.3", "transformer.h.1"])
    with pytest.raises(TypeError, match=r"balance: gf\.pipeline cuts the model at split_points"):
        gf.pipeline(model, example, ["transformer.h.2"], balance=[1, 1])
    with pytest.raises(TypeError, match="not one str"):
        gf.pipeline(model, example, "transformer.h.2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="never calls 'unused'"):
        model.unused = nn.Linear(2, 2)
        gf.pipeline(model, example, ["unused"])


class _ReadsAValue(nn.Module):
    """Glue that reads a tensor's value on the host, between the stages' modules."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.read == "item":
            h = h / h.abs().max().item()
        elif self.read == "branch":
            h = h if bool(h.sum() > 0) else -h
        else:
            h = h[h > 0].reshape(1, -1)[:, :4]  # a shape that depends on values
        return self.b(h)


@pytest.mark.parametrize("read", ["item", "branch", "masked"])
def test_glue_reading_values_on_the_host_is_refused_naming_where(read: str) -> None:
    with pytest.raises(ValueError, match="reads a tensor's values on the host after 'a' returned"):
        gf.pipeline(_ReadsAValue(read), torch.randn(2, 4), ["b"])


def test_the_guide_page_example_runs() -> None:
    # tests/test_docs.py leaves this page to this test (doc_blocks.RUN_BY_OWN_TEST).
    namespace: dict[str, Any] = run_page("docs/any_model.md")
    assert namespace["pipe"].split_points == ["model.layers.2"]  # type: ignore[attr-defined]
    assert torch.isfinite(namespace["loss"])  # type: ignore[arg-type]


class _Counting(nn.Module):
    """A layer whose forward writes its own state, as BatchNorm's does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last = x
        return x


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_batch_norm_trains_exactly_and_shape_runs_leave_modules_untouched(schedule: str) -> None:
    # Every stage runs the others' modules on fake tensors for their output shapes, while
    # their own stage may be running them for real on another thread, and planning runs the
    # whole forward so: what such a run writes (BatchNorm's count of batches,
    # DeferredBatchNorm's sums, any attribute) must land in a copy, never in the model.
    torch.manual_seed(1)
    model = cases.VisionNet().double().train()
    model.blocks[3].append(_Counting())
    chunks, stages = 4, 2 * KINDS[schedule]
    x = torch.randn(8, 3, 5, 5, dtype=torch.float64)
    # The reference: the plain model on the micro-batches in turn (BatchNorm normalises each
    # by its own statistics), and the running statistics of each BatchNorm's whole
    # mini-batch of inputs, which deferred_batch_norm keeps.
    plain = copy.deepcopy(model)
    norms = {n: m for n, m in plain.named_modules() if isinstance(m, nn.BatchNorm2d)}
    running = {n: (m.running_mean.clone(), m.running_var.clone()) for n, m in norms.items()}
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in norms}
    for name, norm in norms.items():
        norm.register_forward_pre_hook(lambda _m, args, name=name: seen[name].append(args[0]))
    points = cases.split_points("vision", stages)
    pipe = gf.pipeline(model, x[:2], points, chunks=chunks, devices=["cpu", "cpu"],
                       schedule=schedule, deferred_batch_norm=True)  # fmt: skip
    try:
        for step in range(3):
            x = torch.randn(8, 3, 5, 5, dtype=torch.float64)
            y = torch.randint(0, cases.VOCAB, (8,))
            loss = pipe.train_step(x, y, cases.any_loss)
            want = sum(
                cases.any_loss(plain(xm), ym) * len(xm) / len(x)
                for xm, ym in zip(x.chunk(chunks), y.chunk(chunks), strict=True)
            )
            want.backward()
            assert loss.item() == pytest.approx(want.item(), rel=EXACT), step
            for (key, got), wanted in zip(
                model.named_parameters(), plain.parameters(), strict=True
            ):
                assert cases.relative(got.grad, wanted.grad) < EXACT, (step, key)
            for name, norm in norms.items():
                inputs = torch.cat(seen[name]).detach()
                seen[name].clear()
                mean, var = inputs.mean((0, 2, 3)), inputs.var((0, 2, 3))
                momentum = norm.momentum
                running[name] = (
                    (1 - momentum) * running[name][0] + momentum * mean,
                    (1 - momentum) * running[name][1] + momentum * var,
                )
                got_norm = model.get_submodule(name)
                assert cases.relative(got_norm.running_mean, running[name][0]) < EXACT, name
                assert cases.relative(got_norm.running_var, running[name][1]) < EXACT, name
                assert got_norm.num_batches_tracked.item() == step + 1, name
            assert model.blocks[3][-1].calls == chunks * (step + 1)  # no fake run counted
        fakes = [n for n, v in vars(model.blocks[3][-1]).items() if isinstance(v, FakeTensor)]
        assert not fakes and not any(isinstance(b, FakeTensor) for b in model.buffers())
    finally:
        pipe.close()


def test_dropout_is_replayed_when_a_stage_recomputes() -> None:
    # The same seed, the same dropout masks: recomputing a stage in backward draws again
    # exactly what its forward drew, so checkpointing changes no gradient.
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=cases.VOCAB, n_positions=32, n_embd=cases.WIDTH, n_layer=4,
                        n_head=4, resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).double().train()
    batch = {"input_ids": cases.tokens(6, 9, 0)}
    grads, losses = [], []
    for checkpoint in ("never", "always"):
        copy_ = copy.deepcopy(model)
        pipe = gf.pipeline(copy_, {"input_ids": cases.tokens(2, 9, 0)}, ["transformer.h.2"],
                           devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint)  # fmt: skip
        try:
            torch.manual_seed(7)
            losses.append(pipe.train_step(batch, batch["input_ids"], cases.any_loss).item())
            grads.append({k: p.grad.clone() for k, p in copy_.named_parameters()})
        finally:
            pipe.close()
    plain = copy.deepcopy(model).eval()  # without dropout, for contrast
    assert losses[0] != pytest.approx(cases.any_loss(plain(**batch), batch["input_ids"]).item())
    assert losses[0] == losses[1]
    for key, grad in grads[0].items():
        # Not bitwise: the tied embedding sums its two stages' gradients in either order.
        assert cases.relative(grads[1][key], grad) < EXACT, key


# -- split anywhere -----------------------------------------------------------------------------

SPLITS_ANYWHERE = {
    "the head": ["lm_head"],
    "the final norm": ["model.norm"],
    "the first layer": ["model.layers.0"],
    "inside a layer, its MLP": ["model.layers.2.mlp"],
    "inside a layer, its attention": ["model.layers.3.self_attn"],
    "everywhere at once": ["model.layers.0", "model.layers.1.mlp", "model.norm", "lm_head"],
}


@pytest.mark.parametrize("points", list(SPLITS_ANYWHERE.values()), ids=list(SPLITS_ANYWHERE))
def test_any_module_the_forward_calls_is_a_split_point(points: list[str]) -> None:
    stages = len(points) + 1

    def make(model: nn.Module, example: dict[str, Any]) -> Any:
        return gf.pipeline(model, example, points, chunks=3, devices=["cpu"] * stages,
                           schedule="1f1b")  # fmt: skip

    _check([cases.train_against_plain("llama", make, SHAPES)], "llama")


@pytest.mark.parametrize("model_name", ["bart", "opt"])
def test_a_split_at_the_first_decoder_layer_is_exact(model_name: str) -> None:
    from transformers import BartConfig, BartForConditionalGeneration, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    if model_name == "bart":
        model = BartForConditionalGeneration(BartConfig(
            vocab_size=cases.VOCAB, d_model=16, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=32, use_cache=False, dropout=0.0,
        )).double()  # fmt: skip
        point = "model.decoder.layers.0"
        batch = {"input_ids": cases.tokens(6, 9, 1), "decoder_input_ids": cases.tokens(6, 7, 2)}
    else:
        model = OPTForCausalLM(OPTConfig(
            vocab_size=cases.VOCAB, hidden_size=16, num_hidden_layers=4, num_attention_heads=4,
            ffn_dim=32, max_position_embeddings=32, word_embed_proj_dim=16, dropout=0.0,
            use_cache=False,
        )).double()  # fmt: skip
        point = "model.decoder.layers.0"
        batch = {"input_ids": cases.tokens(6, 9, 1)}
    plain = copy.deepcopy(model)
    target = batch.get("decoder_input_ids", batch["input_ids"])
    pipe = gf.pipeline(model, {k: v[:2] for k, v in batch.items()}, [point],
                       devices=["cpu", "cpu"], chunks=3)  # fmt: skip
    try:
        loss = pipe.train_step(batch, target, cases.any_loss)
        want = cases.any_loss(plain(**batch), target)
        want.backward()
        assert loss.item() == pytest.approx(want.item(), rel=EXACT)
        grads = dict(plain.named_parameters())
        # BART's shared embedding and its top-level final_logits_bias buffer: the plain names.
        names = [n for n, _ in pipe.named_parameters()]
        assert sorted(names) == sorted(grads)
        floor = 1e-6 * torch.stack([p.grad.norm() for p in grads.values()]).norm().item()
        for name, param in pipe.named_parameters():
            assert cases.relative(param.grad, grads[name].grad, floor) < EXACT, name
        assert set(pipe.state_dict()) == set(plain.state_dict())
    finally:
        pipe.close()


# -- errors that say where ---------------------------------------------------------------------


def test_zbv_with_devices_its_stages_leave_unused_says_so() -> None:
    model = cases.llama()
    example = {"input_ids": cases.tokens(2, 8, 0)}
    with pytest.warns(UserWarning, match=r"zbv schedule runs 2 stages per device, so 2 stages "
                      r"use 1 of the 2 devices given \(\[.cpu.\]\)"):  # fmt: skip
        pipe = gf.pipeline(model, example, ["model.layers.2"], devices=["cpu", "cpu"],
                           schedule="zbv")  # fmt: skip
    pipe.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = gf.pipeline(model, example, ["model.layers.2"], devices=["cpu"], schedule="zbv")
    pipe.close()


def test_a_kv_cache_in_the_output_is_refused_with_the_use_cache_advice() -> None:
    model = cases.llama()
    assert model.config.use_cache
    pipe = gf.pipeline(model, {"input_ids": cases.tokens(2, 8, 0)}, ["model.layers.2"],
                       devices=["cpu", "cpu"], chunks=2)  # fmt: skip
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=r"DynamicCache.*use_cache=False"):
            pipe(input_ids=cases.tokens(4, 8, 1))
    finally:
        pipe.close()


def names_across(rank: int, world: int, *, model: str) -> list[str]:
    """A Cluster case: this rank's named_parameters() at pp=2 (GPT-2 or OPT, whose head is
    tied to the embedding of the other rank)."""
    from dist_cases import groups
    from transformers import OPTConfig, OPTForCausalLM

    pp_group, _, _ = groups(2, 1)
    if model == "opt":
        net = OPTForCausalLM(OPTConfig(
            vocab_size=cases.VOCAB, hidden_size=16, num_hidden_layers=4, num_attention_heads=4,
            ffn_dim=32, max_position_embeddings=32, word_embed_proj_dim=16, use_cache=False,
        ))  # fmt: skip
        point = "model.decoder.layers.2"
    else:
        net, point = cases.gpt2(), "transformer.h.2"
    pipe = gf.pipeline(net, {"input_ids": cases.tokens(2, 8, 0)}, [point], pp_group=pp_group,
                       timeout=60)  # fmt: skip
    try:
        return [name for name, _ in pipe.named_parameters()]
    finally:
        pipe.close()


@pytest.mark.parametrize("model", ["gpt2", "opt"])
def test_every_rank_names_a_tied_parameter_as_the_plain_model(two: Cluster, model: str) -> None:
    ranks = values(two.run("test_any_model.names_across", model=model))
    embedding = {"gpt2": "transformer.wte.weight", "opt": "model.decoder.embed_tokens.weight"}
    for names in ranks:  # the head's rank holds the embedding only as the tied head
        assert embedding[model] in names and "lm_head.weight" not in names
    assert len(ranks[0]) + len(ranks[1]) == len(set(ranks[0]) | set(ranks[1])) + 1


def refused_everywhere(rank: int, world: int) -> str:
    """A Cluster case: OPT at pp2 x dp2 with zbv and dp_shard, whose tied embedding and head
    fall on one process of each pipeline: the refusal (every rank's)."""
    from dist_cases import groups
    from transformers import OPTConfig, OPTForCausalLM

    pp_group, dp_group, _ = groups(2, 2)
    net = OPTForCausalLM(OPTConfig(
        vocab_size=cases.VOCAB, hidden_size=16, num_hidden_layers=4, num_attention_heads=4,
        ffn_dim=32, max_position_embeddings=32, word_embed_proj_dim=16, use_cache=False,
    ))  # fmt: skip
    points = [f"model.decoder.layers.{i}" for i in (1, 2, 3)]
    try:
        gf.pipeline(net, {"input_ids": cases.tokens(2, 8, 0)}, points, schedule="zbv",
                    pp_group=pp_group, dp_group=dp_group, dp_shard=True, timeout=30)  # fmt: skip
    except ValueError as error:
        return str(error)
    return "built"


def test_a_refusal_at_build_is_every_ranks_with_the_models_names(four: Cluster) -> None:
    messages = values(four.run("test_any_model.refused_everywhere"))
    assert len(set(messages)) == 1, messages
    (message,) = set(messages)
    assert message.startswith("dp_shard: a weight tied between two cells of one process")
    assert "model.decoder.embed_tokens.weight" in message and "stage0" not in message
