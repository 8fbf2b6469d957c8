"""An input's signature: the shapes and dtypes of its tensors, hashed alike in every process."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from torch import Tensor


def input_signature(tensors: Sequence[Tensor]) -> int:
    """A positive int64 of the tensors' shapes and dtypes (an "auto" pipe's choice is kept
    per signature); the same in every process, where Python's own str hash is salted."""
    shapes = repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()
    return int.from_bytes(hashlib.blake2b(shapes, digest_size=8).digest(), "big") >> 2
