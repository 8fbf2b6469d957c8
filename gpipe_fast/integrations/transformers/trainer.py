"""`PipelineTrainer`: transformers' Trainer with a pipe inside, in one process or many."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from transformers import TrainingArguments

from gpipe_fast.api.any_model import ModelPipe, pipeline
from gpipe_fast.api.grad_scaler import GradScaler
from gpipe_fast.integrations.transformers.checkpoints import load_optimizer, save_optimizer
from gpipe_fast.integrations.transformers.data import example_batch, shard_over_replicas
from gpipe_fast.integrations.transformers.evaluation import PipeEvaluation
from gpipe_fast.integrations.transformers.losses import scaled
from gpipe_fast.integrations.transformers.mesh import Mesh, build_mesh
from gpipe_fast.integrations.transformers.pretrained import load_adapter, load_pretrained
from gpipe_fast.integrations.transformers.saving import save_pretrained
from gpipe_fast.integrations.transformers.split import plan_split_points
from gpipe_fast.schedule.registry import schedule_kind

TRAINING_ARGS_NAME = "training_args.bin"


class PipelineTrainer(PipeEvaluation):
    """A ``transformers.Trainer`` that trains its model through a :func:`gpipe_fast.pipeline`.

    It takes Trainer's arguments, plus the pipe's:

    - ``split_points``: the modules where a new stage begins (``["model.layers.4"]``). By
      default they are chosen among the blocks of the model's own pipeline plan
      (``_pp_plan``: LLaMA's ``model.layers``), balancing parameters, else as
      :func:`gpipe_fast.pipeline` picks them.
    - ``chunks`` (micro-batches per batch; default: one per stage), ``schedule``,
      ``checkpoint``, ``dp_shard`` (shard each stage over the replicas with FSDP2), and
      ``pipeline_kwargs`` for the rest of :func:`gpipe_fast.pipeline`'s keywords.
    - ``pp_size``: under torchrun, the processes of one pipeline (default: all of them); the
      world size over ``pp_size`` replicas of it train on different batches (a pp x dp
      mesh: global rank = replica * pp_size + stage's process). In one process the stages
      are cells on this process's devices (two CPU cells without a GPU).
    - ``example_inputs``: one batch as training gives them, which the pipe is planned for
      (default: a batch of the first two items of ``train_dataset``, else ``eval_dataset``,
      through the data collator).
    - ``pretrained``: a pretrained model's directory (safetensors) that each rank reads its
      stages' tensors from once the pipe is built: build the model on the meta device and
      no rank ever holds it whole (:func:`load_pretrained`).

    Every rank of a pipeline reads the same batches, the replicas different ones, so the
    global batch is ``per_device_train_batch_size x replicas x gradient_accumulation_steps``
    as with DDP on the replicas. Trainer's own machinery runs as it is: the optimizer and
    scheduler from ``TrainingArguments``, gradient accumulation, ``max_grad_norm`` (one
    norm over every stage and rank), logging (the loss every rank agrees on), ``evaluate``
    and ``predict`` (through the pipe's ``eval_step``), callbacks, the progress bar,
    ``save_steps`` checkpoints and ``resume_from_checkpoint`` (at the same or another
    layout). :meth:`save_model` writes a directory ``from_pretrained`` loads, each rank its
    own tensors.

    The loss is the model's own (from ``labels``), or ``compute_loss_func`` or label
    smoothing applied to each micro-batch's output; each micro-batch's counts by its share
    of the batch's rows. DeepSpeed, Trainer's FSDP, ``torch_compile``, tensor or context
    parallelism and ``auto_find_batch_size`` are refused with ValueError, and so is a
    subclass that overrides ``compute_loss`` (the pipe computes the loss on its last stage).
    """

    # The batches of the optimizer step under way (Trainer sets it in its loop).
    current_gradient_accumulation_steps = 1

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[..., nn.Module] | None = None,
        compute_loss_func: Callable[..., Tensor] | None = None,
        compute_metrics: Callable[..., dict[str, float]] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[Tensor, Tensor], Tensor] | None = None,
        *,
        split_points: Sequence[str] | None = None,
        chunks: int | None = None,
        schedule: str = "gpipe",
        checkpoint: str = "except_last",
        dp_shard: bool = False,
        pp_size: int | None = None,
        example_inputs: Mapping[str, Any] | None = None,
        pretrained: str | os.PathLike[str] | None = None,
        pipeline_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        _refuse_arguments(args)
        if type(self).compute_loss is not PipelineTrainer.compute_loss:
            raise TypeError(
                f"{type(self).__name__} overrides compute_loss, which PipelineTrainer never "
                "calls: the pipe computes each micro-batch's loss on its last stage. Pass "
                "compute_loss_func=fn(outputs, labels, num_items_in_batch=None) instead"
            )
        self._pipe_options: dict[str, Any] = {
            "split_points": None if split_points is None else list(split_points),
            "chunks": chunks, "schedule": schedule, "checkpoint": checkpoint,
            "dp_shard": dp_shard, "example_inputs": example_inputs,
            "pretrained": pretrained, **dict(pipeline_kwargs or {}),
        }  # fmt: skip
        self.pipe: ModelPipe | None = None
        super().__init__(
            model, args, data_collator, train_dataset, eval_dataset, processing_class,
            model_init, compute_loss_func, compute_metrics, callbacks, optimizers,
            optimizer_cls_and_kwargs, preprocess_logits_for_metrics,
        )  # fmt: skip
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "PipelineTrainer: accelerate's configuration enables "
                f"{'DeepSpeed' if self.is_deepspeed_enabled else 'FSDP'}, which would wrap "
                "the model itself; the pipe cuts the model into stages instead (for sharding "
                "over the replicas: dp_shard=True). Launch with torchrun, or an accelerate "
                "config without them"
            )
        self.args._n_gpu = 1  # the pipe places the stages on the devices (no DataParallel)
        self.mesh: Mesh = build_mesh(pp_size)
        self._build_pipe(self.model)

    # --- the pipe --------------------------------------------------------------------------

    def _build_pipe(self, model: Any) -> None:
        """Pipelines `model`, replacing any pipe of an earlier model (model_init)."""
        if self.pipe is not None:
            self.pipe.close()
        options = dict(self._pipe_options)
        example = options.pop("example_inputs") or self._example_inputs()
        pretrained = options.pop("pretrained")
        per = schedule_kind(options["schedule"]).stages_per_worker or 1
        mesh = self.mesh
        stages = mesh.pp_size * per if mesh.pp_size > 1 else _one_process_stages(per)
        split_points = options.pop("split_points")
        if split_points is None:
            split_points = plan_split_points(model, stages)
        if options["chunks"] is None:
            options["chunks"] = stages if split_points is None else len(split_points) + 1
        if getattr(model, "config", None) is not None:
            model.config.use_cache = False  # a cache is per-call state, no micro-batch's
        init_fn = _init_fn(model)
        if init_fn is not None:
            options.setdefault("init_fn", init_fn)
        self.pipe = pipeline(
            model, example, split_points, num_stages=stages if split_points is None else None,
            pp_group=mesh.pp_group, dp_group=mesh.dp_group, **options,
        )  # fmt: skip
        if pretrained is not None:
            load_pretrained(self.pipe, pretrained)
        self.model_wrapped = self.pipe
        if getattr(self.accelerator, "scaler", None) is not None:
            # fp16: every rank of this pipe skips an overflowing step together.
            self.accelerator.scaler = GradScaler(self.pipe)

    def _example_inputs(self) -> Any:
        """A batch of the first items of the training (else evaluation) data, collated."""
        dataset = self.train_dataset if self.train_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            dataset = next(iter(dataset.values()))
        if dataset is None:
            raise ValueError(
                "PipelineTrainer: give example_inputs (one batch, a dict of the model's "
                "inputs) or a train_dataset or eval_dataset to take one from"
            )
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="example")
                collate = self.data_collator
            else:
                collate = self._get_collator_with_removed_columns(self.data_collator, "example")
        except ImportError:
            collate = self._get_collator_with_removed_columns(self.data_collator, "example")
        return dict(example_batch(dataset, collate))

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """The model of ``model_init``; in ``train()``, pipelined anew."""
        model = super().call_model_init(trial)
        if self.pipe is not None:  # train(): a new model (during __init__ the pipe comes next)
            self._build_pipe(model)
        return model  # type: ignore[no-any-return]

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        return self.pipe  # the pipe is the model's only wrapper: no DDP, no DataParallel

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        pass  # each rank holds its stages on its devices; the pipe cannot be moved

    # --- data --------------------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        return self._replica_share(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return self._replica_share(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return self._replica_share(super().get_test_dataloader(test_dataset))

    def _replica_share(self, loader: Any) -> Any:
        if not self.mesh.distributed:
            return loader
        return shard_over_replicas(loader, self.mesh.dp_index, self.mesh.dp_size)

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Rows per optimizer step: each replica's batches (not each process's)."""
        return int(self._train_batch_size * args.gradient_accumulation_steps * self.mesh.dp_size)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        # Trainer sums the count over every process: each pipeline's ranks count its batch.
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (
            (self.state.num_input_tokens_seen - before) // self.mesh.pp_size
        )

    def floating_point_ops(self, inputs: Any) -> int:
        # The whole model's, which Trainer sums over every process: once per pipeline.
        return int(super().floating_point_ops(inputs) / self.mesh.pp_size)

    # --- steps -------------------------------------------------------------------------------

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        """One batch through the pipe's ``train_step``: every micro-batch's forward and
        backward; returns the batch's share of the step's loss, the same on every rank.

        As in Trainer: with ``num_items_in_batch`` (the labels counted over the accumulated
        batches and every replica) the batch adds its labels' loss summed over that count,
        so the accumulated losses and gradients are the mean over every label of the step;
        without, its mean divided by the batches accumulated."""
        pipe = self._the_pipe()
        pipe.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        inputs, labels, loss_fn, options = self._loss_of(self._prepare_inputs(inputs),
                                                         num_items_in_batch)  # fmt: skip
        if num_items_in_batch is None:
            loss_fn = partial(scaled, loss_fn, 1.0 / self.current_gradient_accumulation_steps)
        scaler = getattr(self.accelerator, "scaler", None)
        with self.compute_loss_context_manager(), self.accelerator.autocast():
            loss = pipe.train_step(inputs, labels, loss_fn, grad_scaler=scaler, **options)
        return loss.detach().to(self.args.device)

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:  # fmt: skip
        """The loss of ``inputs`` through the pipe (no gradient): :meth:`training_step` and
        :meth:`prediction_step` run the pipe's steps instead of calling this."""
        loss, outputs = self._evaluate_batch(inputs, keep_outputs=return_outputs)
        return (loss, outputs) if return_outputs else loss

    def _clip_grad_norm(self, model: nn.Module) -> Tensor:
        self.accelerator.unscale_gradients()
        return self._the_pipe().clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # the norm alone, clipping nothing
            grad_norm = self._the_pipe().clip_grad_norm_(math.inf)
        return grad_norm

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Trainer's optimizer over this rank's parameters (the pipe's, named as the
        model's, so weight decay picks the same ones)."""
        optimizer = super().create_optimizer(self._the_pipe() if model is None else model)
        # A group left empty on this rank (its stages hold no bias or norm; LoRA's adapters
        # only) goes: DCP cannot load a flattened optimizer state into a group of nothing.
        groups = optimizer.param_groups
        groups[:] = [group for group in groups if group["params"]]
        return optimizer  # type: ignore[no-any-return]

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        return super().get_decay_parameter_names(self.model if model is self.pipe else model)  # type: ignore[no-any-return]

    # --- saving and resuming --------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Writes a directory ``AutoModelFor*.from_pretrained`` loads in one process: the
        config, the trained weights as safetensors (sharded with an index; each rank
        writes its own stages' tensors) and the tokenizer (``processing_class``) when given;
        a PEFT model's adapter. Every rank calls it."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        tokenizer = self.processing_class
        if tokenizer is None:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        save_pretrained(self.model, self._the_pipe(), output_dir, processing_class=tokenizer)
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        self.save_model(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_optimizer(self._the_pipe(), self.optimizer, output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if not load_optimizer(self._the_pipe(), self.optimizer, checkpoint):
            warnings.warn(
                f"PipelineTrainer: {checkpoint} holds no optimizer state of a pipe "
                "(optimizer/, DCP shards by the model's names); the optimizer starts afresh",
                stacklevel=2,
            )
        scheduler = os.path.join(checkpoint, "scheduler.pt")
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The model's weights of a checkpoint (or of any save_pretrained directory), each
        rank reading its own stages' tensors."""
        if hasattr(self.model, "peft_config"):
            load_adapter(self.model, self._the_pipe(), resume_from_checkpoint)
        else:
            load_pretrained(self._the_pipe(), resume_from_checkpoint)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is not None:
            self._load_from_checkpoint(best)

    def end(self) -> None:
        """Closes the pipe (its workers), then Trainer's own end."""
        if self.pipe is not None:
            self.pipe.close()
        super().end()

    def _the_pipe(self) -> ModelPipe:
        assert self.pipe is not None, "PipelineTrainer: the pipe is built in __init__"
        return self.pipe


def _refuse_arguments(args: TrainingArguments) -> None:
    """ValueError naming a TrainingArguments setting that would wrap or split the model
    another way than the pipe."""
    refused = {
        "deepspeed": "DeepSpeed wraps the model and its optimizer itself",
        "fsdp": "Trainer's FSDP wraps the whole model; dp_shard=True shards each stage over "
        "the replicas with FSDP2 instead",
        "parallelism_config": "tensor, context or sequence parallelism split the model's "
        "layers; the pipe splits it into stages",
        "torch_compile": "the pipe runs each stage's modules itself",
        "auto_find_batch_size": "it rebuilds the model's wrapper on each try",
    }
    for name, why in refused.items():
        if getattr(args, name, None):
            raise ValueError(f"PipelineTrainer: TrainingArguments({name}=...) is not supported: "
                             f"{why}")  # fmt: skip


def _one_process_stages(per: int) -> int:
    """Stages in one process, as gf.pipeline counts them: one per GPU (two CPU cells)."""
    return max(torch.cuda.device_count(), 2 if per == 1 else 1) * per


def _init_fn(model: Any) -> Callable[[nn.Module], None] | None:
    """transformers' own initialisation for a model built on the meta device (its rotary
    buffers included), which the pipe runs on this rank's modules only."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    init = getattr(inner, "_init_weights", None)
    return init if callable(init) else None


__all__ = ["PipelineTrainer"]
