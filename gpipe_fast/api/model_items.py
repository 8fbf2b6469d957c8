"""What a transformers model's own loss averages over, and whether it takes that count.

The labels it counts (a causal LM's shifted by one), and whether its forward divides by the
count it is given (``num_items_in_batch``), as transformers' Trainer finds out."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModelLoss:
    """A transformers model's own loss from ``labels``: its class name, whether it shifts
    the labels by one (a causal LM predicts token t+1 at t: the first label of each row is
    never a target) and whether its forward takes ``num_items_in_batch`` and divides its
    loss's sum by it. `router_loss`: its config adds an auxiliary loss per forward
    (``output_router_logits``, a mixture of experts' load balancing), which a count does not
    divide."""

    name: str
    shifts: bool
    takes_count: bool
    router_loss: bool = False


def model_loss(model: nn.Module) -> ModelLoss | None:
    """How `model` computes its own loss, for a transformers ``PreTrainedModel``; None for
    any other model (whose loss the pipe cannot know)."""
    if "transformers" not in sys.modules:  # a model of it has imported it: no import here
        return None
    try:
        from transformers import PreTrainedModel
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:  # pragma: no cover - transformers is optional
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    # model.loss_function, without the warning its property logs when loss_type is unset
    # (GPT2LMHeadModel's): the function it sets, or its type's, or ForCausalLMLoss.
    function = model.__dict__.get("_loss_function")
    if function is None:
        loss_type = getattr(model, "loss_type", None)
        function = LOSS_MAPPING.get(loss_type, ForCausalLMLoss) if loss_type else ForCausalLMLoss
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    # An encoder-decoder model's labels are its decoder's targets as they are (its decoder
    # takes them shifted right as inputs): the Trainer's rule, and T5's and BART's losses.
    shifts = function is ForCausalLMLoss and not encoder_decoder
    router_loss = bool(getattr(model.config, "output_router_logits", False))
    return ModelLoss(type(model).__name__, shifts, _takes_count(model), router_loss)


def _takes_count(model: nn.Module) -> bool:
    """Whether the model's forward passes ``num_items_in_batch`` on to its loss: it accepts
    the keyword (the model's ``accepts_loss_kwargs``, else a ``**kwargs`` or the named
    parameter, as the Trainer checks) and computes its loss with ``self.loss_function``, which
    divides by it. T5 and BART accept ``**kwargs`` but compute a plain mean themselves."""
    forward = type(model).forward
    parameters = inspect.signature(forward).parameters
    if "num_items_in_batch" in parameters:
        return True
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if not accepts:
        return False
    try:
        source = inspect.getsource(inspect.unwrap(forward))
    except (OSError, TypeError):  # no source to read: not known to divide
        return False
    return "self.loss_function(" in source
