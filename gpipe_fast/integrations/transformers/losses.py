"""How PipelineTrainer makes a batch's loss: the model's own, or Trainer's from the labels."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import Trainer

from gpipe_fast.nn.items import ItemMean


class PipeLosses(Trainer):  # type: ignore[misc]
    """PipelineTrainer's losses, as Trainer makes them: the model's own from its labels
    (counted as Trainer counts them), or ``compute_loss_func`` or label smoothing applied to
    each micro-batch's outputs and labels. Reads PipelineTrainer's ``mesh``."""

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


def scaled(
    loss_fn: Callable[[Any, Any], Tensor], scale: float, outputs: Any, target: Any
) -> Tensor:
    return loss_fn(outputs, target) * scale if scale != 1.0 else loss_fn(outputs, target)
