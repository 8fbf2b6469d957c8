"""The GPipe module: cuts an nn.Sequential into cells and pipelines micro-batches through them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
from torch import nn

from gpipe_fast.api import live_pipes, optim_state, state_dict
from gpipe_fast.api.auto import AutoPipe, SequentialBuilder, TuneOptions
from gpipe_fast.api.builder import LayerKind, PipeBuilder
from gpipe_fast.api.clip import check_clip_arguments, clip_grad_norm_
from gpipe_fast.api.naming import Naming
from gpipe_fast.api.pipe_module import Device, PipeModule
from gpipe_fast.api.pipe_reports import PipeReports
from gpipe_fast.api.step_loss import identity_loss, identity_train_step, loss_reduction
from gpipe_fast.arguments import check_loss_arguments, check_timeout
from gpipe_fast.distributed import beside
from gpipe_fast.nn.items import Counting, ItemMean
from gpipe_fast.nn.materialize import InitFn
from gpipe_fast.nn.microbatch import Value, as_tensors
from gpipe_fast.nn.pytree import Tree
from gpipe_fast.runtime.autograd_call import autograd_call
from gpipe_fast.runtime.context import LossFn
from gpipe_fast.runtime.pipeline import Pipeline
from gpipe_fast.runtime.step_request import StepRequest


class GPipe(PipeReports, PipeModule):
    """Wraps an nn.Sequential for GPipe training.

    The module is cut into ``len(balance)`` cells, cell k on ``devices[k]``; each mini-batch
    is split into ``chunks`` micro-batches that flow through the cells on one worker thread
    per cell. ``checkpoint`` picks which micro-batches drop their activations in forward and
    recompute them in backward: "always", "except_last" (all but the last) or "never".
    The output lives on the last device; ``loss.backward()`` runs the pipelined backward and
    leaves the gradients in the module's own parameters, equal to those of the unpartitioned
    module on the whole batch. ``recompute_pool=True`` (CUDA cells; off by default until a
    GPU measurement shows it lowers peak reserved memory) allocates what each cell's
    re-materialisation rebuilds from a native pool of that cell's own (see memory_stats()).

    ``devices`` defaults to every CUDA device, one per cell (with fewer GPUs than cells,
    neighbouring cells share a GPU: on one GPU, every cell runs there); without CUDA, to one
    "cpu" device per cell, however many cores there are: CPU cells share the cores out (see
    ``threads_per_cell``). A CUDA device this process does not have (a CPU-only torch) is a
    ValueError naming ``devices``. ``balance=None`` balances by parameter count over one cell
    per device: per GPU, or on a CPU-only machine one per core (at most one per layer), so that
    every cell gets a core of its own and all cores work at once without oversubscribing them.
    An empty ``nn.Sequential()`` with ``balance=[]`` is the identity and starts no workers.
    ``chunks`` takes an int or anything that converts to one without loss (42.0, a numpy int);
    ``checkpoint`` a mode as a str (a str subclass, or an object whose str() is the mode). The
    pipe cannot be moved (``cuda()``, ``cpu()``, ``to(device)``): build a new GPipe with other
    devices; casting (``half()``, ``to(torch.float64)``) is allowed.

    ``schedule`` orders the tasks of :meth:`train_step`: "gpipe" (fill-drain), "1f1b",
    "interleaved" (``len(balance)`` a multiple V of ``len(devices)``, cell s on
    ``devices[s % len(devices)]``, V cells per device's worker), "zero_bubble" (ZB-H1) or
    "zbv" (ZB-V: two cells per device, cells s and 2D-1-s on ``devices[s]``), or a kind
    registered with :func:`gpipe_fast.register_schedule_kind`.
    ``pipe(x)`` followed by ``loss.backward()`` always runs fill-drain. ``schedule``,
    ``chunks`` and ``checkpoint`` may be "auto": the pipe then chooses them (and, for
    ``schedule="auto"`` without a ``balance``, its cells) by measuring, at its first
    :meth:`train_step` or at :meth:`tune`.

    Across processes (torch.distributed): with ``pp_group`` of P processes, rank r of it
    runs cells r, r + P, ... (zbv: r and 2P-1-r); with ``dp_group``, replicas' gradients
    are summed over it. Every rank then calls :meth:`train_step` (or :meth:`eval_step`, or
    ``pipe(x)`` under ``torch.no_grad()``: the output on the last cell's rank, None on the
    others). ``timeout`` bounds every wait for another rank (seconds); a failure on any rank
    ends the step on all, raising :class:`PeerFailure` on the other ranks (the guide's page
    "Training across processes").

    ``dp_shard=True`` (with ``dp_group``) shards each cell over the data-parallel group
    with FSDP2 instead of replicating it: its layers that hold parameters, then the cell, are
    FSDP units; parameters, gradients and optimizer state are DTensor shards, 1/dp of the
    stage per rank (``p.grad.full_tensor()`` is the whole batch's gradient, as with
    replicas). ``dp_shard_sync`` says when gradients are reduce-scattered:
    "per_microbatch" (after each micro-batch's backward, unit by unit: the least memory) or
    "per_step" (once, after the stage's last backward: the fewest collectives);
    ``reshard_after_forward`` frees each unit after it ran forward (False: the stage stays
    gathered for the step). ``dp_group`` may be a process group or a one-dimensional
    DeviceMesh. The guide's page "Training across processes" counts the collectives.

    ``threads_per_cell`` sets each CPU cell's intra-op threads. By default your own setting
    (OMP_NUM_THREADS, or ``torch.set_num_threads`` after importing gpipe_fast) is kept;
    otherwise the cores are shared by the cells, or across processes by the job's processes
    on this host (and then the thread building the pipe gets its process's share too).
    ``pipe.threads_per_cell`` and ``pipe.threads_reason`` say what and why.

    A model built on the meta device gets memory for this process's cells only, each layer's
    ``reset_parameters()`` and then ``init_fn(module)`` on every module when given; a tensor
    that none of them reached is named in a warning, and the pipe refuses to run until it is
    loaded or set (a non-persistent buffer, which no state dict holds: re-created by
    ``init_fn`` or set); across processes that refusal fails the step on every rank.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None = None,
        *,
        devices: Sequence[Device] | None = None,
        chunks: int | str = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        recompute_pool: bool = False,
        schedule: str = "gpipe",
        pp_group: Any | None = None,
        dp_group: Any | None = None,
        timeout: float = 300.0,
        init_fn: InitFn | None = None,
        threads_per_cell: int | None = None,
        dp_shard: bool = False,
        dp_shard_sync: str = "per_microbatch",
        reshard_after_forward: bool = True,
    ) -> None:
        arguments = {k: v for k, v in locals().items() if k not in ("self", "module", "__class__")}
        super().__init__()
        self._auto: AutoPipe | None = None
        builder = PipeBuilder(module, balance, arguments, self._layer_kind())
        built = builder.build()
        self.balance = built.balance
        self.devices = built.devices
        self.chunks = built.chunks
        self.checkpoint = built.checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        self.schedule = built.schedule
        self.layout = built.layout
        self.partitions = built.partitions
        self._naming = built.naming
        self._layers_by_name = built.naming.layers_by_name  # torch.distributed.checkpoint's
        self._merged_stages = built.naming.merged_stages  # walks (see _fqn_modifiers)
        self._unfilled = built.unfilled
        self._threads = built.threads
        self._step_timeout: float | None = None
        self._pipeline = built.pipeline
        state_dict.register(self, _naming_of, _mark_loaded)
        live_pipes.add(self)
        if built.optimizer_names is not None:
            # get_state_dict(pipe, optimizer) gives the plain model's optimizer state dict,
            # whatever rank holds a layer: a tied weight under its first name, and (without
            # the flatten option) every rank's parameters in param_groups.
            optim_state.register(self, built.optimizer_names)
        if builder.tuned is not None:
            AutoPipe(builder.tuned, SequentialBuilder(builder.module, arguments, self)).attach(self)

    def _layer_kind(self) -> LayerKind:
        """What the pipe's layers are: the module's own (gf.pipeline's: a model's stages)."""
        return LayerKind()

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters under the model's own names, as in ``state_dict()``."""
        named = super().named_parameters(prefix, recurse, remove_duplicate)
        return self._naming.model_names(named, prefix)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The buffers under the model's own names, as in ``state_dict()``."""
        named = super().named_buffers(prefix, recurse, remove_duplicate)
        return self._naming.model_names(named, prefix)

    def _fqn_modifiers(self) -> dict[str, str]:
        # torch.distributed.checkpoint.state_dict's hook for modules whose state_dict keys
        # leave levels out: "partitions" and the cell index (Cells) are left out of a
        # layer's fully qualified name, and a key's layer name is looked up among the
        # layers. So get_state_dict(pipe, optimizer) keys the model's and the optimizer's
        # state by the model's own names, as state_dict() does, and a checkpoint loads into
        # another balance, another number of processes, or the plain model.
        return self._naming.fqn_modifiers(self.partitions)

    @property
    def step_timeout(self) -> float | None:
        """Seconds the forward or the backward phase of a step may take (None: no limit).

        When exceeded, the step is cancelled and TimeoutError names what each cell was doing
        (the task it never finished, or the one it was waiting to start). If a task is stuck
        and does not return within 2 s more, its workers are left behind and this pipe can
        run no more steps: build a new one.
        """
        return self._step_timeout

    @step_timeout.setter
    def step_timeout(self, seconds: float | None) -> None:
        self._step_timeout = (
            None
            if seconds is None
            else check_timeout(seconds, "step_timeout", "a number of seconds or None")
        )
        if self._pipeline is not None:
            self._pipeline.step_timeout = self._step_timeout

    def forward(self, input: Value) -> Tree:
        if self._pipeline is None:  # no cells: the identity, for Tensors only
            as_tensors(input, "input")
            return input
        if self._pipeline.layout.multi_process and not torch.is_grad_enabled():
            # Checked at the step's start on every rank (see _check_initialised).
            forward = StepRequest("forward", self.chunks)
            return self._pipeline.run(forward, input, None)
        self._unfilled.check()
        return autograd_call(self._pipeline, input, self.chunks, self.checkpoint, self.training)

    def train_step(
        self,
        input: Value,
        target: Any,
        loss_fn: LossFn,
        *,
        reduction: str | ItemMean = "mean",
        grad_scaler: torch.amp.GradScaler | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch in the order of ``schedule``; returns
        the loss of the whole batch (a detached 0-dim tensor on the last cell's device, in
        the dtype of ``loss_fn``'s losses).

        ``target`` is split like ``input``; ``loss_fn(output, target)`` gets one
        micro-batch of each and returns its scalar loss. ``reduction`` says how that loss
        reduces its micro-batch, so that the pipe weighs each one by its share:

        - ``"mean"`` (a mean over the micro-batch's rows, as ``nn.MSELoss()`` computes):
          weighted by its rows' share of the batch;
        - ``"sum"``: added up;
        - :class:`gpipe_fast.ItemMean` (a mean over the items it counts, as
          ``nn.CrossEntropyLoss(ignore_index=-100)`` averages over the targets that are not
          -100: padding, prompt masks): weighted by its items' share of the batch's.

        Either way the loss and every ``.grad`` equal
        ``loss_fn(model(input), target).backward()`` on the whole batch (gradients
        accumulate, as backward() does: zero them between steps, or leave them to accumulate
        over several steps, each step averaging over its own batch; exact also with
        ``dp_group``, where the batch is every replica's, and tied weights across ranks).
        ``num_items_in_batch`` (with an items mean) is the count the mean divides by instead
        of this step's own, the same on every rank: the items of several steps whose
        gradients accumulate before the optimizer's step, over every replica, as
        transformers' Trainer counts them; each step then adds its items' sum divided by it.
        The input's gradient reaches ``input.grad`` when it requires one.
        Under ``torch.no_grad()`` it raises RuntimeError before running anything: see
        :meth:`eval_step`.

        With ``grad_scaler`` (a :class:`gpipe_fast.GradScaler` of this pipe, as
        ``scaler.scale(loss).backward()`` does in plain PyTorch) each micro-batch's loss
        gradient is multiplied by its scale; the loss returned stays unscaled. Then
        ``scaler.step(optimizer); scaler.update()`` as usual."""
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "gpipe_fast: train_step computes gradients, but grad mode is off "
                "(torch.no_grad() or torch.inference_mode()); for the loss alone, call "
                "pipe.eval_step(x, target, loss_fn): it writes no .grad and records no graph"
            )
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(
                "grad_scaler must be a gpipe_fast.GradScaler (a torch.amp.GradScaler) or None, "
                f"got {type(grad_scaler).__name__}"
            )
        reduction, counting = self._loss_reduction(reduction, target, num_items_in_batch)
        pipeline = self._pipeline
        if pipeline is None:  # no cells: the loss of the input itself
            return identity_train_step(input, target, loss_fn, counting)
        self._check_initialised()

        def run(signature: int | None) -> torch.Tensor:
            """The step on the cells as they are now (see StepRequest's `signature`)."""
            pipeline = cast(Pipeline, self._pipeline)  # an "auto" pipe's may be rebuilt
            loss_scale = None
            if grad_scaler is not None and grad_scaler.is_enabled():
                # Every rank asks, so that every rank's scaler is ready to unscale_.
                device = pipeline.devices[pipeline.layout.local_stages[-1]]
                loss_scale = grad_scaler.scale(torch.ones((), device=device))
            train = StepRequest(
                "train", self.chunks, self.checkpoint if self.training else "never", loss_fn,
                reduction, loss_scale, counting, signature,
            )  # fmt: skip
            return cast(torch.Tensor, pipeline.run(train, input, target))

        if self._auto is None:
            return run(None)
        return cast(torch.Tensor, self._auto.train_step(self, run, input, target, loss_fn,
                                                        reduction))  # fmt: skip

    def tune(
        self,
        input: Value | None,
        target: Any,
        loss_fn: LossFn,
        memory_per_device: int | None = None,
        budget_s: float | None = None,
        *,
        reduction: str = "mean",
        progress: bool = True,
    ) -> Any:
        """Chooses what the pipe was built with as "auto" (``schedule``, with it the cells
        unless ``balance`` was given; ``chunks``; ``checkpoint``) for batches like `input`:
        ranks the candidates with :func:`gpipe_fast.plan` (those whose predicted peak fits
        `memory_per_device` bytes), runs the best few for a few steps each on this job, on
        every rank at once, and keeps the fastest (the same on every rank). Returns
        :attr:`tuning`. The steps change nothing of the model: parameters, gradients,
        buffers, the input's gradient and the random generators are as they were. `budget_s`
        bounds the seconds spent measuring; a bar shows the progress (`progress`).

        A pipe built with "auto" tunes at its first ``train_step``, and again at each new
        input signature (shapes and dtypes); this call tunes now. Across processes the cells
        of a GPipe may move between ranks here (not at a ``train_step``): call it on every
        rank, before building the optimizer over ``pipe.parameters()``."""
        if self._auto is None:
            raise ValueError(
                "pipe.tune: nothing to tune; build the pipe with schedule='auto', "
                "chunks='auto' or checkpoint='auto'"
            )
        if self._pipeline is None:
            raise ValueError("pipe.tune: an empty pipe has no cells to tune")
        self._check_initialised()
        options = TuneOptions(memory_per_device, budget_s, reduction=reduction, progress=progress)
        return self._auto.tune(self, input, target, loss_fn, options)

    @property
    def tuning(self) -> Any:
        """What the last tuning chose for the current input signature and why (a
        :class:`~gpipe_fast.Tuning`: the choice, every candidate's predicted and measured
        step, the calibrated plan); None before the first tuning or without "auto"."""
        return None if self._auto is None else self._auto.current

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float | str = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the whole model: returns the norm of every
        gradient of the model (a tensor, bitwise the same value and dtype on every rank) and
        scales this rank's gradients by ``max_norm / norm`` when that is below 1.

        The norm covers every cell on every rank of ``pp_group``; a tied weight counts once
        however many cells and ranks hold it, and ``dp_group`` replicas (whose gradients
        are already summed) count once. Across processes it costs one all-reduce of a few
        numbers over ``pp_group``; call it on every rank, after the step's backward.
        With ``dp_shard`` the shards of every replica count, over ``dp_group`` too.
        ``norm_type`` is a number > 0 or ``"inf"``; ``max_norm <= 0`` or another norm raises
        ValueError."""
        max_norm, norm_type = check_clip_arguments(max_norm, norm_type)
        pipeline = self._pipeline
        groups = pipeline.groups if pipeline is not None else None
        tied = pipeline.tied if pipeline is not None else None
        return clip_grad_norm_(
            self.parameters(), max_norm, norm_type, error_if_nonfinite, foreach,
            counted_elsewhere=tied.counted_elsewhere() if tied else set(),
            reduce=_norm_reduce(pipeline, groups),
            device=groups.device if groups is not None else torch.device("cpu"),
        )  # fmt: skip

    def naming_dead_ranks(self, what: str = "a collective") -> AbstractContextManager[None]:
        """A context for torch.distributed's own collectives across the pipe's ranks (such as
        ``torch.distributed.checkpoint.save``): a connection to another rank that breaks in
        it (gloo's "Connection reset by peer") is raised as :class:`PeerFailure` naming the
        rank that died, as a step's waits do (``what`` names the block in the message): a
        rank of this host whose process ended, or the other rank of a job of two. The rank
        named is reported like a failed step: the pipe refuses further steps. Other errors
        pass as they are."""
        pipeline = self._pipeline
        groups = pipeline.groups if pipeline is not None else None
        return beside.naming_dead_ranks(groups.guard if groups is not None else None, what)

    def eval_step(
        self,
        input: Value | None,
        target: Any,
        loss_fn: LossFn,
        *,
        reduction: str | ItemMean = "mean",
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of the whole batch, as :meth:`train_step` returns it (the same weighting,
        ``reduction`` and ``num_items_in_batch``, the same inputs on each rank), from a
        forward-only run of every micro-batch: no gradient is computed, no ``.grad``
        touched, no graph recorded and no activation kept.

        It runs in the pipe's own mode (dropout active after ``train()``, off after
        ``eval()``: switch it yourself) and under the caller's autocast. With ``pp_group``
        every rank calls it and gets the loss; with ``dp_group``, the loss of the batch over
        every replica."""
        reduction, counting = self._loss_reduction(reduction, target, num_items_in_batch)
        pipeline = self._pipeline
        if pipeline is None:  # no cells: the loss of the input itself
            check_loss_arguments(loss_fn, reduction)
            with torch.no_grad():
                return identity_loss(input, target, loss_fn, counting)
        self._check_initialised()
        evaluate = StepRequest(
            "evaluate", self.chunks, loss_fn=loss_fn, reduction=reduction, counting=counting
        )
        return cast(torch.Tensor, pipeline.run(evaluate, input, target))

    def _loss_reduction(
        self, reduction: object, target: Any, num_items_in_batch: object
    ) -> tuple[str, Counting | None]:
        """A step's reduction as the runtime takes it (see api/step_loss.py)."""
        return loss_reduction(reduction, num_items_in_batch)

    def _check_initialised(self) -> None:
        """Refuses to run while a tensor built on the meta device holds no values yet. A
        step across processes checks at its start on every rank instead (the pipeline's
        `ready`), where this rank's refusal ends the step on every rank, each naming it."""
        if self._pipeline is None or self._pipeline.cross is None:
            self._unfilled.check()

    def close(self) -> None:
        """Joins the worker threads and gives the recompute pools' memory back; the pipe
        cannot run afterwards."""
        if self._pipeline is not None:
            self._pipeline.close()
        live_pipes.discard(self)

    def extra_repr(self) -> str:
        devices = [str(d) for d in self.devices]
        return (
            f"balance={self.balance}, devices={devices}, chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}"
            + (f", schedule={self.schedule!r}" if self.schedule != "gpipe" else "")
        )


def _naming_of(pipe: GPipe) -> Naming:
    return pipe._naming


def _mark_loaded(pipe: GPipe, keys: set[str]) -> None:
    """Tensors a state dict loaded count as initialised."""
    pipe._unfilled.loaded(keys)


def pipeline_of(pipe: GPipe) -> Pipeline | None:
    """The runtime behind `pipe` (None for an empty pipe): for tests and benchmarks that
    look at the executor, streams or schedules themselves."""
    return pipe._pipeline


def _norm_reduce(pipeline: Pipeline | None, groups: Any) -> Any:
    """How a gradient norm's shares are combined: over the pipeline group, and over the
    data-parallel group too when each replica holds a shard of the gradients."""
    if groups is None or pipeline is None:
        return None
    return groups.reduce_over_all if pipeline.sharding is not None else groups.reduce_over_pipeline
