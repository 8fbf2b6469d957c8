"""Checkpoints of gf.pipeline pipes of transformers models (float64): DCP saved at pp=2 and
resumed elsewhere, whole-model state dicts loaded on each rank, meta-built models; each rank's
part of tests/test_any_model_checkpoints.py, and the plain model's runs they must equal."""

from __future__ import annotations

import warnings
from typing import Any

import any_model_cases as cases
import dist_cases
import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import gpipe_fast as gf

SAVED_AFTER = 2  # steps before the checkpoint
RESUMED = 2  # steps after it
SHAPES = [(6, 8), (5, 9), (7, 8), (4, 10)]  # (batch, length) of each step: they change
Snapshot = dict[str, dict[str, Any]]


def optimizer(module: nn.Module) -> torch.optim.AdamW:
    """AdamW with the matrices decayed and the rest (norms, biases) in a group without."""
    named = list(module.named_parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=0.01,
    )


def perturbed(name: str) -> nn.Module:
    """The model with other weights than cases.make_model's: what a checkpoint must overwrite."""
    model = cases.make_model(name)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


def batch(name: str, step: int) -> tuple[dict[str, Tensor], Tensor]:
    size, length = SHAPES[step]
    inputs = cases.inputs(name, size, length, step)
    return inputs, cases.targets(name, inputs)


def step_pipe(pipe: Any, opt: torch.optim.Optimizer, name: str, step: int,
              replica: int = 0, replicas: int = 1) -> float:  # fmt: skip
    """One optimizer step of the pipe on this replica's share of step `step`'s batch; the
    loss of the whole batch."""
    inputs, target = batch(name, step)
    share = {key: dist_cases.shard(value, replica, replicas) for key, value in inputs.items()}
    opt.zero_grad(set_to_none=True)
    loss = pipe.train_step(share, dist_cases.shard(target, replica, replicas), cases.any_loss)
    opt.step()
    return float(loss)


def step_plain(model: nn.Module, opt: torch.optim.Optimizer, name: str, step: int) -> float:
    inputs, target = batch(name, step)
    opt.zero_grad(set_to_none=True)
    loss = cases.any_loss(model(**inputs), target)
    loss.backward()
    opt.step()
    return loss.item()


def snapshot(module: nn.Module, opt: torch.optim.Optimizer) -> Snapshot:
    """Every parameter under each of its names: its value and AdamW state, as tensors."""
    taken = {}
    for key, param in module.named_parameters(remove_duplicate=False):
        state = opt.state[param]
        taken[key] = {"param": param.detach().clone(), "step": float(state["step"]),
                      "exp_avg": state["exp_avg"].clone(),
                      "exp_avg_sq": state["exp_avg_sq"].clone()}  # fmt: skip
    return taken


def pipe_over(name: str, model: nn.Module, split_points: list[str], pp: int,
              **kwargs: Any) -> tuple[Any, int, int]:  # fmt: skip
    """A pipe of `model` over the world's (dp, pp) mesh; this rank's replica and the count."""
    replicas = dist_cases.dist.get_world_size() // pp
    pp_group, dp_group, replica = dist_cases.groups(pp, replicas)
    pipe = gf.pipeline(model, cases.inputs(name, 2, 8, 99), split_points, chunks=2,
                       schedule="1f1b", pp_group=pp_group, dp_group=dp_group, timeout=60,
                       **kwargs)  # fmt: skip
    return pipe, replica, replicas


def load(module: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """The guide's resume: get_state_dict for the shapes, dcp.load, set_state_dict."""
    model_state, optim_state = get_state_dict(module, opt)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # in one process DCP says it loads alone
        dcp.load(state, checkpoint_id=path)
    set_state_dict(module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def saved(rank: int, world: int, *, model: str, path: str) -> dict[str, Any]:
    """SAVED_AFTER steps at pp=2, then a DCP checkpoint of get_state_dict(pipe, opt): the
    losses, and the keys of this rank's state dict and of what it saved."""
    pipe, _, _ = pipe_over(model, cases.make_model(model), cases.split_points(model, 2), 2)
    try:
        opt = optimizer(pipe)
        losses = [step_pipe(pipe, opt, model, step) for step in range(SAVED_AFTER)]
        model_state, optim_state = get_state_dict(pipe, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        return {"losses": losses, "state_dict": sorted(pipe.state_dict()),
                "model": sorted(model_state), "optim": sorted(optim_state["state"]),
                "groups": [group["params"] for group in optim_state["param_groups"]]}  # fmt: skip
    finally:
        pipe.close()


def resumed(rank: int, world: int, *, model: str, path: str, split_points: list[str],
            pp: int) -> dict[str, Any]:  # fmt: skip
    """Other weights, the checkpoint loaded into a pipe cut at `split_points` over pp x the
    rest as dp replicas, RESUMED steps: the losses and this rank's parameters and state."""
    pipe, replica, replicas = pipe_over(model, perturbed(model), split_points, pp)
    try:
        opt = optimizer(pipe)
        load(pipe, opt, path)
        steps = range(SAVED_AFTER, SAVED_AFTER + RESUMED)
        losses = [step_pipe(pipe, opt, model, step, replica, replicas) for step in steps]
        return {"losses": losses, "state": snapshot(pipe, opt)}
    finally:
        pipe.close()


def resumed_plain(model: str, path: str) -> dict[str, Any]:
    """In one process without torch.distributed: the checkpoint loaded into the plain model
    and a plain AdamW, RESUMED steps."""
    net = perturbed(model)
    opt = optimizer(net)
    load(net, opt, path)
    steps = range(SAVED_AFTER, SAVED_AFTER + RESUMED)
    return {"losses": [step_plain(net, opt, model, step) for step in steps],
            "state": snapshot(net, opt)}  # fmt: skip


def uninterrupted(model: str) -> dict[str, Any]:
    """The plain model trained SAVED_AFTER + RESUMED steps without a break."""
    net = cases.make_model(model)
    opt = optimizer(net)
    losses = [step_plain(net, opt, model, step) for step in range(SAVED_AFTER + RESUMED)]
    return {"losses": losses, "state": snapshot(net, opt)}


def plain_keys(model: str) -> dict[str, Any]:
    """The plain model's keys: its state dict, and get_state_dict's optimizer state and
    param groups after one step."""
    net = cases.make_model(model)
    opt = optimizer(net)
    step_plain(net, opt, model, 0)
    model_state, optim_state = get_state_dict(net, opt)
    return {"state_dict": sorted(net.state_dict()), "model": sorted(model_state),
            "optim": sorted(optim_state["state"]),
            "groups": [group["params"] for group in optim_state["param_groups"]]}  # fmt: skip


def loaded(rank: int, world: int, *, model: str) -> dict[str, Any]:
    """Other weights at pp=2, then pipe.load_state_dict(the plain model's whole state dict)
    on every rank: what it reported, which keys differ from the plain model afterwards, and
    one step's loss against the plain model's."""
    plain = cases.make_model(model)
    pipe, _, _ = pipe_over(model, perturbed(model), cases.split_points(model, 2), 2)
    try:
        result = pipe.load_state_dict(plain.state_dict())
        want = plain.state_dict()
        differ = [key for key, value in pipe.state_dict().items()
                  if not torch.equal(value, want[key])]  # fmt: skip
        loss = step_pipe(pipe, optimizer(pipe), model, 0)
        return {"missing": result.missing_keys, "unexpected": result.unexpected_keys,
                "differ": differ, "keys": sorted(pipe.state_dict()), "loss": loss,
                "plain": step_plain(plain, optimizer(plain), model, 0)}  # fmt: skip
    finally:
        pipe.close()


def meta_llama() -> nn.Module:
    """cases.llama() built on the meta device: no memory, no values."""
    with torch.device("meta"):
        return cases.llama()


def meta_built(rank: int, world: int, *, load: bool) -> dict[str, Any]:
    """LLaMA built on the meta device, at pp=2 with init_fn=model._init_weights: what got
    memory on this rank, its rotary inv_freq, any warning; then (`load`: the plain model's
    weights loaded first) SAVED_AFTER steps' losses and this rank's parameters."""
    model = meta_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe, _, _ = pipe_over("llama", model, cases.split_points("llama", 2), 2,
                               init_fn=model._init_weights)  # fmt: skip
    try:
        local = {key for key, _ in pipe.named_parameters()}
        on_meta = {key for key, param in model.named_parameters() if param.is_meta}
        buffers = {key: value.clone() for key, value in pipe.named_buffers()}
        if load:
            pipe.load_state_dict(cases.llama().state_dict())
        opt = optimizer(pipe)
        losses = [step_pipe(pipe, opt, "llama", step) for step in range(SAVED_AFTER)]
        params = {key: param.detach().clone() for key, param in pipe.named_parameters()}
        return {"local": sorted(local), "on_meta": sorted(on_meta), "buffers": buffers,
                "warnings": [str(w.message) for w in caught if "meta" in str(w.message)],
                "losses": losses, "params": params}  # fmt: skip
    finally:
        pipe.close()


def plain_run(model: str, steps: int) -> dict[str, Any]:
    """The plain model's losses and parameters after `steps` steps (no process group)."""
    net = cases.make_model(model)
    opt = optimizer(net)
    losses = [step_plain(net, opt, model, step) for step in range(steps)]
    return {"losses": losses,
            "params": {key: p.detach().clone() for key, p in net.named_parameters()},
            "buffers": dict(net.named_buffers())}  # fmt: skip
