"""Whether a value is a DTensor, without importing torch.distributed.tensor to ask."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """Whether `value` is a DTensor. Until torch.distributed.tensor is imported (by FSDP, by
    transformers, by the user) no value can be one, and importing it costs about 0.7 s, so
    `import gpipe_fast` leaves it out."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)
