"""The engine on CUDA: exact gradients with cells sharing a GPU or on several, autocast,
no host synchronisation in a step, and stream ordering that a device-side sleep (calibrated
per GPU, with a control showing it exposes a missing wait) would expose. Skipped without a
GPU (first run on one H200, 2026-11-26: bench/README.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_fast.api.gpipe import pipeline_of

from helpers import assert_same_run, device_sleep_cycles, mlp, pipe_run, reference_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BALANCES = {1: [6], 2: [3, 3], 4: [2, 1, 2, 1]}


def _devices(cells: int, spread: bool) -> list[str]:
    count = torch.cuda.device_count() if spread else 1
    return [f"cuda:{k % count}" for k in range(cells)]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("cells", [1, 2, 4])
@pytest.mark.parametrize("spread", [False, True], ids=["one-gpu", "all-gpus"])
def test_matches_unpartitioned_module(make_pipe, cells: int, checkpoint: str, spread: bool) -> None:
    if spread and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    module = mlp(3).cuda()
    x = torch.randn(11, 6, dtype=torch.float64, device="cuda")
    want = reference_run(module, x)
    pipe = make_pipe(
        module, BALANCES[cells], devices=_devices(cells, spread), chunks=4, checkpoint=checkpoint
    )
    assert_same_run(pipe_run(pipe, module, x), want)


def test_bf16_autocast_matches_the_plain_module_under_autocast(make_pipe) -> None:
    module = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).cuda()
    x = torch.randn(32, 64, device="cuda")
    reference = [p.detach().clone().requires_grad_() for p in module.parameters()]
    pipe = make_pipe(module, [2, 2], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint="always")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = pipe(x)
        want = x
        for i in range(4):
            want = nn.functional.linear(want, reference[2 * i], reference[2 * i + 1])
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    want.float().sum().backward()
    for got, ref in zip(module.parameters(), reference, strict=True):
        torch.testing.assert_close(got.grad, ref.grad, rtol=5e-2, atol=5e-2)


def test_step_needs_no_host_synchronisation(make_pipe) -> None:
    module = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]).cuda()
    pipe = make_pipe(module, [2, 2], devices=["cuda:0", "cuda:0"], chunks=4)
    x = torch.randn(16, 32, device="cuda")
    pipe(x).sum().backward()  # warm-up: lazy initialisation may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pipe(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("wait", [True, False], ids=["event-wait", "control-without"])
def test_a_device_sleep_exposes_a_missing_stream_wait(wait: bool) -> None:
    """The control for the tests below: a consumer stream reads what a producer stream writes
    behind a 100 ms device-side sleep. With an event wait it reads the values; without one
    it reads the buffer unwritten, every time. So a cell that failed to wait for its
    producer would fail those tests, rather than pass by luck of timing."""
    cycles, _ = device_sleep_cycles(100)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    source = torch.randn(1 << 16, device="cuda")
    written = torch.zeros_like(source)
    read = torch.full_like(source, -1.0)
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(cycles)
        written.copy_(source)
        done = torch.cuda.Event()
        done.record()
    with torch.cuda.stream(consumer):
        if wait:
            consumer.wait_event(done)
        read.copy_(written)
    torch.cuda.synchronize()
    assert torch.equal(read, source) if wait else torch.equal(read, torch.zeros_like(source))


class _SlowDouble(nn.Module):
    """Doubles its input after keeping its stream busy for about 50 ms: a consumer that did
    not wait on this cell's stream would read the result before it is written."""

    def __init__(self) -> None:
        super().__init__()
        self.cycles, _ = device_sleep_cycles(50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return x * 2


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_cells_wait_for_their_producers_streams(make_pipe, checkpoint: str) -> None:
    module = nn.Sequential(_SlowDouble(), nn.Linear(8, 8)).cuda()
    x = torch.randn(8, 8, device="cuda", requires_grad=True)
    pipe = make_pipe(module, [1, 1], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint=checkpoint)
    out = pipe(x)
    want = module[1](x.detach() * 2)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    torch.testing.assert_close(x.grad, (module[1].weight.sum(0) * 2).expand_as(x))


def test_each_cell_has_its_own_stream(make_pipe) -> None:
    pipe = make_pipe(
        nn.Sequential(nn.Identity(), nn.Identity(), nn.Identity()),
        [1, 1, 1],
        devices=["cuda:0"] * 3,
    )
    streams = pipeline_of(pipe).streams.streams
    assert all(s is not None for s in streams)
    assert len({s.cuda_stream for s in streams}) == 3
    assert pipeline_of(pipe).executor.backend == "cuda"
    pipe(torch.randn(4, 2, device="cuda"))
    assert pipeline_of(pipe).executor.live_events == 0


def test_cell_zero_waits_for_the_callers_input(make_pipe) -> None:
    """The input is written behind a long device-side sleep on the caller's stream: a first
    cell that did not wait for the caller would read it unwritten."""
    module = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).cuda()
    pipe = make_pipe(module, [1, 1], devices=["cuda:0", "cuda:0"], chunks=4)
    source = torch.randn(32, 64, device="cuda")
    x = torch.empty_like(source)
    cycles, _ = device_sleep_cycles(100)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    x.copy_(source)
    out = pipe(x)
    torch.testing.assert_close(out, module(source))


def test_boundary_copies_use_the_copy_streams_and_give_their_events_back(make_pipe) -> None:
    module = mlp(3).cuda()
    pipe = make_pipe(module, [2, 2, 2], devices=["cuda:0"] * 3, chunks=4, checkpoint="always")
    streams = pipeline_of(pipe).streams
    assert len({s.cuda_stream for s in streams.streams + streams.copy_streams}) == 6
    x = torch.randn(8, 6, dtype=torch.float64, device="cuda", requires_grad=True)
    for _ in range(3):
        pipe(x).sum().backward()
    assert streams.copier.live_events == 0
    # Forward and backward crossed the boundaries through the copier, whose events are given
    # back at once: at most one per cell's worker at a time, so the pool stays that small.
    assert 0 < streams.copier.pooled_events <= 3


# -- random streams and compiled blocks on a GPU (issues 41, 42) -----------------------------


class _Attention(nn.Module):
    """Self-attention through F.scaled_dot_product_attention with dropout: on a GPU a fused
    kernel (flash, memory-efficient) that draws from the device's generator, taking none."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 4, -1).permute(2, 0, 3, 1, 4)
        p = 0.3 if self.training else 0.0
        out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return x + out.transpose(1, 2).reshape(x.shape)


def _never_and_always(make_pipe, make, x: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    steps = []
    for checkpoint in ("never", "always"):
        module = make().to(x.device, x.dtype)
        pipe = make_pipe(module, [2, 2], devices=["cuda:0"] * 2, chunks=4,
                         checkpoint=checkpoint, schedule="1f1b")  # fmt: skip
        torch.manual_seed(3)
        loss = pipe.train_step(x, torch.zeros_like(x), nn.functional.mse_loss)
        steps.append((loss, [p.grad.clone() for p in module.parameters()]))
    assert torch.equal(steps[0][0], steps[1][0])
    for never, always in zip(steps[0][1], steps[1][1], strict=True):
        assert torch.equal(never, always)


def _dropouts() -> nn.Sequential:
    torch.manual_seed(0)  # nn.Dropout on a GPU: native_dropout, which takes no generator
    return nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.3), nn.Linear(32, 32), nn.Dropout(0.3))


def _attentions() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Attention(), nn.Linear(32, 32), _Attention(), nn.Linear(32, 32))


def test_fused_dropout_kernels_replay_their_masks(make_pipe) -> None:
    # The recompute draws forward's masks from the task's stream of the GPU's generator.
    _never_and_always(make_pipe, _dropouts, torch.randn(16, 32, dtype=torch.float64,
                                                        device="cuda"))  # fmt: skip
    for dtype in (torch.bfloat16, torch.float32):  # flash, memory-efficient attention
        _never_and_always(make_pipe, _attentions, torch.randn(8, 16, 32, dtype=dtype,
                                                              device="cuda"))  # fmt: skip


def test_compiled_blocks_with_dropout_run_compiled_and_exact_on_a_gpu(make_pipe) -> None:
    import compiled_cases

    torch._dynamo.reset()
    backend = compiled_cases.Counting("inductor")
    net = compiled_cases.model(backend, blocks=2).cuda()
    pipe = make_pipe(net, [2, 2], devices=["cuda:0"] * 2, chunks=2, schedule="zero_bubble")
    x, y = (t.cuda() for t in compiled_cases.batch(4, seed=8))
    torch.manual_seed(4)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    assert backend.graphs > 0 and backend.runs > 0
    plain = compiled_cases.model(compiled_cases.Counting("inductor"), blocks=2).cuda()
    want = compiled_cases.reference(plain, [2, 2], x, y, 2, seed=4)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    for got, expected in zip(net.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-9, atol=1e-12)
