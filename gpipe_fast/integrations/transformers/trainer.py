"""`PipelineTrainer`: transformers' Trainer with a pipe inside, in one process or many."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import Trainer, TrainingArguments
from transformers.trainer_pt_utils import nested_detach

from gpipe_fast.api.any_model import ModelPipe, pipeline
from gpipe_fast.api.grad_scaler import GradScaler
from gpipe_fast.integrations.transformers.checkpoints import load_optimizer, save_optimizer
from gpipe_fast.integrations.transformers.data import example_batch, shard_over_replicas
from gpipe_fast.integrations.transformers.mesh import Mesh, build_mesh
from gpipe_fast.integrations.transformers.pretrained import load_adapter, load_pretrained
from gpipe_fast.integrations.transformers.saving import save_pretrained
from gpipe_fast.integrations.transformers.split import plan_split_points
from gpipe_fast.nn.items import ItemMean
from gpipe_fast.schedule.registry import schedule_kind

TRAINING_ARGS_NAME = "training_args.bin"


class PipelineTrainer(Trainer):  # type: ignore[misc]
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
            loss_fn = partial(_scaled, loss_fn, 1.0 / self.current_gradient_accumulation_steps)
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

    def _loss_of(
        self, inputs: dict[str, Any], num_items: Any
    ) -> tuple[dict[str, Any], Any, Callable[[Any, Any], Tensor], dict[str, Any]]:
        """(the model's inputs, the step's target, its loss_fn, its keywords): as Trainer,
        with compute_loss_func or label smoothing the labels leave the inputs and the loss
        comes from each micro-batch's outputs and labels (summed over `num_items` when
        given: Trainer's functions divide by it); else the model computes its own loss from
        its labels, which the pipe counts (or divides by `num_items`)."""
        if (self.label_smoother is None and self.compute_loss_func is None) or (
            "labels" not in inputs
        ):
            own: dict[str, Any] = {} if num_items is None else {"num_items_in_batch": num_items}
            if "labels" in inputs and self.model_accepts_loss_kwargs:
                # A mean over the labels counted as Trainer counts them (a wrapped model,
                # PEFT's, is one the pipe cannot tell apart by itself).
                shifted = self._loss_shifts_labels and "shift_labels" not in inputs
                own["reduction"] = ItemMean(count=_shifted_count if shifted else _count)
            return inputs, None, _own_loss, own
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        loss_fn = partial(self._labels_loss, num_items_in_batch=num_items)
        return inputs, labels, loss_fn, {"reduction": "mean" if num_items is None else "sum"}

    def _labels_loss(self, outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Tensor:
        """One micro-batch's loss from its outputs and labels, as Trainer.compute_loss."""
        if self.compute_loss_func is not None:
            return self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)  # type: ignore[no-any-return]
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        shift = model._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        return self.label_smoother(  # type: ignore[no-any-return]
            outputs, labels, shift_labels=shift, num_items_in_batch=num_items_in_batch
        )

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: torch.device) -> Any:
        """The labels of an accumulation window, counted as Trainer counts them (a causal
        LM's from the second of each row on, or ``shift_labels``) and summed over the
        replicas only: a pipeline's ranks read the same batches. None where Trainer passes
        no count (the model's forward takes none and there is no compute_loss_func)."""
        counted = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        if not batch_samples or "labels" not in batch_samples[0] or not counted:
            return None
        try:
            count = sum(
                (_counted_labels(batch, self._loss_shifts_labels) != -100).sum()
                for batch in batch_samples
            )
        except (TypeError, AttributeError):
            return None  # labels that are no tensor: Trainer counts none either
        count = torch.as_tensor(count, device=device)
        group = self.mesh.dp_group
        if group is not None:
            dist.all_reduce(
                count, group=group.get_group() if hasattr(group, "get_group") else group
            )
        return count

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

    # --- evaluation ----------------------------------------------------------------------------

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[Tensor | None, Any, Any]:
        """The batch's loss from the pipe's ``eval_step`` (the model's own, the same weighting
        as training), and unless ``prediction_loss_only`` its outputs (logits) from the last
        stage, given to every rank of the pipeline."""
        inputs = self._prepare_inputs(inputs)
        has_labels = bool(self.label_names) and all(
            inputs.get(k) is not None for k in self.label_names
        )
        labels = (
            nested_detach(tuple(inputs.get(name) for name in self.label_names))
            if has_labels
            else None
        )
        if isinstance(labels, tuple) and len(labels) == 1:
            labels = labels[0]
        if prediction_loss_only and not has_labels:
            return None, None, None
        if ignore_keys is None:
            config = getattr(self.model, "config", None)
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", []) or [])
        loss, outputs = self._evaluate_batch(
            inputs, keep_outputs=not prediction_loss_only, has_labels=has_labels
        )
        if prediction_loss_only:
            return loss, None, None
        logits = tuple(value for key, value in outputs.items() if key not in [*ignore_keys, "loss"])
        return loss, logits[0] if len(logits) == 1 else logits, labels

    def _evaluate_batch(
        self, inputs: dict[str, Any], keep_outputs: bool, has_labels: bool = True
    ) -> tuple[Tensor | None, dict[str, Any]]:
        """(the batch's loss or None, its outputs gathered over micro-batches when kept)."""
        pipe = self._the_pipe()
        inputs = self._prepare_inputs(inputs)
        # A loss of outputs and labels divides by the batch's labels, which Trainer counts.
        counted = self.compute_loss_func is not None or self.label_smoother is not None
        num_items = self._get_num_items_in_batch([inputs], self.args.device) if counted else None
        inputs, labels, own_loss, options = self._loss_of(inputs, num_items)
        kept: list[Any] = []

        def loss_fn(outputs: Any, target: Any) -> Tensor:
            if keep_outputs:  # per-row outputs (logits, ...): not the micro-batch's loss
                kept.append({k: v for k, v in outputs.items() if isinstance(v, Tensor) and v.dim()})
            if not has_labels:
                return torch.zeros((), device=_any_tensor(outputs).device)
            return own_loss(outputs, target)

        with torch.no_grad(), self.compute_loss_context_manager(), self.accelerator.autocast():
            loss = pipe.eval_step(inputs, labels, loss_fn, **options)
        outputs: dict[str, Any] = {}
        if keep_outputs:
            outputs = self._from_last_stage(
                {k: torch.cat([o[k] for o in kept]) for k in kept[0]} if kept else None
            )
        return (loss.detach().to(self.args.device) if has_labels else None), outputs

    def _from_last_stage(self, outputs: dict[str, Tensor] | None) -> dict[str, Any]:
        """The last stage's outputs on every rank of the pipeline."""
        layout = self._the_pipe().layout
        if layout.pp_group is None:
            assert outputs is not None
            return outputs
        box = [outputs]
        source = layout.global_rank(layout.stages - 1)
        dist.broadcast_object_list(box, src=source, group=layout.pp_group)
        assert box[0] is not None
        return {k: v.to(self.args.device) for k, v in box[0].items()}

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        # Trainer gathers every process's predictions; a pipeline's ranks hold the same
        # ones: gather them over the replicas only (Trainer resets its gather afterwards).
        self.gather_function = self._gather_over_replicas
        return super().evaluation_loop(*args, **kwargs)

    def _gather_over_replicas(self, tensor: Any) -> Any:
        """Every replica's `tensor` concatenated (the batch's duplicated tail dropped at the
        end of the data, as accelerate's gather_for_metrics does)."""
        group = self.mesh.dp_group
        gathered = tensor
        if group is not None:
            group = group.get_group() if hasattr(group, "get_group") else group
            parts = [torch.empty_like(tensor) for _ in range(self.mesh.dp_size)]
            dist.all_gather(parts, tensor.contiguous(), group=group)
            gathered = torch.cat(parts)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            gathered = gathered[: state.remainder]
        return gathered

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


def _own_loss(outputs: Any, _target: Any) -> Tensor:
    """The loss the model computed from its labels (its outputs' first entry)."""
    loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
    if loss is None:
        raise ValueError(
            "the model returned no loss: its inputs need labels (or pass compute_loss_func)"
        )
    return loss  # type: ignore[no-any-return]


def _counted_labels(batch: Mapping[str, Any], shifts: bool) -> Tensor:
    """The labels a loss counts, as Trainer takes them from a batch."""
    if "shift_labels" in batch:
        return batch["shift_labels"]  # type: ignore[no-any-return]
    labels = batch["labels"]
    return labels[..., 1:] if shifts else labels  # type: ignore[no-any-return]


def _count(labels: Tensor) -> Tensor:
    return (labels != -100).sum()


def _shifted_count(labels: Tensor) -> Tensor:
    return (labels[..., 1:] != -100).sum()


def _scaled(
    loss_fn: Callable[[Any, Any], Tensor], scale: float, outputs: Any, target: Any
) -> Tensor:
    return loss_fn(outputs, target) * scale if scale != 1.0 else loss_fn(outputs, target)


def _any_tensor(outputs: Any) -> Tensor:
    values = outputs.values() if isinstance(outputs, Mapping) else outputs
    return next(v for v in values if isinstance(v, Tensor))


__all__ = ["PipelineTrainer"]
