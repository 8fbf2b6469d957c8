"""Per-layer costs of a module: parameters, and time and output size measured layer by layer."""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from gpipe_fast.arguments import (
    check_choice,
    check_int,
    check_module,
    check_non_negative,
    check_seconds,
)
from gpipe_fast.nn.microbatch import as_tensors
from gpipe_fast.nn.pytree import Tree, map_tensors, tensors_of, with_tensors
from gpipe_fast.skip.namespace import Namespace
from gpipe_fast.skip.tracker import SkipTracker, use_skip_tracker

Device = torch.device | str | int
Sample = Tensor | tuple[Tensor, ...]

TIME_COSTS = ("total", "forward", "backward")
# How the repeats of one measurement are summed up: the median resists the odd slow run (what
# a balance wants), the mean counts it at its rate (what a sum of many tasks, a step, adds up
# to when a shared host stalls threads now and then).
STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "median": statistics.median,
    "mean": statistics.fmean,
}
# Measured runs per layer when neither `repeats` nor `timeout` is given.
DEFAULT_REPEATS = 5
# The profilers' clock, in seconds (a name of its own so that tests can drive it).
_clock = time.perf_counter
# A backward pass computes gradients for both the inputs and the weights, about two forwards'
# work; assumed wherever the costs describe the forward (or the layer) but not its backward.
BACKWARD_PER_FORWARD = 2.0


def resolve_device(device: Device | None, module: nn.Module) -> torch.device:
    """`device`, or where the module already lives (its first parameter or buffer), or CPU."""
    if device is None:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            return tensor.device
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device is not a device: {device!r}") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {resolved} was asked for, but CUDA is not available")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def layer_param_counts(module: nn.Sequential) -> list[int]:
    """Parameter elements of each layer."""
    return [sum(p.numel() for p in layer.parameters()) for layer in check_module(module)]


def layer_param_bytes(module: nn.Sequential) -> list[int]:
    """Parameter bytes of each layer."""
    return [
        sum(p.numel() * p.element_size() for p in layer.parameters())
        for layer in check_module(module)
    ]


def layer_costs_by_params(module: nn.Sequential) -> list[float]:
    """Parameter elements of each layer, plus one.

    The one makes a parameter-free layer (an activation, a reshape) weigh as a single element:
    nothing next to any real layer, yet enough that a run of such layers is spread evenly
    instead of lying anywhere among equal-cost splits, and a module of only such layers is cut
    into cells of equal length.
    """
    return [float(count + 1) for count in layer_param_counts(module)]


@dataclass
class LayerProfile:
    """Per-layer measurements of one pass of a sample through a module, layer by layer."""

    forward: list[float]  # seconds, median over the repeats
    backward: list[float]  # seconds, median over the repeats; 0 where no gradient flows
    output_bytes: list[int]  # bytes of each layer's output tensors
    # With split=True: the backward as zero bubble runs it, the input's gradient alone, then
    # the weights' alone (seconds, medians); empty otherwise.
    backward_input: list[float] = field(default_factory=list)
    backward_weight: list[float] = field(default_factory=list)

    def costs(self, cost: str = "total") -> list[float]:
        """Per-layer seconds of the forward, the backward or both ("total")."""
        cost = check_choice(cost, "cost", TIME_COSTS)
        if cost == "forward":
            return list(self.forward)
        if cost == "backward":
            return list(self.backward)
        return [f + b for f, b in zip(self.forward, self.backward, strict=True)]


def _profiling_copy(layer: nn.Module, index: int, device: torch.device) -> nn.Module:
    """A training-mode copy of `layer` on `device`. Measuring a copy leaves the user's layer
    exactly as it was: its mode, device, requires_grad flags, .grad and running statistics
    (BatchNorm's would otherwise move with every profiling forward)."""
    try:
        duplicate = copy.deepcopy(layer)
    except RuntimeError as error:  # e.g. a non-leaf tensor attribute (old-style weight_norm)
        raise TypeError(
            f"module[{index}] cannot be deep-copied for profiling ({error}); balance this "
            "module with balance_by_params or balance_by_costs instead"
        ) from error
    return duplicate.to(device).train()


def _like(tensors: Sequence[Tensor], template: object) -> Sample:
    """Packs tensors the way `template` was packed: a lone Tensor or a tuple."""
    return tuple(tensors) if isinstance(template, tuple) else tensors[0]


def _nbytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _fresh_input(value: Tree, needs_grad: Sequence[bool]) -> Tree:
    """`value` (the sample, or a layer's output: any pytree) as a cell boundary hands it
    over: fresh autograd leaves for its tensors. Each is then cloned so that an in-place first
    op (ReLU(inplace=True)) neither trips over a leaf nor changes the input of the next
    repeat."""
    tensors = tensors_of(value)
    fresh = [
        t.detach().requires_grad_(grad).clone() for t, grad in zip(tensors, needs_grad, strict=True)
    ]
    return with_tensors(value, fresh)


class _FreshSkips(SkipTracker):
    """Skips as layer-by-layer profiling hands them over: a pop gets fresh leaves of what the
    latest stash left, as a cell boundary would, and every repeat may pop them again (a
    popped tensor still attached to the stashing layer's graph would be backwarded twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.needs_grad: dict[tuple[Namespace | None, str], bool] = {}

    def save(self, ns: Namespace | None, name: str, tensor: Tensor | None) -> None:
        self.tensors[(ns, name)] = None if tensor is None else tensor.detach()
        self.needs_grad[(ns, name)] = tensor is not None and tensor.requires_grad

    def load(self, ns: Namespace | None, name: str) -> Tensor | None:
        tensor = self.tensors[(ns, name)]
        if tensor is None:
            return None
        return tensor.detach().requires_grad_(self.needs_grad[(ns, name)]).clone()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Seconds `fn(*args)` takes on `device`, waiting for queued kernels on both sides."""
    _synchronize(device)
    start = _clock()
    result = fn(*args)
    _synchronize(device)
    return _clock() - start, result


def _backward_roots(outputs: tuple[Tensor, ...]) -> tuple[list[Tensor], list[Tensor]]:
    """The outputs a gradient can flow into, with an all-ones gradient for each."""
    roots = [t for t in outputs if t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def input_gradient(roots: list[Tensor], grads: list[Tensor], inputs: Tree) -> None:
    """The backward of zero bubble: the input's gradient alone, then the weights'."""
    wanted = [t for t in tensors_of(inputs) if t.requires_grad]
    if wanted:
        torch.autograd.grad(roots, wanted, grads, retain_graph=True, allow_unused=True)


def weight_gradient(roots: list[Tensor], grads: list[Tensor], params: list[Tensor]) -> None:
    torch.autograd.backward(roots, grads, inputs=params)


def _profile_layer(
    layer: nn.Module,
    value: Tree,
    needs_grad: Sequence[bool],
    device: torch.device,
    warmup: int,
    repeats: int | None,
    budget_s: float | None,
    split: list[list[float]] | None = None,
    average: Callable[[list[float]], float] = statistics.median,
) -> tuple[float, float, Tree]:
    """Median forward and backward seconds of one layer, and its (detached) output: over
    `repeats` measured runs after `warmup`, or (repeats None) over as many measured runs as
    fit in `budget_s` seconds from the layer's first run, at least one. With `split`, the
    input-gradient and weight-gradient halves of the backward are timed too (an extra
    forward per run) and their medians appended to split[0] and split[1]."""
    forward_times: list[float] = []
    backward_times: list[float] = []
    halves: tuple[list[float], list[float]] = ([], [])
    params = [p for p in layer.parameters() if p.requires_grad]
    output: Any = None
    started = _clock()
    run = 0
    while True:
        inputs = _fresh_input(value, needs_grad)
        forward_s, output = timed(device, layer, inputs)
        roots, grads = _backward_roots(tensors_of(output))
        backward_s = timed(device, torch.autograd.backward, roots, grads)[0] if roots else 0.0
        if split is not None:
            inputs = _fresh_input(value, needs_grad)
            roots, grads = _backward_roots(tensors_of(layer(inputs)))
            input_s = weight_s = 0.0
            if roots:
                input_s = timed(device, input_gradient, roots, grads, inputs)[0]
            if roots and params:
                weight_s = timed(device, weight_gradient, roots, grads, params)[0]
        run += 1
        if run > warmup:
            forward_times.append(forward_s)
            backward_times.append(backward_s)
            if split is not None:
                halves[0].append(input_s)
                halves[1].append(weight_s)
            if repeats is not None:
                enough = len(forward_times) >= repeats
            else:
                enough = budget_s is None or _clock() - started >= budget_s
            if enough:
                break
    detached = map_tensors(Tensor.detach, output)
    if split is not None:
        split[0].append(average(halves[0]))
        split[1].append(average(halves[1]))
    return average(forward_times), average(backward_times), detached


def _check_repeats(repeats: object, timeout: object) -> tuple[int | None, float | None]:
    """(repeats, None) for a fixed count (5 when neither is given), or (None, timeout)."""
    if timeout is None:
        return check_int(DEFAULT_REPEATS if repeats is None else repeats, "repeats", 1), None
    if repeats is not None:
        raise TypeError("give repeats (a number of runs) or timeout (seconds), not both")
    return None, check_seconds(timeout, "timeout")


def profile_layers(
    module: nn.Sequential,
    sample: Sample,
    *,
    device: Device | None = None,
    warmup: int = 2,
    repeats: int | None = None,
    timeout: float | None = None,
    split: bool = False,
    statistic: str = "median",
    copies: bool = True,
) -> LayerProfile:
    """Times each layer's forward and backward on `device`, feeding `sample` through the module
    layer by layer as the pipeline would: each layer gets the previous layer's output as fresh
    leaves that need a gradient once anything upstream learns. Runs copies of the layers in
    training mode, so the module itself is left untouched (its parameters' ``.grad``
    included). `device` defaults to where the module's parameters are (CPU without any).

    Each layer runs `warmup` times unmeasured, then `repeats` measured times (default 5); the
    medians are kept. Or give `timeout` instead of `repeats`, torchgpipe's keyword: the
    seconds to spend profiling, shared evenly among the layers; each layer is measured until
    its share (counted from its first run, warmup included) is spent, at least once, so a
    layer slower than its share takes longer. `split=True` also times the backward's
    input-gradient and weight-gradient halves (LayerProfile.backward_input and
    backward_weight), as the zero-bubble schedule runs them. `statistic`: "median" of the
    repeats (default) or "mean". `copies=False` runs the layers themselves, where they are
    and in their own mode (layers that cannot be deep-copied; the caller then restores
    their ``.grad`` and running statistics)."""
    module = check_module(module)
    average = STATISTICS[check_choice(statistic, "statistic", tuple(STATISTICS))]
    target = resolve_device(device, module)
    warmup = check_int(warmup, "warmup", 0)
    count, budget = _check_repeats(repeats, timeout)
    per_layer_s = None if budget is None else budget / len(module)
    tensors = as_tensors(sample, "sample")
    value: Tree = _like([t.to(target) for t in tensors], sample)
    needs_grad = [t.requires_grad for t in tensors]
    upstream = any(needs_grad)  # does anything before this layer learn?

    profile = LayerProfile([], [], [])
    with torch.enable_grad(), use_skip_tracker(_FreshSkips()):
        for index, layer in enumerate(module):
            work = _profiling_copy(layer, index, target) if copies else layer
            halves = [profile.backward_input, profile.backward_weight] if split else None
            forward_s, backward_s, value = _profile_layer(
                work, value, needs_grad, target, warmup, count, per_layer_s, halves, average
            )
            profile.forward.append(forward_s)
            profile.backward.append(backward_s)
            profile.output_bytes.append(_nbytes(tensors_of(value)))
            upstream = upstream or any(p.requires_grad for p in work.parameters())
            needs_grad = [upstream and t.is_floating_point() for t in tensors_of(value)]
            del work
    return profile


def layer_costs_by_time(
    module: nn.Sequential,
    sample: Sample,
    *,
    device: Device | None = None,
    warmup: int = 2,
    repeats: int | None = None,
    timeout: float | None = None,
    cost: str = "total",
) -> list[float]:
    """Measured seconds per layer (see profile_layers): "forward", "backward" or both."""
    cost = check_choice(cost, "cost", TIME_COSTS)
    profile = profile_layers(
        module, sample, device=device, warmup=warmup, repeats=repeats, timeout=timeout
    )
    return profile.costs(cost)


def layer_output_bytes(
    module: nn.Sequential, sample: Sample, *, device: Device | None = None, copies: bool = True
) -> list[int]:
    """Bytes of each layer's output tensors, measured by one forward of `sample` (no graph) on
    copies of the layers in training mode. Outputs that are views still count in full: at a
    cell boundary they become tensors of their own."""
    module = check_module(module)
    target = resolve_device(device, module)
    tensors = as_tensors(sample, "sample")
    # A copy even on the same device: an in-place first layer must not edit the caller's sample.
    value: Tree = _like([t.detach().to(target, copy=True) for t in tensors], sample)
    sizes = []
    with torch.no_grad():
        for index, layer in enumerate(module):
            work = _profiling_copy(layer, index, target) if copies else layer
            value = work(value)
            sizes.append(_nbytes(tensors_of(value)))
    return sizes


def check_param_scale(param_scale: object) -> float:
    return check_non_negative(param_scale, "param_scale")


def layer_costs_by_size(
    module: nn.Sequential,
    sample: Sample,
    *,
    device: Device | None = None,
    param_scale: float = 2.0,
    chunks: int = 1,
) -> list[float]:
    """Memory per layer in bytes: its output tensors' bytes per micro-batch plus its parameter
    bytes times `param_scale`. `sample` is one mini-batch, to be split into `chunks`
    micro-batches (torchgpipe's keyword), so each output's bytes on it are divided by
    `chunks`. The default param_scale 2.0 counts each parameter's gradient beside it; raise it
    for optimizer state kept on the same device (Adam's two moments: 4.0)."""
    scale = check_param_scale(param_scale)
    chunks = check_int(chunks, "chunks", 1)
    activations = layer_output_bytes(module, sample, device=device)
    return [
        out / chunks + scale * params
        for out, params in zip(activations, layer_param_bytes(module), strict=True)
    ]
