"""PipelineTrainer's evaluation: Trainer's predictions through the pipe's eval_step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers.trainer_pt_utils import nested_detach

from gpipe_fast.integrations.transformers.losses import PipeLosses


class PipeEvaluation(PipeLosses):
    """Trainer's ``evaluate`` and ``predict`` through the pipe: each batch's loss from its
    ``eval_step``, its outputs from the last stage given to every rank of the pipeline,
    predictions gathered over the replicas only. Reads PipelineTrainer's ``_the_pipe()``
    and ``mesh``."""

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


def _any_tensor(outputs: Any) -> Tensor:
    values = outputs.values() if isinstance(outputs, Mapping) else outputs
    return next(v for v in values if isinstance(v, Tensor))
