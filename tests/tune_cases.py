"""Each rank's part of the multi-process tests of "auto" (tests/test_tune_processes.py)."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf
from gpipe_fast.planning import measure, price, tune

ROWS = 8


def _quick() -> None:
    """Few candidates and steps: the tests check behaviour, not the choice."""
    tune.MOST_MEASURED, tune.FIRST_MEASURED, tune.CHEAP_S = 3, 2, 0.0
    measure.TIMED_STEPS, measure.MIN_TIMED_S, measure.TURN_S = 2, 0.0, 0.0
    price.PROFILE_WARMUP, price.PROFILE_REPEATS = 0, 1


def uneven() -> nn.Sequential:
    """Float64 layers of uneven cost with BatchNorm: balances differ by cost and by count."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh(),
        nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8),
    ).double()  # fmt: skip


def data(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 8, dtype=torch.float64, generator=generator)
    return x, torch.randn(rows, 8, dtype=torch.float64, generator=generator)


def _mine(rank: int, world: int, value: torch.Tensor, last: bool) -> torch.Tensor | None:
    return value if (rank == world - 1 if last else rank == 0) else None


def _report(pipe: Any) -> dict[str, Any]:
    tuning = pipe.tuning
    return {
        "choice": str(tuning.choice),
        "measured": [str(c.config) for c in tuning.measured],
        "seconds": [c.measured_s for c in tuning.measured],
        "balance": list(pipe.balance),
        "schedule": pipe.schedule,
        "chunks": pipe.chunks,
        "layers": sorted(pipe._naming.cell_of),
        "signatures": len(pipe._auto.tunings),
    }


def _plain_step(plain: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int) -> torch.Tensor:
    """The plain model's loss of the whole batch, its gradients accumulated, as a pipe of
    `chunks` micro-batches computes them: each micro-batch through the model apart, its loss
    weighted by its rows' share. BatchNorm normalises a micro-batch by its own rows'
    statistics, so the micro-batch count the tuning picked is part of what the model computes
    (with one, the whole batch at once)."""
    pieces = zip(x.tensor_split(chunks), y.tensor_split(chunks), strict=True)
    loss = sum(nn.functional.mse_loss(plain(xs), ys) * (len(xs) / len(x)) for xs, ys in pieces)
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    return loss.detach()


def _against_plain(pipe: Any, plain: nn.Module, loss: torch.Tensor, want: torch.Tensor
                   ) -> float:  # fmt: skip
    """The worst relative error of the loss and this rank's gradients against the plain
    model's (see _plain_step)."""
    worst = abs(loss.item() - want.item()) / abs(want.item())
    named = dict(plain.named_parameters())
    for name, param in pipe.named_parameters():
        expected = named[name].grad
        error = (param.grad - expected).norm() / expected.norm().clamp_min(1e-30)
        worst = max(worst, error.item())
    return worst


def first_step_tunes(rank: int, world: int, chunks: int | str = "auto") -> dict[str, Any]:
    """An "auto" pipe's first train_step: every rank tunes at once, the cells stay on their
    ranks, and the step is exact."""
    _quick()
    module = uneven()
    plain = copy.deepcopy(module)
    x, y = data()
    pipe = gf.GPipe(module, schedule="auto", chunks=chunks, checkpoint="auto",
                    pp_group=dist.group.WORLD)  # fmt: skip
    try:
        before = sorted(pipe._naming.cell_of), list(pipe.balance)
        loss = pipe.train_step(_mine(rank, world, x, False), _mine(rank, world, y, True),
                               nn.functional.mse_loss)  # fmt: skip
        want = _plain_step(plain, x, y, pipe.chunks)
        return {**_report(pipe), "before": before, "error": _against_plain(pipe, plain, loss, want)}
    finally:
        pipe.close()


def tune_moves_layers(rank: int, world: int) -> dict[str, Any]:
    """pipe.tune() before anything else may re-cut the model across ranks: each layer's
    values, running statistics and gradients come from the rank that ran it, whatever this
    rank's own copy held (here made different on purpose)."""
    _quick()
    module = uneven()
    plain = copy.deepcopy(module)
    x, y = data()
    pipe = gf.GPipe(module, schedule="auto", chunks="auto", checkpoint="auto",
                    pp_group=dist.group.WORLD)  # fmt: skip
    # Whatever runs fastest here, the choice must re-cut the model: the pipe's own balance
    # is left out of the candidates.
    candidate_cuts = price.Pricing.cuts

    def others(self: Any, *args: Any) -> list[Any]:
        return [lay for lay in candidate_cuts(self, *args) if list(lay.balance) != pipe.balance]

    price.Pricing.cuts = others  # type: ignore[method-assign]
    try:
        owned = set(pipe._naming.cell_of)
        with torch.no_grad():
            for name, layer in module.named_children():
                for index, param in enumerate(layer.parameters()):
                    if name in owned:  # the owner's gradient: known to the test
                        param.grad = torch.full_like(param, float(index + int(name)))
                    else:  # this rank's stale copy of another rank's layer
                        param.add_(10.0 + rank)
                        param.grad = torch.full_like(param, -1.0)
                for buffer in layer.buffers():
                    if name not in owned and buffer.is_floating_point():
                        buffer.add_(5.0)
        pipe.tune(_mine(rank, world, x, False), _mine(rank, world, y, True),
                  nn.functional.mse_loss, progress=False)  # fmt: skip
        values_equal = all(
            torch.equal(value, plain.state_dict()[key]) for key, value in pipe.state_dict().items()
        )
        grads_moved = all(
            torch.equal(p.grad, torch.full_like(p, float(index + int(name.split(".")[0]))))
            for name, p in pipe.named_parameters()
            for index in [_index_in_layer(module, name)]
        )
        for param in pipe.parameters():
            param.grad = None
        loss = pipe.train_step(_mine(rank, world, x, False), _mine(rank, world, y, True),
                               nn.functional.mse_loss)  # fmt: skip
        want = _plain_step(plain, x, y, pipe.chunks)
        error = _against_plain(pipe, plain, loss, want)
        return {**_report(pipe), "owned_before": sorted(owned), "values_equal": values_equal,
                "grads_moved": grads_moved, "error": error}  # fmt: skip
    finally:
        price.Pricing.cuts = candidate_cuts  # type: ignore[method-assign]
        pipe.close()


def _index_in_layer(module: nn.Sequential, name: str) -> int:
    layer, _, _ = name.partition(".")
    params = [n for n, _ in module._modules[layer].named_parameters()]  # type: ignore[union-attr]
    return params.index(name.split(".", 1)[1])


def signatures_agree(rank: int, world: int, transport: str = "") -> dict[str, Any]:
    """A new batch size retunes on every rank (only cell 0's rank sees the input, and tells
    it with the step's batch size, over the rings or, with `transport` "gloo", over the
    group); each step's loss is the plain model's; a second tune() after steps moves nothing
    of this rank's cells."""
    _quick()
    module = uneven()
    plain = copy.deepcopy(module)
    x, y = data(8)
    small_x, small_y = data(4)
    os.environ["GPIPE_FAST_TRANSPORT"] = transport  # read at each build, rebuilds too
    pipe = gf.GPipe(module, schedule="auto", chunks="auto", checkpoint="auto",
                    pp_group=dist.group.WORLD)  # fmt: skip
    steps: list[dict[str, Any]] = []
    try:
        for inputs, target in ((x, y), (small_x, small_y), (x, y)):
            mine, theirs = _mine(rank, world, inputs, False), _mine(rank, world, target, True)
            loss = pipe.train_step(mine, theirs, nn.functional.mse_loss)
            # Of the micro-batches the signature's choice runs (BatchNorm: see _plain_step).
            expected = _plain_step(plain, inputs, target, pipe.chunks)
            steps.append({**_report(pipe), "loss_error": abs(loss.item() - expected.item()),
                          "transport": pipe.transport_kind})  # fmt: skip
        values = {k: v.clone() for k, v in pipe.state_dict().items()}
        grads = [p.grad.clone() for p in pipe.parameters()]
        pipe.tune(_mine(rank, world, x, False), _mine(rank, world, y, True),
                  nn.functional.mse_loss, progress=False)  # fmt: skip
        untouched = all(torch.equal(v, values[k]) for k, v in pipe.state_dict().items()) and all(
            torch.equal(p.grad, g) for p, g in zip(pipe.parameters(), grads, strict=True)
        )
        return {"steps": steps, "untouched": untouched}
    finally:
        os.environ.pop("GPIPE_FAST_TRANSPORT")
        pipe.close()


def mesh_agrees(rank: int, world: int) -> dict[str, Any]:
    """pp x dp (2 x 2): the four ranks tune at once and agree; the step is exact over both
    replicas' batches."""
    from torch.distributed.device_mesh import init_device_mesh

    _quick()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    torch.manual_seed(0)  # no BatchNorm: the replicas' micro-batches are the whole batch's rows
    module = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)]).double()
    plain = copy.deepcopy(module)
    x, y = data(8 + 4 * dist.get_rank(dp))  # replicas with batches of their own size
    pipe = gf.GPipe(module, schedule="auto", chunks="auto", checkpoint="auto", pp_group=pp,
                    dp_group=dp)  # fmt: skip
    try:
        first, last = dist.get_rank(pp) == 0, dist.get_rank(pp) == 1
        loss = pipe.train_step(x if first else None, y if last else None, nn.functional.mse_loss)
        xs: list[Any] = [None, None]
        ys: list[Any] = [None, None]
        dist.all_gather_object(xs, x, group=dp)
        dist.all_gather_object(ys, y, group=dp)
        want = nn.functional.mse_loss(plain(torch.cat(xs)), torch.cat(ys))
        want.backward()
        return {**_report(pipe), "error": _against_plain(pipe, plain, loss, want)}
    finally:
        pipe.close()


def refused_after_tuning(rank: int, world: int) -> dict[str, Any]:
    """Over gloo (no rings), a step that cell 0's rank refuses after the tuning (no input)
    fails on every rank with its cause, none waiting: the refusing rank's agreement message
    carries a signature too, as long as its peers'."""
    _quick()
    x, y = data(8)
    os.environ["GPIPE_FAST_TRANSPORT"] = "gloo"
    pipe = gf.GPipe(uneven(), schedule="auto", chunks="auto", checkpoint="auto",
                    pp_group=dist.group.WORLD)  # fmt: skip
    try:
        pipe.train_step(_mine(rank, world, x, False), _mine(rank, world, y, True),
                        nn.functional.mse_loss)  # fmt: skip
        try:
            pipe.train_step(None, _mine(rank, world, y, True), nn.functional.mse_loss)
        except Exception as error:  # the test reads which error
            return {"error": type(error).__name__, "message": str(error)[:200]}
        return {"error": None, "message": ""}
    finally:
        os.environ.pop("GPIPE_FAST_TRANSPORT")
        pipe.close()
