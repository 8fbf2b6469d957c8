"""Cases of models built on the meta device with a non-persistent buffer (as a rotary
embedding's inv_freq), across ranks (tests/test_materialize_processes.py) and in one process
(tests/test_materialize.py)."""

from __future__ import annotations

import gc
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf

WIDTH = 5
BALANCE = [3, 3]  # the layer at position 1 is rank 0's, at position 4 rank 1's


class Frequencies(nn.Module):
    """Modulates its input by fixed frequencies, a buffer made in __init__ and left out of
    the state dict (register_buffer(..., persistent=False)), as a rotary embedding does."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.register_buffer("freq", frequencies(width), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.cos(self.freq) + torch.sin(self.freq)


def frequencies(width: int) -> torch.Tensor:
    return 1.0 / 10.0 ** (torch.arange(width, dtype=torch.float64) / width)


def refill(module: nn.Module) -> None:
    """An init_fn: re-creates the Frequencies' buffer (no state dict holds it)."""
    if isinstance(module, Frequencies):
        module.freq.copy_(frequencies(module.freq.numel()))


def model(position: int) -> nn.Sequential:
    """Linear, Tanh, Linear, Tanh, Linear in float64 (the same weights every time), with a
    Frequencies layer inserted at `position` (1 or 4)."""
    torch.manual_seed(3)
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                               nn.Tanh(), nn.Linear(WIDTH, WIDTH)]  # fmt: skip
    layers.insert(position, Frequencies())
    return nn.Sequential(*layers).double()


def batch(size: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(size, WIDTH, generator=generator, dtype=torch.float64)
    return x, torch.randn(size, WIDTH, generator=generator, dtype=torch.float64)


def _meta_pipe(position: int, init_fn: Any, transport: str, **kwargs: Any) -> gf.GPipe:
    """The model built on the meta device, over the world's ranks, then loaded with the
    plain model's state dict (which does not hold the buffer)."""
    with torch.device("meta"):
        meta = model(position)
    saved = os.environ.get("GPIPE_FAST_TRANSPORT")
    if transport == "gloo":
        os.environ["GPIPE_FAST_TRANSPORT"] = "gloo"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the warning is tested in one process
            pipe = gf.GPipe(meta, BALANCE, chunks=3, pp_group=dist.group.WORLD, timeout=60,
                            init_fn=init_fn, **kwargs)  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop("GPIPE_FAST_TRANSPORT", None)
        else:
            os.environ["GPIPE_FAST_TRANSPORT"] = saved
    pipe.load_state_dict(model(position).state_dict())
    return pipe


def refused(
    rank: int, world: int, *, position: int, call: str, transport: str, late: int | None = None
) -> dict[str, Any]:
    """A step (`call`: train_step, eval_step, or pipe(x) under no_grad) of the pipe whose
    buffer holds no values, rank `late` starting it a while after the others: what each rank
    raised, and the transport. The pipe is then collected at once: a collective the step
    left pending would hang gloo's destructor of its group here, not in a later case."""
    pipe = _meta_pipe(position, None, transport)
    x, y = batch()
    if rank == late:
        time.sleep(0.5)  # the refusing rank's report is in the store before this rank starts
    try:
        if call == "train_step":
            pipe.train_step(x, y, nn.functional.mse_loss)
        elif call == "eval_step":
            pipe.eval_step(x, y, nn.functional.mse_loss)
        else:
            with torch.no_grad():
                pipe(x)
        error = ("none", "")
    except Exception as caught:
        error = (type(caught).__name__, str(caught))
    finally:
        pipe.close()
    transport_kind = pipe.transport_kind
    del pipe
    gc.collect()
    return {"error": error, "transport": transport_kind}


def filled(rank: int, world: int, *, position: int, schedule: str) -> dict[str, Any]:
    """A step of the pipe whose buffer init_fn re-created: the loss, this rank's gradients
    and its buffers."""
    pipe = _meta_pipe(position, refill, "shared memory", schedule=schedule)
    try:
        loss = pipe.train_step(*batch(), nn.functional.mse_loss)
    finally:
        pipe.close()
    grads = {name: p.grad.tolist() for name, p in pipe.named_parameters() if p.grad is not None}
    buffers = {name: b.tolist() for name, b in pipe.named_buffers()}
    return {"loss": loss.item(), "grads": grads, "buffers": buffers}
