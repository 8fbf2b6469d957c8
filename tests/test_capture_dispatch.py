"""capture/dispatch.py: a user's hooks on a module fire where that module runs for real, with
real tensors, once per micro-batch (again under recompute, where gf.is_recomputing() tells),
never for another stage's placeholder nor while planning; hooks that change outputs or inputs
at a stage boundary work as in the plain model; across processes, on the rank that runs it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

pytest.importorskip("transformers")

import any_model_cases as cases
from cluster import Cluster, values

import gpipe_fast as gf

CHUNKS = 4
SPLIT = ["model.layers.2"]


def _pipe(model: nn.Module, **kwargs: Any) -> Any:
    example = {"input_ids": cases.tokens(2, 8, 0), "use_cache": False}
    return gf.pipeline(model, example, SPLIT, chunks=CHUNKS, devices=["cpu", "cpu"], **kwargs)


class _Record:
    """A forward hook that keeps what it saw and whether it was a recompute."""

    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.recomputing: list[bool] = []

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.outputs.append(output)
        self.recomputing.append(gf.is_recomputing())


def test_hooks_fire_where_the_module_runs_with_real_tensors_once_per_micro_batch() -> None:
    model = cases.llama()
    first, last = _Record(), _Record()
    model.model.embed_tokens.register_forward_hook(first)  # stage 0
    model.model.layers[3].register_forward_hook(last)  # stage 1
    pipe = _pipe(model)  # planning runs the forward on fake copies: no hook fires
    try:
        assert first.outputs == [] and last.outputs == []
        batch = {"input_ids": cases.tokens(8, 8, 1)}
        pipe.train_step(batch, batch["input_ids"], cases.any_loss)
        for hook in (first, last):
            assert not any(isinstance(o, FakeTensor) for o in hook.outputs)
            # checkpoint="except_last": 4 forwards, then 3 recomputes in backward
            assert len(hook.outputs) == 2 * CHUNKS - 1
            assert sum(hook.recomputing) == CHUNKS - 1
            assert {tuple(o.shape[:1]) for o in hook.outputs} == {(2,)}
        with torch.no_grad():
            pipe(input_ids=cases.tokens(4, 8, 2))
        assert len(first.outputs) == 2 * CHUNKS - 1 + CHUNKS  # no recompute without grad
    finally:
        pipe.close()


def test_hooks_that_change_values_at_a_stage_boundary_work_as_in_the_plain_model() -> None:
    model = cases.llama()
    for net in (model,):
        net.model.layers[1].register_forward_hook(lambda m, args, out: out * 1.5)  # stage 0's last
        net.model.layers[2].register_forward_pre_hook(  # stage 1's first
            lambda m, args: (args[0] * 0.5, *args[1:])
        )
    plain = copy.deepcopy(model)
    pipe = _pipe(model)
    try:
        batch = {"input_ids": cases.tokens(8, 8, 1)}
        loss = pipe.train_step(batch, batch["input_ids"], cases.any_loss)
        want = cases.any_loss(plain(**batch), batch["input_ids"])
        want.backward()
        assert loss.item() == pytest.approx(want.item(), rel=1e-12)
        grads = dict(plain.named_parameters())
        for name, param in pipe.named_parameters():
            assert cases.relative(param.grad, grads[name].grad, 1e-6) < 1e-12, name
    finally:
        pipe.close()


def test_a_hook_reading_values_added_after_the_pipe_was_built_reads_real_ones() -> None:
    model = cases.llama()
    plain = copy.deepcopy(model)
    pipe = _pipe(model)
    norms: list[float] = []
    model.model.embed_tokens.register_forward_hook(
        lambda m, a, out: norms.append(out.norm().item())
    )
    try:
        batch = {"input_ids": cases.tokens(8, 8, 1)}
        pipe.train_step(batch, batch["input_ids"], cases.any_loss)
        want = {round(plain.model.embed_tokens(ids).norm().item(), 9)
                for ids in batch["input_ids"].split(2)}  # fmt: skip
        assert {round(n, 9) for n in norms} == want
    finally:
        pipe.close()


def hooks_across(rank: int, world: int) -> dict[str, Any]:
    """A Cluster case: hooks on one module of each stage at pp=2; what fired on this rank."""
    from dist_cases import groups

    pp_group, _, _ = groups(2, 1)
    model = cases.llama()
    first, last = _Record(), _Record()
    model.model.layers[1].register_forward_hook(first)
    model.model.layers[3].register_forward_hook(last)
    pipe = gf.pipeline(model, {"input_ids": cases.tokens(2, 8, 0)}, SPLIT, chunks=CHUNKS,
                       schedule="1f1b", pp_group=pp_group, timeout=60)  # fmt: skip
    try:
        batch = {"input_ids": cases.tokens(8, 8, 1)}
        pipe.train_step(batch, batch["input_ids"], cases.any_loss)
    finally:
        pipe.close()
    return {
        name: (len(hook.outputs), sum(hook.recomputing),
               any(isinstance(o, FakeTensor) for o in hook.outputs))
        for name, hook in (("first", first), ("last", last))
    }  # fmt: skip


def test_across_processes_hooks_fire_on_the_rank_that_runs_the_module(two: Cluster) -> None:
    ranks = values(two.run("test_capture_dispatch.hooks_across"))
    for rank, (runs, other) in enumerate([("first", "last"), ("last", "first")]):
        fired, recomputed, fake = ranks[rank][runs]
        assert fired - recomputed == CHUNKS and not fake  # as the rank's schedule recomputes
        assert ranks[rank][other] == (0, 0, False)


def test_a_hook_on_a_module_outside_a_pipe_is_the_modules_own() -> None:
    model = cases.llama()
    pipe = _pipe(model)
    seen: list[Tensor] = []
    model.model.layers[0].register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        model(input_ids=cases.tokens(2, 8, 3))  # the plain model, called by the user
        assert len(seen) == 1 and not isinstance(seen[0], FakeTensor)
    finally:
        pipe.close()


class _Spanning(nn.Module):
    """`inner` spans both stages (split at inner.1): glue, which every stage runs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(self.a(x))


def test_a_hook_reading_a_placeholder_on_a_spanning_module_is_an_error_naming_it() -> None:
    model = _Spanning().double()
    pipe = gf.pipeline(model, torch.randn(2, 4, dtype=torch.float64), ["inner.1"],
                       devices=["cpu", "cpu"], chunks=2)  # fmt: skip
    # Its input is a's output, which stage 1 holds only as a placeholder.
    model.inner.register_forward_pre_hook(lambda m, args: print(args[0].sum().item()))
    try:
        with pytest.raises(RuntimeError, match=r"on stage 1 .* reads the values of a tensor "
                           r"inside 'inner' \(its forward or a hook of it\)"):  # fmt: skip
            pipe.train_step(torch.randn(4, 4, dtype=torch.float64), None,
                            lambda out, _: out.sum())  # fmt: skip
    finally:
        pipe.close()


def test_a_hook_for_every_module_never_sees_a_fake_copy() -> None:
    seen: list[Any] = []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        seen.extend(t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, Tensor))

    model = cases.llama()
    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        pipe = _pipe(model)
        try:
            batch = {"input_ids": cases.tokens(8, 8, 1)}
            pipe.train_step(batch, batch["input_ids"], cases.any_loss)
        finally:
            pipe.close()
    finally:
        handle.remove()
    assert seen and not any(isinstance(t, FakeTensor) for t in seen)


def test_pipes_of_one_model_cut_at_different_points_each_dispatch_their_own_atoms() -> None:
    # The first pipe makes model.layers.2's MLP an atom; the second, model.layers.2 (which
    # holds that MLP): the MLP is then called inside an atom, as it is.
    model = cases.llama()
    plain = copy.deepcopy(model)
    batch = {"input_ids": cases.tokens(6, 8, 1)}
    for points in (["model.layers.2.mlp"], ["model.layers.2"], ["model.layers.2.mlp"]):
        pipe = gf.pipeline(model, {"input_ids": cases.tokens(2, 8, 0)}, points, chunks=3,
                           devices=["cpu", "cpu"])  # fmt: skip
        try:
            with torch.no_grad():
                loss = pipe.eval_step(batch, batch["input_ids"], cases.any_loss)
        finally:
            pipe.close()
        want = cases.any_loss(plain(**batch), batch["input_ids"])
        assert loss.item() == pytest.approx(want.item(), rel=1e-12), points
