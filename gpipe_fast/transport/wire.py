"""What travels ahead of a boundary value between processes: its structure, dtypes and shapes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gpipe_fast.transport.protocol import Payload

# A fixed-size int64 header per message, so the receiver can post it before knowing
# anything: [magic, is_tuple, count, then per entry: dtype code (-1: None), ndim, *shape].
HEADER_LENGTH = 128
MAGIC = 0x67705F66  # "gp_f"
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}


def encode(payload: Payload, device: torch.device) -> Tensor:
    """The header describing `payload`, on `device`."""
    entries: Sequence[Tensor | None] = payload if isinstance(payload, tuple) else (payload,)
    header = [MAGIC, int(isinstance(payload, tuple)), len(entries)]
    for entry in entries:
        if entry is None:
            header += [-1, 0]
            continue
        code = _CODES.get(entry.dtype)
        if code is None:
            raise TypeError(
                f"gpipe_fast cannot send tensors of dtype {entry.dtype} between processes"
            )
        header += [code, entry.dim(), *entry.shape]
    if len(header) > HEADER_LENGTH:
        raise ValueError(
            f"a boundary value of {len(entries)} tensors needs a header of {len(header)} entries; "
            f"at most {HEADER_LENGTH} fit (fewer tensors or dimensions per stage boundary)"
        )
    header += [0] * (HEADER_LENGTH - len(header))
    return torch.tensor(header, dtype=torch.int64, device=device)


def empty_header(device: torch.device) -> Tensor:
    return torch.empty(HEADER_LENGTH, dtype=torch.int64, device=device)


def layout(header: Tensor) -> tuple[bool, list[tuple[torch.dtype, tuple[int, ...]] | None]]:
    """(is_tuple, per entry its dtype and shape or None) from a received header."""
    values = header.tolist()
    if values[0] != MAGIC:
        raise RuntimeError(
            "gpipe_fast: a boundary message did not start with a gpipe_fast header: the ranks "
            "run different programs (same model, balance, chunks and schedule on every rank?)"
        )
    is_tuple, count, at = bool(values[1]), values[2], 3
    entries: list[tuple[torch.dtype, tuple[int, ...]] | None] = []
    for _ in range(count):
        code, ndim = values[at], values[at + 1]
        at += 2
        if code < 0:
            entries.append(None)
            continue
        entries.append((DTYPES[code], tuple(values[at : at + ndim])))
        at += ndim
    return is_tuple, entries


def tensors(payload: Payload) -> list[Tensor]:
    """The tensors of a payload to send, contiguous, in order (None entries skipped)."""
    entries = payload if isinstance(payload, tuple) else (payload,)
    return [t.detach().contiguous() for t in entries if t is not None]


def assemble(is_tuple: bool, entries: Sequence[Tensor | None]) -> Payload:
    return tuple(entries) if is_tuple else entries[0]  # type: ignore[return-value]
