"""What a tuning's steps leave as they found it: gradients, buffers, random generators."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn


@contextmanager
def untouched(modules: Iterable[nn.Module], inputs: Sequence[Tensor]) -> Iterator[None]:
    """Runs the block with every parameter's gradient set aside (None inside) and gives
    each back afterwards, the very tensor it had; every buffer's values (running statistics)
    written back; the input's gradients, torch's random generators (the step seeds are
    drawn from them) and this thread's intra-op threads as they were. Parameters are not
    copied: training steps without an optimizer step leave them alone."""
    params: dict[int, nn.Parameter] = {}
    buffers: dict[tuple[int, str], tuple[nn.Module, str, Tensor]] = {}
    for module in modules:
        for sub in module.modules():
            for param in sub.parameters(recurse=False):
                params.setdefault(id(param), param)
            for name, buffer in sub._buffers.items():
                if buffer is not None and not buffer.is_meta:
                    buffers.setdefault((id(sub), name), (sub, name, buffer.detach().clone()))
    grads = [(param, param.grad) for param in params.values()]
    for param, _ in grads:
        param.grad = None
    input_grads = [(t, t.grad) for t in inputs if t.requires_grad]
    for tensor, _ in input_grads:  # each step adds into it: the caller's is put aside
        tensor.grad = None
    cpu_generator = torch.get_rng_state()
    cuda_generators = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        for param, grad in grads:
            # A tuning that placed layers on other GPUs gives the gradient back where the
            # parameter is now (the chosen layout puts both in place).
            param.grad = (
                grad if grad is None or grad.device == param.device else grad.to(param.device)
            )
        with torch.no_grad():
            for sub, name, value in buffers.values():
                now = sub._buffers.get(name)
                if now is not None:
                    now.copy_(value)
        for tensor, grad in input_grads:
            tensor.grad = grad
        torch.set_rng_state(cpu_generator)
        if cuda_generators is not None:
            torch.cuda.set_rng_state_all(cuda_generators)
        torch.set_num_threads(threads)
