"""Cases the cluster's workers run (tests/cluster.py): each rank's part of a multi-process test.

Every case returns plain Python data: tensors become lists, so nothing depends on shared
memory outliving the worker's reply.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import gpt
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import gpipe_fast as gf
from gpipe_fast import _C
from gpipe_fast.api.gpipe import pipeline_of

from helpers import whole

WIDTH = 5
VOCAB = 11
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def model(
    layers: int, seed: int = 0, ties: tuple[tuple[int, int], ...] = (), dropout: float = 0.0
) -> nn.Sequential:
    """Linear+Tanh layers (each followed by Dropout when asked) in float64, the same weights
    on every rank and in the test; each (i, j) of `ties` gives the Linear at module j the
    weight of the one at module i."""
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        if dropout:
            modules.append(nn.Dropout(dropout))
    for i, j in ties:
        modules[j].weight = modules[i].weight  # type: ignore[union-attr]
    return nn.Sequential(*modules).double()


def tied_model() -> nn.Sequential:
    """A language model's shape: the head's weight is the embedding's."""
    torch.manual_seed(3)
    embed = nn.Embedding(VOCAB, WIDTH + 1)
    head = nn.Linear(WIDTH + 1, VOCAB, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, nn.Linear(WIDTH + 1, WIDTH + 1), nn.Tanh(), head).double()


def tokens(size: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, VOCAB, (size,), generator=generator),
        torch.randint(0, VOCAB, (size,), generator=generator),
    )


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, target)


def batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.randn(size, WIDTH, generator=generator, dtype=torch.float64)
    return x, y


def groups(pp: int, dp: int) -> tuple[Any, Any, int]:
    """(pp_group, dp_group, this rank's replica) for a (dp, pp) mesh over the world."""
    if dp == 1:
        return dist.group.WORLD, None, 0
    if pp == 1:
        return None, dist.group.WORLD, dist.get_rank()
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    return mesh["pp"].get_group(), mesh["dp"].get_group(), mesh.get_coordinate()[0]


def shard(x: torch.Tensor, replica: int, replicas: int) -> torch.Tensor:
    """Replica r's contiguous share of the batch (the first ones one row larger)."""
    return x.tensor_split(replicas)[replica]


def grads_by_name(pipe: gf.GPipe) -> dict[str, list[Any]]:
    """This rank's gradients under the model's own keys, whole (a shard's gathered)."""
    return {
        name: whole(tensor.grad).tolist()
        for name, tensor in pipe.state_dict(keep_vars=True).items()
        if tensor.grad is not None
    }


def train(
    rank: int,
    world: int,
    *,
    schedule: str,
    layers: int,
    balance: list[int],
    chunks: int,
    checkpoint: str,
    batches: list[int],
    pp: int,
    dp: int,
    ties: tuple[tuple[int, int], ...] = (),
    clips: list[tuple[float, Any]] | None = None,
    zero_grad: bool = True,
    dtype: str = "float64",
    **options: Any,
) -> dict[str, Any]:
    """Steps of `batches` sizes (each a fresh batch); per step the loss and the gradients
    (whole), clipped by pipe.clip_grad_norm_(*clips[step]) when `clips` is given (and its
    norm); each parameter's type and local size. The model and the batches in `dtype`;
    `zero_grad=False` accumulates the gradients over the steps; `options`: more of GPipe's
    keywords (dp_shard's)."""
    pp_group, dp_group, replica = groups(pp, dp)
    net = model(layers, ties=tuple(map(tuple, ties)))  # a queue turns the pairs into lists
    net = net.to(getattr(torch, dtype))
    pipe = gf.GPipe(
        net, balance, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
        pp_group=pp_group, dp_group=dp_group, timeout=60, **options,
    )  # fmt: skip
    steps = []
    try:
        for step, size in enumerate(batches):
            x, y = batch(size, seed=100 + step)
            if zero_grad:
                pipe.zero_grad(set_to_none=True)
            xs, ys = (shard(t, replica, dp).to(getattr(torch, dtype)) for t in (x, y))
            loss = pipe.train_step(xs, ys, nn.functional.mse_loss)
            norm = pipe.clip_grad_norm_(*clips[step]).item() if clips else None
            steps.append(
                {"loss": loss.item(), "dtype": str(loss.dtype), "grads": grads_by_name(pipe),
                 "norm": norm}
            )  # fmt: skip
        local = {
            name: (type(p).__name__, p.to_local().numel() if hasattr(p, "to_local") else p.numel())
            for name, p in pipe.named_parameters()
        }
    finally:
        pipe.close()
    return {
        "steps": steps, "keys": sorted(pipe.state_dict()), "threads": pipe.threads_per_cell,
        "transport": pipe.transport_kind, "transport_reason": pipe.transport_reason,
        "local": local,
    }  # fmt: skip


def evaluate(
    rank: int,
    world: int,
    *,
    schedule: str,
    layers: int,
    balance: list[int],
    chunks: int,
    batches: list[int],
    pp: int,
    dp: int,
) -> dict[str, Any]:
    """Per batch: eval_step's loss and pipe(x)'s output under no_grad (each rank passing
    only what it needs: the input on cell 0's rank, the target on the last cell's), with
    every .grad still None; then that neither changes the gradients of a train_step, and
    what train_step under no_grad and pipe(x) with gradients raise."""
    pp_group, dp_group, replica = groups(pp, dp)
    pipe = gf.GPipe(
        model(layers), balance, chunks=chunks, checkpoint="always", schedule=schedule,
        pp_group=pp_group, dp_group=dp_group, timeout=60,
    )  # fmt: skip
    first, last = pipe.layout.is_local(0), pipe.layout.is_local(len(balance) - 1)
    steps = []
    try:
        for step, size in enumerate(batches):
            x, y = (shard(t, replica, dp) for t in batch(size, seed=100 + step))
            pipe.record_timeline(step == 0)
            loss = pipe.eval_step(x if first else None, y if last else None,
                                  nn.functional.mse_loss)  # fmt: skip
            if step == 0:
                kinds = sorted({span.kind for span in pipe.timeline().spans})
                pipe.record_timeline(False)
            with torch.no_grad():
                output = pipe(x if first else None)
            steps.append({
                "loss": loss.item(),
                "output": None if output is None else output.tolist(),
                "untouched": all(p.grad is None for p in pipe.parameters()),
            })  # fmt: skip
        x, y = (shard(t, replica, dp) for t in batch(batches[0], seed=100))
        pipe.train_step(x, y, nn.functional.mse_loss)
        trained = grads_by_name(pipe)
        pipe.eval_step(x, y, nn.functional.mse_loss)
        errors = []
        with torch.no_grad():
            errors.append(_error_of(lambda: pipe.train_step(x, y, nn.functional.mse_loss)))
        errors.append(_error_of(lambda: pipe(x)))
        after = grads_by_name(pipe)
    finally:
        pipe.close()
    return {"steps": steps, "replica": replica, "last": last, "kinds": kinds,
            "trained": trained, "after": after, "errors": errors}  # fmt: skip


def _error_of(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as error:
        return type(error).__name__, str(error)
    return "none", ""


def evaluate_modes(rank: int, world: int, *, schedule: str) -> dict[str, float]:
    """A model with dropout across 2 processes: eval_step's loss in train() mode, train_step's
    from the same seed, and eval_step's in eval() mode."""
    cells = 4 if schedule in ("interleaved", "zbv") else 2
    pipe = gf.GPipe(model(4, dropout=0.5), [12 // cells] * cells, chunks=3, schedule=schedule,
                    pp_group=dist.group.WORLD, timeout=60)  # fmt: skip
    x, y = batch(10, seed=9)
    losses = {}
    try:
        torch.manual_seed(42)
        losses["eval_step in train()"] = pipe.eval_step(x, y, nn.functional.mse_loss).item()
        losses["still training"] = float(pipe.training)
        torch.manual_seed(42)
        losses["train_step"] = pipe.train_step(x, y, nn.functional.mse_loss).item()
        pipe.eval()
        losses["eval_step in eval()"] = pipe.eval_step(x, y, nn.functional.mse_loss).item()
    finally:
        pipe.close()
    return losses


class _Fail(nn.Module):
    """On one rank, raises in the forward of micro-batch 2 (forwards run in micro-batch
    order on a stage) or, with kill, ends the process there."""

    def __init__(self, failing_rank: int, kill: bool) -> None:
        super().__init__()
        self.failing_rank = failing_rank
        self.kill = kill
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == self.failing_rank and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 3:
                if self.kill:
                    os._exit(3)
                raise KeyError(f"planted on rank {self.failing_rank}")
        return x


def _failing_pipe(world: int, failing_rank: int, kill: bool, pp: int) -> gf.GPipe:
    pp_group, dp_group, _ = groups(pp, world // pp)
    layers: list[nn.Module] = []
    for _ in range(pp):
        layers += [nn.Linear(WIDTH, WIDTH), _Fail(failing_rank, kill)]
    return gf.GPipe(nn.Sequential(*layers).double(), [2] * pp, chunks=4, schedule="1f1b",
                    pp_group=pp_group, dp_group=dp_group, timeout=20)  # fmt: skip


def fail(
    rank: int, world: int, *, failing_rank: int, kill: bool = False, pp: int = 0
) -> dict[str, Any]:
    """One rank's layer raises (or, with kill, its process dies) in a forward; the others
    must stop, not hang. With `pp`, a (world / pp) x pp mesh of data-parallel pipelines."""
    pipe = _failing_pipe(world, failing_rank, kill, pp or world)
    x, y = batch(8, seed=1)
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    finally:
        pipe.close()
    return {"finished": True}


def tied(rank: int, world: int, *, schedule: str) -> dict[str, Any]:
    """The tied language model with its embedding on rank 0 and head on rank 1: each rank's
    copy of the shared weight ends the step with the whole gradient."""
    cells = 4 if schedule in ("interleaved", "zbv") else 2
    balance = [1, 1, 1, 1] if cells == 4 else [1, 3]
    pipe = gf.GPipe(tied_model(), balance, chunks=3, schedule=schedule,
                    pp_group=dist.group.WORLD, timeout=60)  # fmt: skip
    x, y = tokens(12)
    try:
        loss = pipe.train_step(x, y, cross_entropy)
    finally:
        pipe.close()
    return {"loss": loss.item(), "grads": grads_by_name(pipe)}


def meta(rank: int, world: int) -> dict[str, Any]:
    """The model built on the meta device: each rank materialises only its own cells."""
    with torch.device("meta"):
        net = model(4)
    torch.manual_seed(10 + rank)  # ranks initialise their cells independently
    pipe = gf.GPipe(net, [4, 4], chunks=2, pp_group=dist.group.WORLD, timeout=60)
    on_meta = sorted(name for name, p in net.named_parameters() if p.is_meta)
    x, y = batch(6, seed=7)
    try:
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
    finally:
        pipe.close()
    state = {name: tensor.tolist() for name, tensor in pipe.state_dict().items()}
    return {"loss": loss.item(), "grads": grads_by_name(pipe), "state": state, "meta": on_meta}


def bad_layouts(rank: int, world: int) -> list[tuple[str, str]]:
    """Each bad layout's error (type and message), on every rank."""
    attempts = [
        # 3 cells on 2 processes
        lambda: gf.GPipe(model(3), [2, 2, 2], pp_group=dist.group.WORLD),
        # 4 cells on 2 processes without the interleaved schedule
        lambda: gf.GPipe(model(4), [2, 2, 2, 2], pp_group=dist.group.WORLD, schedule="1f1b"),
        # dp and pp the same group: they overlap in more than this process
        lambda: gf.GPipe(model(2), [2, 2], pp_group=dist.group.WORLD, dp_group=dist.group.WORLD),
        # two devices for one process
        lambda: gf.GPipe(model(2), [2, 2], pp_group=dist.group.WORLD, devices=["cpu", "meta"]),
        # a bad timeout
        lambda: gf.GPipe(model(2), [2, 2], pp_group=dist.group.WORLD, timeout=0),
    ]
    errors = []
    for attempt in attempts:
        try:
            attempt().close()
            errors.append(("none", ""))
        except Exception as error:
            errors.append((type(error).__name__, str(error)))
    return errors


def skips(
    rank: int,
    world: int,
    *,
    scenario: str,
    schedule: str,
    checkpoint: str,
    balance: list[int],
    batches: list[int],
    seed: int,
    step_seed: int | None = None,
) -> dict[str, Any]:
    """A skip_models scenario (seeded by `seed`, float64; "dropout" for skip_models.dropout)
    trained across the world's ranks: per step of `batches` sizes (fresh inputs, seeded by
    the step) the loss, this rank's gradients, and the evaluation's loss. With `step_seed`,
    every rank seeds torch with step_seed + step before each step (the pipe draws the
    step's random seed from it)."""
    from skip_models import SCENARIOS, dropout

    torch.manual_seed(seed)
    net = (dropout if scenario == "dropout" else SCENARIOS[scenario])().double()
    pipe = gf.GPipe(
        net, balance, chunks=3, checkpoint=checkpoint, schedule=schedule,
        pp_group=dist.group.WORLD, timeout=60,
    )  # fmt: skip
    steps = []
    try:
        for step, size in enumerate(batches):
            x, y = batch(size, seed=300 + step)
            pipe.zero_grad(set_to_none=True)
            if step_seed is not None:
                torch.manual_seed(step_seed + step)
            loss = pipe.train_step(x, y, nn.functional.mse_loss)
            evaluated = pipe.eval_step(x, y, nn.functional.mse_loss)
            steps.append(
                {"loss": loss.item(), "eval": evaluated.item(), "grads": grads_by_name(pipe)}
            )
    finally:
        pipe.close()
    return {"steps": steps}


def skips_soak(rank: int, world: int, *, schedule: str, steps: int) -> dict[str, Any]:
    """`steps` training steps of the multi-skip scenario across the world's ranks: the live
    tensors and threads after a warm-up and after the steps (a leaked skip, message or step
    would grow them)."""
    import gc
    import threading

    from skip_models import SCENARIOS

    def census() -> tuple[int, int]:
        gc.collect()
        tensors = sum(isinstance(o, torch.Tensor) for o in gc.get_objects())
        return tensors, threading.active_count()

    torch.manual_seed(0)
    pipe = gf.GPipe(SCENARIOS["multi"]().double(), [2, 1, 1, 2], chunks=4, schedule=schedule,
                    checkpoint="except_last", pp_group=dist.group.WORLD, timeout=60)  # fmt: skip
    counts = []
    try:
        for step in range(steps + 10):
            if step == 10:
                counts.append(census())
            x, y = batch(8 + step % 3, seed=step)  # shapes change between steps too
            pipe.zero_grad(set_to_none=True)
            pipe.train_step(x, y, nn.functional.mse_loss)
        counts.append(census())
    finally:
        pipe.close()
    return {"counts": counts}


def recorded_step(rank: int, world: int, *, schedule: str) -> dict[str, Any]:
    """One recorded training step of the multi-skip scenario across the world's ranks (after
    a warm-up step): this rank's task spans as (kind, cell, micro-batch, start, end, worker),
    and each of its workers' order of tasks in the step's schedule, (kind, cell, m) each."""
    from skip_models import SCENARIOS

    torch.manual_seed(0)
    balance = [3, 3] if schedule in ("gpipe", "1f1b", "zero_bubble") else [2, 1, 1, 2]
    pipe = gf.GPipe(SCENARIOS["multi"]().double(), balance, chunks=4, schedule=schedule,
                    pp_group=dist.group.WORLD, timeout=60)  # fmt: skip
    try:
        x, y = batch(8, seed=1)
        pipe.train_step(x, y, nn.functional.mse_loss)
        pipe.record_timeline()
        pipe.train_step(x, y, nn.functional.mse_loss)
        spans = pipe.timeline().spans
        pipeline = pipeline_of(pipe)
        assert pipeline is not None
        schedule_run, _ = pipeline.schedules.train_step(4, pipe.checkpoint)
        names = _C.actions()
        tasks = schedule_run.tasks
        orders = [
            [(names[tasks[t].action], tasks[t].stage, tasks[t].microbatch)
             for t in schedule_run.order(w)]
            for w in range(schedule_run.workers)
        ]  # fmt: skip
    finally:
        pipe.close()
    return {
        "spans": [(s.kind, s.cell, s.microbatch, s.start_s, s.end_s, s.worker) for s in spans],
        "orders": orders,
    }


def meta_gpt(
    rank: int, world: int, *, pp: int, dp: int, balance: list[int], schedule: str
) -> dict[str, Any]:
    """The small GPT built on the meta device, every rank seeded apart (so that nothing but
    the pipe makes copies agree), initialised by its init_fn; one training step."""
    pp_group, dp_group, replica = groups(pp, dp)
    with torch.device("meta"):
        net = gpt.gpt(blocks=2)
    torch.manual_seed(10 + rank)
    pipe = gf.GPipe(net, balance, chunks=2, schedule=schedule, pp_group=pp_group,
                    dp_group=dp_group, init_fn=gpt.init_weights, timeout=60)  # fmt: skip
    state = {name: tensor.tolist() for name, tensor in pipe.state_dict().items()}
    x, y = gpt.batch(8, seed=3)
    try:
        loss = pipe.train_step(shard(x, replica, dp), shard(y, replica, dp), gpt.loss_fn)
    finally:
        pipe.close()
    return {"state": state, "loss": loss.item(), "grads": grads_by_name(pipe)}


def load_whole_model(rank: int, world: int) -> dict[str, Any]:
    """Each rank of a pp pipe loads the whole model's state dict: its own layers' keys are
    taken, the other rank's skipped; a key of no layer, or a missing key of its own, raises."""
    pipe = gf.GPipe(gpt.gpt(blocks=2), [2, 3], pp_group=dist.group.WORLD, timeout=60)
    whole = gpt.gpt(blocks=2, seed=5).state_dict()
    errors = {}
    try:
        pipe.load_state_dict(whole)
        state = {name: tensor.tolist() for name, tensor in pipe.state_dict().items()}
        for name, broken in (
            ("unknown key", {**whole, "9.weight": torch.zeros(1)}),
            ("missing key", {k: v for k, v in whole.items() if k not in ("1.fc.bias", "3.bias")}),
        ):
            try:
                pipe.load_state_dict(broken)
                errors[name] = ""
            except RuntimeError as error:
                errors[name] = str(error)
    finally:
        pipe.close()
    return {"state": state, "errors": errors}


def scaled(rank: int, world: int, *, pp: int, dp: int, planted: int) -> dict[str, Any]:
    """Two steps with gf.GradScaler and SGD: a clean one, then one whose gradients hold an
    inf on rank `planted` only. Every rank must step the first and skip the second."""
    pp_group, dp_group, replica = groups(pp, dp)
    pipe = gf.GPipe(model(4), [4, 4], chunks=2, schedule="1f1b", pp_group=pp_group,
                    dp_group=dp_group, timeout=60)  # fmt: skip
    scaler = gf.GradScaler(pipe, init_scale=512.0)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    params: list[dict[str, list[Any]]] = []
    scales = []
    try:
        for step in range(2):
            x, y = batch(8, seed=100 + step)
            opt.zero_grad()
            loss = pipe.train_step(shard(x, replica, dp), shard(y, replica, dp),
                                   nn.functional.mse_loss, grad_scaler=scaler)  # fmt: skip
            if step == 1 and rank == planted:
                next(pipe.parameters()).grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            params.append({k: v.tolist() for k, v in pipe.state_dict().items()})
    finally:
        pipe.close()
    return {"loss": loss.item(), "params": params, "scales": scales}


def autocast_bf16(rank: int, world: int, *, schedule: str) -> dict[str, Any]:
    """A float32 model's train_step under bf16 autocast on every rank: the loss, the
    gradients, and the dtype the last cell's loss_fn saw."""
    cells = 4 if schedule in ("interleaved", "zbv") else 2
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    pipe = gf.GPipe(net, [4 // cells] * cells, chunks=2, schedule=schedule,
                    pp_group=dist.group.WORLD, timeout=60)  # fmt: skip
    seen: list[str] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append(str(out.dtype))
        return nn.functional.mse_loss(out.float(), target)

    generator = torch.Generator().manual_seed(7)
    x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 8, generator=generator)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pipe.train_step(x, y, loss_fn)
    finally:
        pipe.close()
    grads = {k: v.grad.tolist() for k, v in pipe.state_dict(keep_vars=True).items()
             if v.grad is not None}  # fmt: skip
    return {"loss": loss.item(), "grads": grads, "seen": seen}


CHECKPOINT_TIES = ((0, 4),)  # the first Linear's weight is the third's too


def _checkpoint_pipe(pp: int, dp: int, schedule: str, balance: list[int], seed: int) -> Any:
    pp_group, dp_group, replica = groups(pp, dp)
    net = model(4, seed=seed, ties=CHECKPOINT_TIES)
    pipe = gf.GPipe(net, balance, chunks=2, schedule=schedule, pp_group=pp_group,
                    dp_group=dp_group, timeout=60)  # fmt: skip
    return pipe, torch.optim.Adam(pipe.parameters(), lr=0.01), replica


def _train_steps(pipe: Any, opt: Any, replica: int, dp: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(8, seed=300 + step)
        opt.zero_grad()
        loss = pipe.train_step(shard(x, replica, dp), shard(y, replica, dp),
                               nn.functional.mse_loss)  # fmt: skip
        opt.step()
        losses.append(loss.item())
    return losses


def dcp_save(
    rank: int, world: int, *, path: str, pp: int, dp: int, schedule: str, balance: list[int]
) -> dict[str, Any]:
    """Two Adam steps, a DCP checkpoint of model and optimizer (get_state_dict, flattened),
    then two more steps: the losses a resumed run must see."""
    pipe, opt, replica = _checkpoint_pipe(pp, dp, schedule, balance, seed=0)
    try:
        _train_steps(pipe, opt, replica, dp, range(2))
        model_state, optim_state = get_state_dict(pipe, opt, options=FLAT)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        after = _train_steps(pipe, opt, replica, dp, range(2, 4))
    finally:
        pipe.close()
    return {"after": after, "keys": sorted(model_state), "optim_keys": sorted(optim_state)}


def dcp_load(
    rank: int, world: int, *, path: str, pp: int, dp: int, schedule: str, balance: list[int]
) -> dict[str, Any]:
    """Another initialisation, then the checkpoint loaded (set_state_dict) and two steps."""
    pipe, opt, replica = _checkpoint_pipe(pp, dp, schedule, balance, seed=99)
    try:
        model_state, optim_state = get_state_dict(pipe, opt, options=FLAT)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(pipe, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=FLAT)  # fmt: skip
        after = _train_steps(pipe, opt, replica, dp, range(2, 4))
    finally:
        pipe.close()
    return {"after": after}


def dcp_save_dies(rank: int, world: int, *, path: str, dying: int) -> dict[str, Any]:
    """A step, then a DCP save during which rank `dying` dies: the others must raise."""
    pipe, opt, replica = _checkpoint_pipe(world, 1, "1f1b", [4, 4], seed=0)
    try:
        _train_steps(pipe, opt, replica, 1, range(1))
        model_state, optim_state = get_state_dict(pipe, opt, options=FLAT)
        if rank == dying:
            os._exit(5)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    finally:
        pipe.close()
    return {"saved": True}


def thread_rule(rank: int, world: int, *, cores: int, set_threads: int | None) -> dict[str, Any]:
    """A pipe built with no OMP_NUM_THREADS and `cores` cores: its threads and why, after the
    caller's torch.set_num_threads(set_threads) when given (each process is on one host)."""
    from gpipe_fast.device import host

    saved = (os.environ.pop("OMP_NUM_THREADS", None), host.cpu_cores, host._IMPORT_THREADS,
             host._SHARED_THREADS)  # fmt: skip
    before = torch.get_num_threads()
    host.cpu_cores = lambda: cores  # type: ignore[assignment]
    host._IMPORT_THREADS = before
    try:
        if set_threads is not None:
            torch.set_num_threads(set_threads)
        pipe = gf.GPipe(model(2), [2, 2], pp_group=dist.group.WORLD, timeout=60)
        caller = torch.get_num_threads()  # this thread's own, after the build
        again = gf.GPipe(model(2), [2, 2], pp_group=dist.group.WORLD, timeout=60)
        pipe.close()
        again.close()
        return {"threads": pipe.threads_per_cell, "reason": pipe.threads_reason,
                "caller": caller, "again": again.threads_per_cell}  # fmt: skip
    finally:
        torch.set_num_threads(before)
        omp, host.cpu_cores, host._IMPORT_THREADS, host._SHARED_THREADS = saved  # type: ignore[assignment]
        if omp is not None:
            os.environ["OMP_NUM_THREADS"] = omp


def with_env(
    rank: int, world: int, *, env: dict[str, str], case: str, only: Any = None, **kwargs: Any
) -> Any:
    """Another case (of this module, or `<module>.<name>` of another) run with `env` set in
    this worker's environment (restored after), on the ranks `only` lists (all when None)."""
    saved = {name: os.environ.get(name) for name in env}
    if only is None or rank in only:
        os.environ.update(env)
    try:
        module, _, name = case.rpartition(".")
        run = getattr(importlib.import_module(module), name) if module else globals()[name]
        return run(rank, world, **kwargs)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def ring_names(pipe: gf.GPipe) -> list[str]:
    """The names of this rank's shared-memory rings of `pipe` (none over gloo)."""
    links = pipe._pipeline.media.links if pipe._pipeline is not None else None
    if links is None:
        return []
    return sorted(end.name for end in [*links.senders.values(), *links.receivers.values()])


def in_dev_shm(names: list[str]) -> list[str]:
    """Those of `names` (rings) that are still files in /dev/shm."""
    return sorted(n for n in names if os.path.exists("/dev/shm/" + n.lstrip("/")))


def shm_failure(rank: int, world: int, *, failing_rank: int, pp: int = 0) -> dict[str, Any]:
    """`fail`'s step, with what the rings were: this rank's error, the transport, the ring
    names, and which of them are in /dev/shm while the pipe is open and after it closed."""
    pipe = _failing_pipe(world, failing_rank, False, pp or world)
    names = ring_names(pipe)
    x, y = batch(8, seed=1)
    open_left = in_dev_shm(names)
    try:
        error = _error_of(lambda: pipe.train_step(x, y, nn.functional.mse_loss))
        refused = _error_of(lambda: pipe.train_step(x, y, nn.functional.mse_loss))
    finally:
        pipe.close()
    return {"transport": pipe.transport_kind, "names": names, "error": error,
            "refused": refused, "open_left": open_left, "left": in_dev_shm(names)}  # fmt: skip


def without_broadcast(rank: int, world: int, *, inner: str, **kwargs: Any) -> Any:
    """Another case (`inner`) run with torch.distributed.broadcast refusing every call: what of the
    step needs the process group's broadcast then fails with its RuntimeError."""
    saved = dist.broadcast

    def refuse(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("torch.distributed.broadcast was called")

    dist.broadcast = refuse  # type: ignore[assignment]
    try:
        return globals()[inner](rank, world, **kwargs)
    finally:
        dist.broadcast = saved


def missing_input(rank: int, world: int, *, missing_on: int) -> dict[str, Any]:
    """A step where rank `missing_on` (the first or the last cell's) passes None for what it
    needs (the input, or the target): what each rank raised."""
    pipe = gf.GPipe(model(2), [2, 2], chunks=2, pp_group=dist.group.WORLD, timeout=60)
    x, y = batch(4, seed=1)
    if rank == missing_on:
        x, y = (None, y) if rank == 0 else (x, None)
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
        error = ("none", "")
    except Exception as caught:
        error = (type(caught).__name__, str(caught))
    finally:
        pipe.close()
    return {"error": error}
