"""`gf.pipeline`: any nn.Module as a pipe, cut at split points, its own forward run untraced."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe_fast.api import optim_state
from gpipe_fast.api.auto import AutoPipe, Tuned, check_tunable
from gpipe_fast.api.auto_model import ModelBuilder
from gpipe_fast.api.builder import LayerKind
from gpipe_fast.api.gpipe import GPipe
from gpipe_fast.api.model_items import model_loss
from gpipe_fast.api.rank_saves import warn_on_rank_saves
from gpipe_fast.balancing.balance import partition
from gpipe_fast.capture.cell import captured_cells
from gpipe_fast.capture.discover import as_inputs, discover, repeated_blocks
from gpipe_fast.capture.plans import CapturePlans
from gpipe_fast.capture.split import SPLIT_BY, choose_split_points
from gpipe_fast.nn.items import Counting, ItemMean, check_items_given
from gpipe_fast.schedule.registry import schedule_kind

LossFn = Callable[[Any, Any], Tensor]


class ModelPipe(GPipe):
    """A GPipe of any model (see :func:`pipeline`): one cell per stage, each running the
    model's own forward with its stage's modules for real. Steps take the model's inputs in
    the form of ``example_inputs`` (a tensor, a tuple of positional arguments or a dict of
    keyword arguments); ``loss_fn(output, target)`` gets what the model returns for one
    micro-batch, and ``target`` may be None (a model that computes its own loss from its
    inputs' labels: ``loss_fn=lambda out, _: out.loss``)."""

    _first_stage: Any  # stage 0's cell, which maps the step's tuple of inputs to their names
    _last_stage: Any  # the last stage's cell, which computes the model's own loss
    _model: nn.Module  # the model (not registered: the cells hold its parts)
    _aliases: dict[str, str]  # a parameter's other names -> the model's first name for it

    def __init__(
        self, model: nn.Module, plans: CapturePlans, split_points: list[str], **kwargs: Any
    ):
        # Each parameter's first name in the model: what the plain model's named_parameters()
        # and optimizer state call it (taken now, before materialising can replace one).
        first_names: dict[int, str] = {}
        aliases = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases[name] = first_names.setdefault(id(param), name)
        # Compared across the ranks at build (see _layer_kind), before any cell is.
        self.__dict__["_given_split_points"] = list(split_points)
        self.__dict__["_model"] = model  # not a submodule: the cells hold its parts
        self.__dict__["_plans"] = plans
        cells = captured_cells(model, plans)
        first: Any = cells[0]
        module = nn.Sequential(OrderedDict((f"stage{k}", cell) for k, cell in enumerate(cells)))
        super().__init__(module, [1] * plans.first.stages, **kwargs)
        self.__dict__["_aliases"] = {a: n for a, n in aliases.items() if a != n}
        optim_state.rename_parameters(self, {
            name: aliases[name] for name, _ in super().named_parameters()
            if aliases.get(name, name) != name
        })  # fmt: skip
        self.split_points = list(split_points)
        self._plan = plans.first
        self.__dict__["_first_stage"] = first
        self.__dict__["_last_stage"] = cells[-1]
        # How the model computes its own loss from labels (None: not a transformers model).
        self._model_loss = model_loss(model)
        self._warned_count = False
        if self._pipeline is not None:
            self._pipeline.targets_optional = True
        if self.layout.multi_process:  # the model still holds the other ranks' stages
            warn_on_rank_saves(model, self, f"rank {self.layout.pp_index} of the pipe")

    def _layer_kind(self) -> LayerKind:
        """Its layers are the model's stages: left out of keys, sharing the buffers their
        glue reads, cut at the split points (which the ranks compare)."""
        cut = {"split_points": self.__dict__["_given_split_points"]}
        return LayerKind(transparent=True, shared_buffers=True, cut=cut)

    @property
    def training(self) -> bool:
        """The model's mode, which its forward reads (``pipe.train()`` and ``pipe.eval()`` set
        it, glue and every stage included; so does the model's own ``train()``)."""
        model = self.__dict__.get("_model")
        return bool(model.training) if model is not None else self.__dict__.get("_mode", True)

    @training.setter
    def training(self, mode: bool) -> None:
        self.__dict__["_mode"] = mode

    def train(self, mode: bool = True) -> ModelPipe:
        """Sets the mode of the whole model, the glue between the stages' modules included,
        on this rank (call it on every rank): what the model's forward reads as
        ``self.training`` on every stage."""
        super().train(mode)
        self._model.train(mode)
        return self

    def _in_the_models_mode(self) -> None:
        """The cells follow the model's mode (which its own train()/eval() may have set)."""
        mode = self._model.training
        if self.__dict__.get("_mode") != mode:
            self.train(mode)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters under the plain model's names: a tied one (held by several stages,
        or by another module than the one the model names first) by the name the plain
        model's ``named_parameters()`` gives it, on every rank."""
        dot = f"{prefix}." if prefix else ""
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            if remove_duplicate:
                key = name[len(dot) :]
                name = dot + self._aliases.get(key, key)
            yield name, param

    def _as_input(self, inputs: Any) -> tuple[Tensor, ...] | None:
        """The model's inputs in the form of example_inputs, as the pipe's tuple of tensors
        (None stays None: a rank without cell 0 passes none)."""
        if inputs is None:
            return None
        plan = self._plan
        args, kwargs = as_inputs(inputs, "inputs")
        given = {str(i): a for i, a in enumerate(args)} | kwargs
        expected = set(plan.tensor_inputs) | set(plan.constant_inputs)
        unknown = sorted(set(given) - expected)
        if unknown or len(args) != plan.positional:
            raise ValueError(
                f"inputs: give the arguments of example_inputs ({sorted(expected)}) or some of "
                f"the keyword ones, got {sorted(given)}"
            )
        for name, value in plan.constant_inputs.items():
            if name in given and given[name] is not value and given[name] != value:
                raise ValueError(
                    f"inputs: {name!r} is {given[name]!r} but the pipe was built with "
                    f"{value!r} (only tensors may change between steps)"
                )
        present = []
        for name in plan.tensor_inputs:
            value = given.get(name)
            if value is None:
                continue  # left out (labels, say): the model gets None, every stage alike
            if not isinstance(value, Tensor):
                raise TypeError(f"inputs: {name!r} must be a Tensor, as in example_inputs")
            present.append(name)
        self._first_stage.present = present  # the stage maps the tuple to these names
        return tuple(given[name] for name in present)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs and not args:
            inputs: Any = kwargs
        elif args and not kwargs:
            inputs = args[0] if len(args) == 1 and self._plan.positional == 1 else args
            if len(args) == 1 and isinstance(args[0], (dict, tuple)):
                inputs = args[0]
        else:
            raise TypeError("pipe(...) takes the model's inputs as positional or keyword "
                            "arguments, as example_inputs gave them")  # fmt: skip
        if self._plan.cache:
            raise ValueError(
                f"pipe(...): the model returns a {self._plan.cache} (use_cache=True), whose "
                "layers' keys and values each stage holds only for its own layers; pass "
                "use_cache=False in example_inputs and in the inputs (or set "
                "model.config.use_cache = False before building the pipe): a pipe runs whole "
                "sequences, not token by token"
            )
        self._in_the_models_mode()
        return super().forward(self._as_input(inputs))  # type: ignore[arg-type]

    def train_step(
        self,
        input: Any,
        target: Any,
        loss_fn: LossFn,
        *,
        reduction: str | ItemMean | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """:meth:`GPipe.train_step` with the model's inputs. ``reduction=None`` (the
        default) is the model's own: with ``target=None``, a transformers model computes its
        loss from ``labels`` in its inputs, as a mean over the labels that are not -100
        (a causal LM's shifted by one): each micro-batch then weighs its labels' share of the
        whole batch's, over every replica (and the model divides by their count itself
        where its forward takes ``num_items_in_batch``); otherwise ``"mean"``."""
        self._in_the_models_mode()
        given = self._as_input(input)
        return super().train_step(given, target, loss_fn, reduction=reduction, **kwargs)  # type: ignore[arg-type]

    def eval_step(
        self,
        input: Any,
        target: Any,
        loss_fn: LossFn,
        *,
        reduction: str | ItemMean | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """:meth:`GPipe.eval_step` with the model's inputs, reduced as in :meth:`train_step`."""
        self._in_the_models_mode()
        given = self._as_input(input)
        return super().eval_step(given, target, loss_fn, reduction=reduction, **kwargs)  # type: ignore[arg-type]

    def _loss_reduction(
        self, reduction: object, target: Any, num_items_in_batch: object
    ) -> tuple[str, Counting | None]:
        """The model's own loss (target None) averages over its labels' items: by default for
        a transformers model, and with gf.ItemMean for any; else as GPipe's."""
        own = target is None and (
            isinstance(reduction, ItemMean) or (reduction is None and self._model_loss)
        )
        if not own:
            return super()._loss_reduction(
                "mean" if reduction is None else reduction, target, num_items_in_batch
            )
        given = check_items_given(num_items_in_batch)
        mean = reduction if isinstance(reduction, ItemMean) else None
        return "mean", self._labels_counting(mean, given)

    def _labels_counting(self, mean: ItemMean | None, given: int | None) -> Counting:
        """How a step counts the items of the model's own loss: the micro-batch's labels (or
        shift_labels) that are not ignore_index, a causal LM's from the second on. On cell
        0's process, whose inputs the stage maps; `mean` None (the default): none when the
        inputs hold no labels (the step weighs rows)."""
        present = self._first_stage.present
        model_loss = self._model_loss
        name = "shift_labels" if "shift_labels" in present else "labels"
        shift = model_loss is not None and model_loss.shifts and name == "labels"
        ignore_index = mean.ignore_index if mean is not None else -100
        custom = mean.count if mean is not None else None
        count: Callable[[Any], Any] | None = None
        if name in present:
            position = present.index(name)

            def count(microbatch: Any) -> Any:
                labels = microbatch[position]
                if custom is not None:
                    return custom(labels)
                if labels.is_floating_point():  # a regression's: every entry is averaged
                    return labels.numel()
                return ((labels[..., 1:] if shift else labels) != ignore_index).sum()

        elif mean is not None:

            def count(microbatch: Any) -> Any:
                raise ValueError(
                    "reduction=gf.ItemMean() with target=None counts the model's labels, but "
                    f"the inputs hold no 'labels' (given: {present})"
                )

        # A router's auxiliary loss (MoE) is added whole to each micro-batch's loss, which
        # num_items_in_batch would leave undivided: the step's loss would carry it once per
        # micro-batch, its weight growing with chunks. Weighing each micro-batch's own mean
        # by its labels' share instead keeps the token part exact and gives the auxiliary
        # part the same shares, whatever the chunks.
        router_loss = model_loss is not None and (
            model_loss.router_loss or "output_router_logits" in present
        )
        takes_count = model_loss is not None and model_loss.takes_count and not router_loss
        if model_loss is not None and count is not None and not takes_count and not router_loss:
            self._warn_count(model_loss.name)
        return Counting("input", count, given, self._tell_count if takes_count else None)

    def _warn_count(self, name: str) -> None:
        """Says once per pipe that the model's loss is weighted, not given the count."""
        if not self._warned_count:
            self._warned_count = True
            warnings.warn(
                f"gf.pipeline: {name}'s forward does not pass num_items_in_batch on "
                "to its loss (transformers' self.loss_function), so gpipe_fast weights each "
                "micro-batch's loss by its share of the batch's labels that are not -100. "
                "That equals the whole batch's loss when the model averages over exactly "
                "those labels (as CrossEntropyLoss(ignore_index=-100) does); if it averages "
                "otherwise, say how with reduction=gf.ItemMean(count=...) or "
                'reduction="mean"',
                UserWarning,
                stacklevel=6,
            )

    def _tell_count(self, count: int | None) -> None:
        """Gives the last stage's forward num_items_in_batch (None: takes it back)."""
        last = self._last_stage
        if count is None:
            last.loss_kwargs = {}
        else:  # a tensor, as the Trainer gives it: filled on the device, no copy to wait for
            count_tensor = torch.full((), count, dtype=torch.int64, device=self.devices[-1])
            last.loss_kwargs = {"num_items_in_batch": count_tensor}

    def tune(self, input: Any, target: Any, loss_fn: LossFn, *args: Any, **kwargs: Any) -> Any:
        self._in_the_models_mode()
        return super().tune(self._as_input(input), target, loss_fn, *args, **kwargs)


def pipeline(
    model: nn.Module,
    example_inputs: Any,
    split_points: Sequence[str] | None = None,
    *,
    num_stages: int | None = None,
    split_by: str | None = None,
    **kwargs: Any,
) -> ModelPipe:
    """Any ``nn.Module`` as a pipe, exact: the model's own forward runs on every stage, the
    modules of that stage for real and the others' as shape-only placeholders, and every
    value a stage needs from another (a hidden state, rotary cos/sin, an encoder's output,
    a mask) goes straight from the stage that computes it.

    ``example_inputs`` is one micro-batch, in the form steps will take: a tensor, a tuple of
    positional arguments, or a dict of keyword arguments. ``split_points`` are the names of
    the modules where a new stage begins, in the order the forward calls them; None picks
    them among the model's repeated blocks (``model.layers.3``, ``transformer.h.5``, ...)
    over ``num_stages`` stages (default: one per rank of ``pp_group``, two with zbv; in one
    process, one per device), balancing their parameter counts, or with
    ``split_by="time"`` their forward times measured on ``example_inputs`` (the model runs
    for real, in evaluation mode without gradients). Every other keyword is
    :class:`GPipe`'s (``devices``, ``chunks``, ``checkpoint``, ``schedule``, ``pp_group``,
    ``dp_group``, ``timeout``, ``init_fn``, ...) except ``balance``, which split points
    replace. ``pipe.split_points`` lists the ones in use. With ``schedule="auto"`` and no
    split points given, the split points are tuned too (in one process; see
    :meth:`GPipe.tune`)."""
    if "balance" in kwargs:
        raise TypeError("balance: gf.pipeline cuts the model at split_points instead")
    tuned = Tuned.of(kwargs.get("schedule"), kwargs.get("chunks"), kwargs.get("checkpoint"),
                     cut_given=split_points is not None)  # fmt: skip
    if tuned is not None:  # built as the initial values say, tuned at its first step
        check_tunable(tuned, bool(kwargs.get("dp_shard", False)))
        kwargs = tuned.resolve(kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if split_points is None:
        stages = num_stages if num_stages is not None else _default_stages(kwargs)
        split_points = choose_split_points(
            model, example_inputs, stages, partition, split_by or SPLIT_BY[0]
        )
    elif split_by is not None:
        raise ValueError("split_by: it chooses split points, but split_points are given")
    elif isinstance(split_points, str):
        raise TypeError("split_points takes a list of module names, like [name], not one str")
    elif num_stages is not None and num_stages != len(split_points) + 1:
        raise ValueError(
            f"num_stages={num_stages} but {len(split_points)} split points make "
            f"{len(split_points) + 1} stages"
        )
    _check_devices(len(split_points) + 1, kwargs)
    plan = discover(model, example_inputs, list(split_points))
    plans = CapturePlans(model, example_inputs, list(split_points), plan)
    pipe = ModelPipe(model, plans, list(split_points), **kwargs)
    if tuned is not None:
        AutoPipe(tuned, ModelBuilder(model, example_inputs, kwargs, pipe)).attach(pipe)
    return pipe


def _check_devices(stages: int, kwargs: dict[str, Any]) -> None:
    """Devices given in one process that the stages leave unused (zbv runs two stages per
    device) are named in a warning rather than silently left out."""
    devices = kwargs.get("devices")
    schedule = kwargs.get("schedule", "gpipe")
    if devices is None or kwargs.get("pp_group") is not None or not isinstance(schedule, str):
        return
    try:
        per = schedule_kind(schedule).stages_per_worker
    except (KeyError, ValueError):
        return  # GPipe names an unknown schedule
    if per and stages // per < len(devices) and stages % per == 0:
        warnings.warn(
            f"devices: the {schedule} schedule runs {per} stages per device, so {stages} "
            f"stages use {stages // per} of the {len(devices)} devices given "
            f"({list(devices)[: stages // per]!r}); give {per * len(devices)} stages "
            f"({per * len(devices) - 1} split points) to use all {len(devices)}",
            UserWarning,
            stacklevel=3,
        )


def _default_stages(kwargs: dict[str, Any]) -> int:
    """One stage per rank of pp_group (two with zbv), else per device (CPU: two)."""
    per = schedule_kind(kwargs.get("schedule", "gpipe")).stages_per_worker or 1
    group = kwargs.get("pp_group")
    if group is not None:
        return dist.get_world_size(group) * per
    devices = kwargs.get("devices")
    if devices is not None:
        return len(devices) * per
    return max(torch.cuda.device_count(), 2 if per == 1 else 1) * per


__all__ = ["ModelPipe", "pipeline", "repeated_blocks"]
