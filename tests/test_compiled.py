"""torch.compile inside the pipe: compiled blocks run compiled, exactly, on every schedule."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import compiled_cases as cases
import pytest
import torch
import torch.nn.functional as F
from cluster import Cluster, values
from torch import Tensor, nn

import gpipe_fast as gf
from gpipe_fast.nn.compiled import holds_compiled, is_compiled, uncompile
from gpipe_fast.pictures.content import hover

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv"]
MODES = ["except_last", "never", "always"]
CHUNKS = 4


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles afresh: dynamo's caches are per code object (Block.forward), so a
    graph compiled by an earlier test would otherwise be reused, uncounted."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _balance(schedule: str) -> list[int]:
    # Linear, 4 blocks, Linear: 2 cells, or 4 for the schedules running 2 cells per worker.
    return [2, 1, 1, 2] if schedule in ("interleaved", "zbv") else [3, 3]


def _block_runs(pipe: Any, balance: list[int]) -> int:
    """How many times the step's forwards and recomputes (its timeline) called a block: the
    model's layers 1 to 4."""
    blocks = []
    for cell, size in enumerate(balance):
        start = sum(balance[:cell])
        blocks.append(sum(1 <= i <= 4 for i in range(start, start + size)))
    spans = pipe.timeline().spans
    return sum(blocks[s.cell] for s in spans if s.kind in ("forward", "recompute"))


def _assert_grads_equal(net: nn.Module, want: nn.Module) -> None:
    wanted = dict(want.named_parameters())
    for name, param in net.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, wanted[name].grad, rtol=1e-10, atol=1e-12,
                                   msg=name)  # fmt: skip


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_compiled_blocks_run_compiled_and_exact(make_pipe: Any, schedule: str,
                                                 checkpoint: str) -> None:  # fmt: skip
    # Every block of every micro-batch runs its compiled graph, its recompute too, and the
    # step equals the same compiled blocks run without the pipe, dropout masks included.
    backend = cases.Counting()
    net = cases.model(backend)
    balance = _balance(schedule)
    pipe = make_pipe(net, balance, devices=["cpu"] * len(balance), chunks=CHUNKS,
                     checkpoint=checkpoint, schedule=schedule)  # fmt: skip
    x, y = cases.batch(8, seed=1)
    pipe.record_timeline()
    torch.manual_seed(5)
    loss = pipe.train_step(x, y, F.mse_loss)
    assert backend.graphs > 0
    assert backend.runs == _block_runs(pipe, balance) >= 4 * CHUNKS
    plain = cases.model(cases.Counting())
    want = cases.reference(plain, balance, x, y, CHUNKS, seed=5)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    _assert_grads_equal(net, plain)


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv"])
def test_a_compiled_backward_runs_whole_in_the_split_backward(make_pipe: Any,
                                                               schedule: str) -> None:  # fmt: skip
    # AOTAutograd compiles a block's backward as one function (input and weight gradients
    # together): backward_input runs it once, whole; the timeline says where weights went.
    backend = cases.Counting("aot_eager")
    net = cases.model(backend)
    balance = _balance(schedule)
    pipe = make_pipe(net, balance, devices=["cpu"] * len(balance), chunks=CHUNKS,
                     schedule=schedule)  # fmt: skip
    x, y = cases.batch(8, seed=2)
    pipe.record_timeline()
    torch.manual_seed(6)
    loss = pipe.train_step(x, y, F.mse_loss)
    plain = cases.model(cases.Counting("aot_eager"))
    want = cases.reference(plain, balance, x, y, CHUNKS, seed=6)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    _assert_grads_equal(net, plain)
    timeline = pipe.timeline()
    assert timeline.whole_backward == tuple(range(len(balance)))  # each cell holds a block
    weight = next(s for s in timeline.spans if s.kind == "backward_weight")
    assert "the compiled ones' came with backward_input" in hover(timeline, weight)


def test_the_pipe_call_and_its_backward_run_compiled(make_pipe: Any) -> None:
    backend = cases.Counting()
    net = cases.model(backend)
    pipe = make_pipe(net, [3, 3], devices=["cpu"] * 2, chunks=CHUNKS, checkpoint="always")
    x, y = cases.batch(8, seed=4)
    torch.manual_seed(9)
    F.mse_loss(pipe(x), y).backward()
    assert backend.runs == 4 * 2 * CHUNKS  # forward and recompute


def test_blocks_compiled_with_their_compile_method_run_compiled(make_pipe: Any) -> None:
    backend = cases.Counting()
    net = cases.model(backend, compile_as="method")
    pipe = make_pipe(net, [3, 3], devices=["cpu"] * 2, chunks=CHUNKS, checkpoint="always",
                     schedule="1f1b")  # fmt: skip
    x, y = cases.batch(8, seed=4)
    torch.manual_seed(9)
    loss = pipe.train_step(x, y, F.mse_loss)
    assert backend.runs == 4 * 2 * CHUNKS
    plain = cases.model(cases.Counting(), compile_as="method")
    want = cases.reference(plain, [3, 3], x, y, CHUNKS, seed=9)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    _assert_grads_equal(net, plain)


def test_dropout_in_a_compiled_block_is_replayed_and_drawn_per_task(make_pipe: Any) -> None:
    # Recompute draws forward's masks (always = never); micro-batches draw different ones.
    grads = []
    for checkpoint in ("never", "always"):
        net = cases.model(cases.Counting(), dropout=0.5)
        pipe = make_pipe(net, [3, 3], devices=["cpu"] * 2, chunks=CHUNKS,
                         checkpoint=checkpoint)  # fmt: skip
        x, y = cases.batch(8, seed=7)
        torch.manual_seed(3)
        pipe.train_step(x, y, F.mse_loss)
        grads.append([p.grad.clone() for p in net.parameters()])  # type: ignore[union-attr]
    for never, always in zip(*grads, strict=True):
        torch.testing.assert_close(never, always, rtol=0, atol=0)
    block = cases.model(cases.Counting(), dropout=0.5, blocks=1)
    pipe = make_pipe(nn.Sequential(block[1]), [1], devices=["cpu"], chunks=2)
    ones = torch.ones(2, 64, cases.WIDTH, dtype=torch.float64)
    out = pipe(ones)
    assert not torch.equal(out[0], out[1])


def test_recompilations_stay_bounded_as_batch_and_length_change(make_pipe: Any) -> None:
    # A block compiles once per grad mode (the checkpointed forward records no graph, its
    # recompute does) and goes dynamic at its second shape: more steps of other batch sizes
    # and lengths compile nothing more, whichever stage thread or micro-batch runs them.
    backend = cases.Counting()
    torch.manual_seed(0)
    blocks = [torch.compile(cases.Block(cases.WIDTH, 0.1), backend=backend) for _ in range(4)]
    net = nn.Sequential(nn.Linear(cases.WIDTH, cases.WIDTH), *blocks).double()
    pipe = make_pipe(net, [3, 2], devices=["cpu"] * 2, chunks=3, schedule="1f1b")
    graphs = []
    for rows, length in [(6, 5), (9, 7), (12, 3), (7, 11), (10, 6), (8, 9), (15, 4)]:
        x = torch.randn(rows, length, cases.WIDTH, dtype=torch.float64)
        pipe.train_step(x, torch.zeros_like(x), F.mse_loss)
        graphs.append(backend.graphs)
    assert graphs[-1] == graphs[2], graphs
    # 2 grad modes x (static, dynamic), and a spare: dynamo itself recompiles once more at
    # times (a guard on a tensor gone); far below its recompile limit (8 per code object).
    assert graphs[-1] <= 6, graphs


def test_a_block_run_in_the_pipe_stays_compiled_outside_it(make_pipe: Any) -> None:
    # Dynamo marks a code object it once skipped as skipped for good: a block run eagerly
    # under a dispatch mode inside the pipe would run eagerly everywhere afterwards.
    backend = cases.Counting()
    net = cases.model(backend)
    x, y = cases.batch(8, seed=1)
    F.mse_loss(net(x), y).backward()
    before = backend.runs
    assert before == 4
    pipe = make_pipe(net, [3, 3], devices=["cpu"] * 2, chunks=2)
    pipe.train_step(x, y, F.mse_loss)
    after_pipe = backend.runs
    assert after_pipe > before
    F.mse_loss(net(x), y).backward()
    assert backend.runs == after_pipe + 4


def test_the_inductor_backend_on_a_small_block(make_pipe: Any) -> None:
    # Inductor's own code: its dropout draws its seeds from the task's stream, so the pipe
    # equals the same compiled blocks without it, and checkpointing changes nothing.
    pytest.importorskip("torch._inductor")
    backend = cases.Counting("inductor")
    net = cases.model(backend, blocks=2)
    pipe = make_pipe(net, [2, 2], devices=["cpu"] * 2, chunks=2, checkpoint="except_last")
    x, y = cases.batch(4, seed=8)
    torch.manual_seed(4)
    loss = pipe.train_step(x, y, F.mse_loss)
    assert backend.graphs > 0 and backend.runs == 2 * (2 + 1)
    plain = cases.model(cases.Counting("inductor"), blocks=2)
    want = cases.reference(plain, [2, 2], x, y, 2, seed=4)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    _assert_grads_equal(net, plain)


def test_two_processes_are_exact_against_the_compiled_reference(two: Cluster) -> None:
    for reply in values(two.run("compiled_cases.train", schedule="1f1b", checkpoint="except_last",
                                balance=[3, 3], chunks=CHUNKS)):  # fmt: skip
        assert reply["loss"] == pytest.approx(reply["want"], rel=1e-12)
        assert reply["worst"] < 1e-10
        assert reply["graphs"] > 0
        assert reply["runs"] == 2 * reply["tasks"] >= 2 * CHUNKS  # two blocks per rank


# -- gf.pipeline ---------------------------------------------------------------------------


def _llama(layers: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=31, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, use_cache=False)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def _token_loss(output: Any, ids: Tensor) -> Tensor:
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pipeline_of_a_llama_whose_layers_were_compiled(schedule: str) -> None:
    pytest.importorskip("transformers")
    backend = cases.Counting()
    model = _llama()
    plain = copy.deepcopy(model)
    for layer in model.model.layers:
        layer.compile(backend=backend)
    for layer in plain.model.layers:
        layer.compile(backend=cases.Counting())
    ids = torch.randint(0, 31, (4, 9), generator=torch.Generator().manual_seed(1))
    pipe = gf.pipeline(model, {"input_ids": ids[:2]}, ["model.layers.2"], devices=["cpu"] * 2,
                       chunks=2, checkpoint="except_last", schedule=schedule)  # fmt: skip
    try:
        loss = pipe.train_step({"input_ids": ids}, ids, _token_loss)
        runs = backend.runs
        pipe.train_step({"input_ids": ids}, ids, _token_loss)
    finally:
        pipe.close()
    assert backend.graphs > 0
    assert backend.runs - runs == runs == 4 * 2 + 4 * 1  # every layer's forward; recomputes
    want = _token_loss(plain(input_ids=ids), ids)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=0)
    wanted = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, 2 * wanted[name].grad, rtol=1e-9, atol=1e-12,
                                   msg=name)  # fmt: skip


def test_a_compiled_module_holding_stage_boundaries_runs_eagerly_with_a_warning() -> None:
    pytest.importorskip("transformers")
    backend = cases.Counting()
    model = _llama()
    plain = copy.deepcopy(model)
    model.model.compile(backend=backend)  # the decoder whole: split inside it
    ids = torch.randint(0, 31, (4, 9), generator=torch.Generator().manual_seed(2))
    pipe = gf.pipeline(model, {"input_ids": ids[:2]}, ["model.layers.2"], devices=["cpu"] * 2,
                       chunks=2)  # fmt: skip
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = pipe.train_step({"input_ids": ids}, ids, _token_loss)
            pipe.train_step({"input_ids": ids}, ids, _token_loss)
    finally:
        pipe.close()
    eager = [w for w in caught if "runs eagerly inside the pipe" in str(w.message)]
    assert len(eager) == 1 and "'model'" in str(eager[0].message), [str(w.message) for w in caught]
    assert backend.runs == 0
    torch.testing.assert_close(loss, _token_loss(plain(input_ids=ids), ids), rtol=1e-10, atol=0)
    model.model(input_ids=ids)  # outside the pipe: compiled as ever
    assert backend.runs == 1


# -- nn/compiled.py ------------------------------------------------------------------------


def test_compiled_modules_are_found_and_copies_uncompiled() -> None:
    backend = cases.Counting()
    net = cases.model(backend, blocks=2)
    method = cases.model(backend, blocks=1, compile_as="method")
    assert is_compiled(net[1]) and is_compiled(method[1]) and not is_compiled(net[0])
    assert holds_compiled(net) and not holds_compiled(nn.Linear(2, 2))
    for original in (net, method):
        copied = copy.deepcopy(original)
        uncompile(copied)
        assert not any(is_compiled(m) for m in copied.modules())
        x = torch.randn(2, 4, dtype=torch.float64)
        before = backend.runs
        torch.testing.assert_close(copied.eval()(x), original.eval()(x))
        assert backend.runs == before + len(original) - 2  # the original's blocks only


def test_a_compiled_sequential_is_refused_with_what_to_do_instead() -> None:
    compiled = torch.compile(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"OptimizedModule \(torch.compile of one\): compile"):
        gf.GPipe(compiled, [1, 1], devices=["cpu", "cpu"])
