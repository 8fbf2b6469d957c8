"""The header of a boundary value between processes, and small tensors carried inside it."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from gpipe_fast.transport.packed import Packed, pack, unpack
from gpipe_fast.transport.protocol import Payload

# A fixed-size int64 header per message, so the receiver can post it before knowing
# anything: [magic, form, count, then per entry: dtype code (-1: None), ndim, *shape].
HEADER_LENGTH = 128
# What the entries make, a message's form: a lone tensor, a plain tuple of tensors and None
# (the common cases, described by the header alone), or any other pytree (Packed: its
# tensors, then a uint8 entry holding its structure and other leaves pickled).
TENSOR, TUPLE, TREE = 0, 1, 2
MAGIC = 0x67705F66  # "gp_f"
# The magic of a header whose message also carries the tensors (`inline_bytes` of room after
# the header, each tensor at an offset aligned to ALIGN): one message, one round trip, where
# a header and then the tensors would take two (small tensors are dominated by it).
MAGIC_INLINE = 0x67705F69  # "gp_i"
ALIGN = 16
# The room for inline tensors in a message between CPU processes (gloo): an 8 KiB activation
# travels with its header.
INLINE_BYTES = 32 * 1024
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


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def packed(payload: Payload) -> Payload:
    """`payload` as message entries: itself when a lone tensor or a plain tuple of tensors
    and None (also when already packed), else its Packed entries. Sending a payload packs
    it; a sender that both encodes and sends the tensors packs it once, first."""
    if isinstance(payload, Tensor):
        return payload
    cls = type(payload)
    if cls is tuple:
        for entry in payload:  # a loop, not all(): this runs on every message
            if entry is not None and not isinstance(entry, Tensor):
                return pack(payload)
        return payload
    return payload if cls is Packed else pack(payload)


def _header_words(payload: Payload, inline: bool) -> list[int]:
    """The header's words (HEADER_LENGTH of them) describing `payload` (packed)."""
    entries: Sequence[Tensor | None] = payload if isinstance(payload, tuple) else (payload,)
    form = TREE if type(payload) is Packed else TUPLE if isinstance(payload, tuple) else TENSOR
    header = [MAGIC_INLINE if inline else MAGIC, form, len(entries)]
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
    return header + [0] * (HEADER_LENGTH - len(header))


def encode(payload: Payload, device: torch.device, inline_bytes: int = 0) -> Tensor:
    """The header describing `payload`, on `device`, followed by `inline_bytes` of room that
    holds the tensors themselves when they fit (inline: then nothing follows the message)."""
    payload = packed(payload)
    entries: Sequence[Tensor | None] = payload if isinstance(payload, tuple) else (payload,)
    sizes = [_aligned(t.numel() * t.element_size()) for t in entries if t is not None]
    inline = inline_bytes > 0 and sum(sizes) <= inline_bytes
    header = _header_words(payload, inline)
    message = torch.empty(HEADER_LENGTH + inline_bytes // 8, dtype=torch.int64, device=device)
    message[:HEADER_LENGTH] = torch.tensor(header, dtype=torch.int64)
    if inline:
        room = message[HEADER_LENGTH:].view(torch.uint8)
        at = 0
        for entry, size in zip(_contiguous(payload), sizes, strict=True):
            nbytes = entry.numel() * entry.element_size()
            room[at : at + nbytes].copy_(entry.reshape(-1).view(torch.uint8))
            at += size
    return message


class Gathered(NamedTuple):
    """A shared-memory message of a payload as the (address, bytes) parts a ring copies in:
    its header in host memory, then each tensor (at an ALIGN-ed offset, as `message` reads).
    The addresses point into `owners` (the header and the contiguous tensors: a tensor that
    was not contiguous is a copy that nothing else holds), so they are valid only while this
    object lives: a sender keeps it until the ring has copied them."""

    parts: list[tuple[int, int]]
    owners: tuple[object, ...]


def gather(payload: Payload) -> Gathered:
    """`payload` as the parts of one shared-memory message, with what owns their bytes."""
    payload = packed(payload)
    header = array("q", _header_words(payload, inline=True))
    contiguous = _contiguous(payload)
    parts = [(header.buffer_info()[0], len(header) * header.itemsize)]
    parts += [(t.data_ptr(), t.numel() * t.element_size()) for t in contiguous]
    return Gathered(parts, (header, *contiguous))


def message(buffer: Any) -> Payload:
    """The payload of an inline message received whole in `buffer` (any object with the
    buffer protocol, kept alive by the tensors, which are views of it)."""
    words = memoryview(buffer).cast("B")[: HEADER_LENGTH * 8].cast("q")
    form, entries = _entries(words.tolist())
    out: list[Tensor | None] = []
    at = HEADER_LENGTH * 8
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        dtype, shape = entry
        count = torch.Size(shape).numel()
        if count == 0:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        out.append(torch.frombuffer(buffer, dtype=dtype, count=count, offset=at).view(shape))
        at += _aligned(count * dtype.itemsize)
    return assemble(form, out)


def empty_header(device: torch.device, inline_bytes: int = 0) -> Tensor:
    return torch.empty(HEADER_LENGTH + inline_bytes // 8, dtype=torch.int64, device=device)


def is_inline(header: Tensor) -> bool:
    """Whether the message of `header` carried its tensors (read by `message`). A message with no
    room after its header never does: it is not read, so a CUDA header costs no sync."""
    return header.numel() > HEADER_LENGTH and int(header[0].item()) == MAGIC_INLINE


Entry = tuple[torch.dtype, tuple[int, ...]] | None  # a tensor's dtype and shape, or None


def read_header(header: Tensor) -> tuple[int, list[Entry]]:
    """(form, per entry its dtype and shape or None) from a received header."""
    return _entries(header[:HEADER_LENGTH].tolist())


def _entries(values: list[int]) -> tuple[int, list[Entry]]:
    if values[0] not in (MAGIC, MAGIC_INLINE):
        raise RuntimeError(
            "gpipe_fast: a boundary message did not start with a gpipe_fast header: the ranks "
            "run different programs (same model, balance, chunks and schedule on every rank?)"
        )
    form, count, at = values[1], values[2], 3
    entries: list[Entry] = []
    for _ in range(count):
        code, ndim = values[at], values[at + 1]
        at += 2
        if code < 0:
            entries.append(None)
            continue
        entries.append((DTYPES[code], tuple(values[at : at + ndim])))
        at += ndim
    return form, entries


def tensors(payload: Payload, device: torch.device | None = None) -> list[Tensor]:
    """The tensors of a payload to send (packed), contiguous, in order (None entries
    skipped); a packed pytree's pickled entry moved to `device` (NCCL sends from there)."""
    payload = packed(payload)
    out = _contiguous(payload)
    if type(payload) is Packed and device is not None:
        out[-1] = out[-1].to(device)
    return out


def _contiguous(payload: Payload) -> list[Tensor]:
    entries = payload if isinstance(payload, tuple) else (payload,)
    return [t.detach().contiguous() for t in entries if t is not None]


def assemble(form: int, entries: Sequence[Tensor | None]) -> Payload:
    """The payload of a message of `form` whose entries were received."""
    if form == TREE:
        return unpack(entries)
    return tuple(entries) if form == TUPLE else entries[0]
