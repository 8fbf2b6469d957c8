"""A transformers LlamaForCausalLM through gf.pipeline on one GPU: exact against the plain model
(float64), its training step against the plain model's (float32, TF32), and whether blocks
that the user `.compile()`d run compiled inside the pipe (a counting backend over inductor)."""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gpu_harness as harness
import torch
from reporting import fmt, markdown_table, median, paired_ratio, ratio
from torch import Tensor, nn
from torch.nn import functional as F

import gpipe_fast as gf

NAME = "transformers"


@dataclass(frozen=True)
class Config:
    width: int
    layers: int
    heads: int
    tokens: int
    batch: int
    chunks: int
    schedules: tuple[str, ...]
    rounds: int
    warmup: int
    time_box_s: float
    compile_backend: str | None  # None: the compiled part is skipped


SCALES = {
    "full": Config(
        width=1024,
        layers=8,
        heads=16,
        tokens=1024,
        batch=16,
        chunks=4,
        schedules=("gpipe", "1f1b"),
        rounds=10,
        warmup=2,
        time_box_s=60,
        compile_backend="inductor",
    ),
    "quick": Config(
        width=512,
        layers=4,
        heads=8,
        tokens=512,
        batch=8,
        chunks=4,
        schedules=("1f1b",),
        rounds=5,
        warmup=1,
        time_box_s=30,
        compile_backend="inductor",
    ),
    # CPU only, for tests: the code path at toy sizes ("eager": dynamo without inductor).
    "smoke": Config(
        width=32,
        layers=2,
        heads=2,
        tokens=8,
        batch=4,
        chunks=2,
        schedules=("1f1b",),
        rounds=1,
        warmup=1,
        time_box_s=10,
        compile_backend="eager",
    ),
}
VOCAB = 1000
EXACT_WIDTH, EXACT_LAYERS, EXACT_TOKENS, EXACT_BATCH = 64, 4, 16, 8


def llama(width: int, layers: int, heads: int, tokens: int, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=4 * width,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), max_position_embeddings=tokens, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def batch_of(rows: int, tokens: int, device: torch.device) -> dict[str, Tensor]:
    ids = torch.randint(0, VOCAB, (rows, tokens), device=device)
    return {"input_ids": ids, "labels": ids}


def model_loss(output: Any, _target: None) -> Tensor:
    return output.loss  # type: ignore[no-any-return]


def make_pipe(model: nn.Module, example: dict[str, Tensor], chunks: int, schedule: str,
              device: torch.device) -> Any:  # fmt: skip
    """gf.pipeline of `model`: 2 cells on `device`, split at its middle decoder layer."""
    middle = f"model.layers.{len(model.model.layers) // 2}"
    return gf.pipeline(model, example, [middle], devices=[str(device)] * 2, chunks=chunks,
                       checkpoint="never", schedule=schedule)  # fmt: skip


def token_loss(output: Any, ids: Tensor) -> Tensor:
    """Next-token cross entropy in the logits' own dtype (transformers' `labels` loss upcasts
    to float32 only, which would hide a float64 difference)."""
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def exactness(device: torch.device) -> dict[str, Any]:
    """Loss and every gradient of gf.pipeline (2 cells, 4 micro-batches) against the plain
    model on the whole batch, float64, fresh random tokens."""
    model = llama(EXACT_WIDTH, EXACT_LAYERS, 4, EXACT_TOKENS).double().to(device)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (EXACT_BATCH, EXACT_TOKENS), device=device)
    want = token_loss(reference(input_ids=ids), ids)
    want.backward()
    pipe = make_pipe(model, {"input_ids": ids[:2]}, 4, "1f1b", device)
    try:
        got = pipe.train_step({"input_ids": ids}, ids, token_loss)
    finally:
        pipe.close()
    grads = dict(reference.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        expected = grads[name].grad
        assert param.grad is not None and expected is not None, name
        scale = expected.abs().max().item() or 1.0
        worst = max(worst, (param.grad - expected).abs().max().item() / scale)
    return {
        "loss_relative_difference": abs(got.item() - want.item()) / abs(want.item()),
        "max_relative_grad_difference": worst,
        "parameters": len(grads),
    }


class CountingBackend:
    """A torch.compile backend that counts the graphs it compiles and their runs, each
    compiled by `inner` ("inductor", or "eager" for dynamo alone)."""

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.graphs = 0
        self.runs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable:
        self.graphs += 1
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(graph, example_inputs)
        else:
            compiled = graph.forward

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run


def _step(model: nn.Module, batch: dict[str, Tensor]) -> Callable[[], None]:
    def run() -> None:
        model(**batch).loss.backward()
        for p in model.parameters():
            p.grad = None

    return run


def _pipe_step(pipe: Any, batch: dict[str, Tensor]) -> Callable[[], None]:
    def run() -> None:
        pipe.train_step(batch, None, model_loss)
        for p in pipe.parameters():
            p.grad = None

    return run


def _rounds(
    steps: dict[str, Callable[[], float]], cfg: Config, compiled: CountingBackend | None
) -> tuple[dict[str, list[float]], dict[str, dict[str, Any]]]:
    """Each contender's first step timed apart (compilation happens there), then interleaved
    rounds; with `compiled`, the graphs each first step compiled and the compiled runs of one
    step after the rounds (0: the blocks ran eagerly)."""
    counts: dict[str, dict[str, Any]] = {}
    for name, step in steps.items():
        before = (compiled.graphs, compiled.runs) if compiled else (0, 0)
        first = step()
        if compiled is not None:
            counts[name] = {"first_step_s": first, "graphs_compiled": compiled.graphs - before[0]}
    samples = harness.interleaved_rounds(
        steps, rounds=cfg.rounds, warmup=cfg.warmup, min_rounds=1,
        deadline=time.monotonic() + cfg.time_box_s,
    )  # fmt: skip
    if compiled is not None:
        for name, step in steps.items():
            before_runs = compiled.runs
            step()
            counts[name]["compiled_runs_per_step"] = compiled.runs - before_runs
    return samples, counts


def measure(device: torch.device, cfg: Config) -> harness.Section:
    exact = exactness(device)
    harness.release_memory(device)
    base = llama(cfg.width, cfg.layers, cfg.heads, cfg.tokens).to(device)
    batch = batch_of(cfg.batch, cfg.tokens, device)
    example = {k: v[: cfg.batch // cfg.chunks] for k, v in batch.items()}

    def model_copy(compiled: CountingBackend | None) -> nn.Module:
        model = copy.deepcopy(base)
        for layer in model.model.layers if compiled is not None else ():
            layer.compile(backend=compiled)
        return model

    def pipe_steps(compiled: CountingBackend | None) -> dict[str, Callable[[], float]]:
        tag = "" if compiled is None else ", compiled blocks"
        steps = {}
        for schedule in cfg.schedules:
            pipe = make_pipe(model_copy(compiled), example, cfg.chunks, schedule, device)
            pipes.append(pipe)
            steps[f"gf.pipeline {schedule}{tag}"] = harness.timed(_pipe_step(pipe, batch), device)
        return steps

    pipes: list[Any] = []
    samples: dict[str, list[float]] = {}
    counts: dict[str, dict[str, Any]] = {}
    try:
        # Eager: the plain model and the pipes, interleaved round by round.
        eager = {"plain": harness.timed(_step(model_copy(None), batch), device)}
        found, _ = _rounds({**eager, **pipe_steps(None)}, cfg, None)
        samples.update(found)
        if cfg.compile_backend is not None:
            # Compiled: the plain model's rounds first and alone, because a compiled block that
            # once ran eagerly inside the pipe stays eager outside it too (issue 41).
            compiled = CountingBackend(cfg.compile_backend)
            plain = {"plain, compiled blocks": harness.timed(
                _step(model_copy(compiled), batch), device)}  # fmt: skip
            for steps in (plain, pipe_steps(compiled)):
                found, seen = _rounds(steps, cfg, compiled)
                samples.update(found)
                counts.update(seen)
    finally:
        for pipe in pipes:
            pipe.close()
        harness.release_memory(device)

    reference = samples["plain"]
    rows = []
    contenders = {}
    for name, values in samples.items():
        entry = {
            "samples_s": values,
            "median_s": median(values),
            "vs_plain": ratio(median(values), median(reference)),
            **counts.get(name, {}),
        }
        if name in eager or "compiled" not in name:  # interleaved with the plain model's
            entry["paired_vs_plain"] = paired_ratio(values, reference)
        contenders[name] = entry
        rows.append((name, fmt(entry["median_s"] * 1e3, 1), fmt(entry["vs_plain"], 3),
                     fmt(entry.get("paired_vs_plain"), 3), entry.get("graphs_compiled", ""),
                     entry.get("compiled_runs_per_step", "")))  # fmt: skip
    table = markdown_table(
        ("contender", "median ms", "vs plain (eager)", "paired vs plain", "graphs compiled",
         "compiled runs per step"), rows,
    )  # fmt: skip
    table += (
        f"\n\nExact (float64, 2 cells, 4 micro-batches, 1f1b, next-token cross entropy): loss "
        f"off by {exact['loss_relative_difference']:.1e}, gradients by "
        f"{exact['max_relative_grad_difference']:.1e} (max relative). Step: LlamaForCausalLM "
        f"hidden {cfg.width}, {cfg.layers} layers, {cfg.tokens} tokens x {cfg.batch}, its own "
        f"loss (labels) and backward, float32 (TF32), gf.pipeline split at "
        f"model.layers.{cfg.layers // 2} into 2 cells on {device}, {cfg.chunks} micro-batches, "
        f"checkpoint never; compiled: each decoder layer .compile()d "
        f"({cfg.compile_backend}), the plain model timed before any pipe ran"
    )
    return harness.Section({"exactness": exact, "contenders": contenders}, table)


measurement, main = harness.scaled_script(__file__, __doc__, NAME, SCALES, measure)


if __name__ == "__main__":
    sys.exit(main())
