"""torch.compile inside gf.pipeline: a transformers LLaMA whose decoder layers run eagerly or
`.compile()`d (inductor), side by side, through gf.pipeline in one process (2 cells) and in
two (one cell each, gloo), on the CPU or (one process, 2 cells on one GPU) on a GPU.

Each contender has its own copy of the same weights; each compiled one its own counting
backend over the backend asked for (inductor by default), which counts the graphs compiled
and the compiled runs. A step is `train_step` of the model's own loss (`labels`) and its
backward, gradients dropped after it; no optimizer. Contenders in one process: the plain
model eager and compiled, gf.pipeline with 1f1b and with zero_bubble, eager and compiled
(split at the middle decoder layer, 4 micro-batches, checkpoint "never"). Across two
processes: the four pipes, every rank timing its step from a barrier (a step takes the
slower rank's time). The first step of each contender is timed apart (compilation happens
there: "first step"), then interleaved rounds, order rotated, inside a time box; medians,
the compiled/eager ratio per round (paired) and the ratio of medians to the plain eager
model; zero_bubble against 1f1b, which tells what the split backward is worth with compiled
blocks (their whole backward runs in backward_input: a compiled backward is one function).
Then one step of a float64 copy, compiled, against the plain compiled model: exactness.

    python bench/compiled.py                      # CPU: 1 and 2 processes
    python bench/compiled.py --device cuda --quick  # one GPU, about 3 minutes
    python bench/compiled.py --smoke              # toy sizes, the code path only
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reporting import (
    Record,
    default_out_path,
    environment,
    fmt,
    markdown_table,
    median,
    paired_ratio,
    ratio,
    spawned_ranks,
    watchdog,
)

import gpipe_fast as gf

VOCAB = 1000
SCHEDULES = ("1f1b", "zero_bubble")


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    tokens: int
    batch: int
    chunks: int
    rounds: int
    warmup: int
    box_s: float  # the rounds of one section stop past this


SCALES = {
    # One GPU: what bench/gpu_transformers.py steps, 2 cells sharing it.
    "cuda": Size(1024, 8, 16, 1024, 16, 4, rounds=10, warmup=2, box_s=60),
    "cuda-quick": Size(1024, 4, 16, 1024, 8, 4, rounds=5, warmup=1, box_s=30),
    "cpu": Size(256, 4, 8, 128, 8, 4, rounds=6, warmup=1, box_s=120),
    "cpu-quick": Size(128, 4, 4, 64, 8, 4, rounds=3, warmup=1, box_s=60),
    "smoke": Size(32, 2, 2, 8, 4, 2, rounds=1, warmup=0, box_s=10),
}


def llama(size: Size, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=size.hidden, intermediate_size=4 * size.hidden,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=max(1, size.heads // 2), max_position_embeddings=size.tokens,
        use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


class Counting:
    """A torch.compile backend counting the graphs it compiles and their runs, each graph
    compiled by `inner` (a backend name: "inductor", or "eager" for dynamo alone)."""

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.graphs = 0
        self.runs = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> Counting:
        return self

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        compiled = lookup_backend(self.inner)(graph, example_inputs)

        def run(*args: Any) -> Any:
            self.runs += 1  # under the GIL; an estimate if two threads add at once
            return compiled(*args)

        return run


def compiled_copy(base: nn.Module, backend: str | None) -> tuple[nn.Module, Counting | None]:
    """A copy of `base`, each decoder layer `.compile()`d with a counting `backend` (None:
    eager)."""
    model = copy.deepcopy(base)
    if backend is None:
        return model, None
    counting = Counting(backend)
    for layer in model.model.layers:
        layer.compile(backend=counting)
    return model, counting


def batch_of(size: Size, device: torch.device) -> dict[str, Tensor]:
    ids = torch.randint(0, VOCAB, (size.batch, size.tokens),
                        generator=torch.Generator().manual_seed(1)).to(device)  # fmt: skip
    return {"input_ids": ids, "labels": ids}


def model_loss(output: Any, _target: None) -> Tensor:
    return output.loss  # type: ignore[no-any-return]


def token_loss(output: Any, ids: Tensor) -> Tensor:
    """Next-token cross entropy in the logits' dtype (the model's own `labels` loss computes
    in float32, which would hide a float64 difference)."""
    logits = output.logits[:, :-1]
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Contender:
    name: str
    step: Callable[[], None]
    counting: Counting | None
    close: Callable[[], None] = lambda: None


def contenders(size: Size, device: torch.device, backend: str, *, plain: bool,
               group: Any = None) -> list[Contender]:  # fmt: skip
    """The plain model (with `plain`) and gf.pipeline per schedule, eager and compiled; with
    `group`, the pipe spans its processes (one cell each, on `device`)."""
    base = llama(size).to(device)
    batch = batch_of(size, device)
    rank = 0 if group is None else torch.distributed.get_rank(group)
    found = []
    for compiled in (False, True):
        tag = "compiled" if compiled else "eager"
        if plain:
            model, counting = compiled_copy(base, backend if compiled else None)

            def plain_step(model: nn.Module = model) -> None:
                model(**batch).loss.backward()
                for p in model.parameters():
                    p.grad = None

            found.append(Contender(f"plain, {tag}", plain_step, counting))
        for schedule in SCHEDULES:
            model, counting = compiled_copy(base, backend if compiled else None)
            example = {k: v[: size.batch // size.chunks] for k, v in batch.items()}
            middle = f"model.layers.{size.layers // 2}"
            placement: dict[str, Any] = (
                {"devices": [str(device)] * 2} if group is None else {"pp_group": group}
            )
            pipe = gf.pipeline(model, example, [middle], chunks=size.chunks, checkpoint="never",
                               schedule=schedule, **placement)  # fmt: skip
            given = batch if rank == 0 else None

            def pipe_step(pipe: Any = pipe, given: Any = given) -> None:
                pipe.train_step(given, None, model_loss)
                for p in pipe.parameters():
                    p.grad = None

            found.append(Contender(f"gf.pipeline {schedule}, {tag}", pipe_step, counting,
                                   pipe.close))  # fmt: skip
    return found


def measure(found: list[Contender], size: Size, device: torch.device,
            barrier: Callable[[], None] = lambda: None) -> dict[str, Any]:  # fmt: skip
    """Each contender's first step apart, then interleaved rounds in the time box; per
    contender its samples (s), first step (s), graphs compiled in the first step and the
    compiled runs of one later step."""

    def timed(contender: Contender) -> float:
        barrier()
        synchronize(device)
        start = time.perf_counter()
        contender.step()
        synchronize(device)
        return time.perf_counter() - start

    results: dict[str, dict[str, Any]] = {}
    for contender in found:
        graphs = contender.counting.graphs if contender.counting else 0
        first = timed(contender)
        results[contender.name] = {"first_step_s": first, "samples_s": []}
        if contender.counting is not None:
            results[contender.name]["graphs_compiled"] = contender.counting.graphs - graphs
    deadline = time.monotonic() + size.box_s
    for round_ in range(size.warmup + size.rounds):
        shift = round_ % len(found)
        for contender in found[shift:] + found[:shift]:
            seconds = timed(contender)
            if round_ >= size.warmup:
                results[contender.name]["samples_s"].append(seconds)
        if round_ >= size.warmup and time.monotonic() > deadline:
            break
    for contender in found:
        if contender.counting is not None:
            runs = contender.counting.runs
            timed(contender)
            results[contender.name]["compiled_runs_per_step"] = contender.counting.runs - runs
    return results


def report(results: dict[str, dict[str, Any]], reference: str | None) -> tuple[dict, str]:  # type: ignore[type-arg]
    """Medians and ratios: compiled against eager (the same schedule, paired), against the
    plain eager model, zero_bubble against 1f1b."""
    rows = []
    for name, entry in results.items():
        samples = entry["samples_s"]
        entry["median_s"] = median(samples)
        eager = name.replace("compiled", "eager")
        if name != eager and eager in results:
            entry["compiled_vs_eager"] = paired_ratio(samples, results[eager]["samples_s"])
        if reference is not None:
            entry["vs_plain_eager"] = ratio(
                entry["median_s"], median(results[reference]["samples_s"])
            )
        if "zero_bubble" in name:
            other = results.get(name.replace("zero_bubble", "1f1b"))
            if other is not None:
                entry["zero_bubble_vs_1f1b"] = paired_ratio(samples, other["samples_s"])
        compile_s = (
            entry["first_step_s"] - entry["median_s"] if "graphs_compiled" in entry else None
        )
        entry["compile_s"] = compile_s
        rows.append((
            name, fmt(entry["median_s"] * 1e3, 1), fmt(entry.get("compiled_vs_eager"), 3),
            fmt(entry.get("vs_plain_eager"), 3), fmt(entry.get("zero_bubble_vs_1f1b"), 3),
            entry.get("graphs_compiled", ""), entry.get("compiled_runs_per_step", ""),
            fmt(compile_s, 1) if compile_s is not None else "", len(samples),
        ))  # fmt: skip
    table = markdown_table(
        ("contender", "median ms", "compiled / eager (paired)", "vs plain eager",
         "zero_bubble / 1f1b (paired)", "graphs compiled", "compiled runs per step",
         "compile s (first step - median)", "rounds"), rows,
    )  # fmt: skip
    return results, table


def exactness(device: torch.device, backend: str) -> dict[str, Any]:
    """A float64 LLaMA (hidden 64, 2 layers, 8 x 16 tokens) with compiled layers: a
    gf.pipeline 1f1b train_step (2 cells, 4 micro-batches, checkpoint except_last) against
    the plain compiled model on the whole batch, next-token cross entropy; the loss's and
    the largest gradient's relative difference."""
    size = Size(64, 2, 4, 16, 8, 4, rounds=0, warmup=0, box_s=0)
    base = llama(size, torch.float64).to(device)
    plain, _ = compiled_copy(base, backend)
    model, counting = compiled_copy(base, backend)
    ids = batch_of(size, device)["input_ids"]
    want = token_loss(plain(input_ids=ids), ids)
    want.backward()
    pipe = gf.pipeline(model, {"input_ids": ids[:2]}, ["model.layers.1"],
                       devices=[str(device)] * 2, chunks=4, checkpoint="except_last")  # fmt: skip
    try:
        got = pipe.train_step({"input_ids": ids}, ids, token_loss)
    finally:
        pipe.close()
    wanted = dict(plain.named_parameters())
    worst = max(
        ((p.grad - wanted[n].grad).abs().max() / wanted[n].grad.abs().max()).item()  # type: ignore[operator,union-attr]
        for n, p in model.named_parameters()
    )
    return {
        "loss_relative_difference": abs(got.item() - want.item()) / abs(want.item()),
        "max_relative_grad_difference": worst,
        "graphs": counting.graphs if counting else 0,
        "compiled_runs": counting.runs if counting else 0,
    }


# -- two processes ------------------------------------------------------------------------------


def worker(rank: int, world: int, folder: str, size: dict[str, Any], backend: str) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    code = 1
    try:
        store = dist.FileStore(os.path.join(folder, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))  # fmt: skip
        cpu = torch.device("cpu")
        found = contenders(Size(**size), cpu, backend, plain=False, group=dist.group.WORLD)
        try:
            results = measure(found, Size(**size), cpu, barrier=dist.barrier)
        finally:
            for contender in found:
                contender.close()
        torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def two_processes(size: Size, backend: str, timeout_s: float) -> dict[str, dict[str, Any]]:
    """The pipes on 2 spawned processes; per contender, each round the slower rank's time."""
    ranks = spawned_ranks(worker, 2, (asdict(size), backend), timeout_s, "compiled_")
    merged = ranks[0]
    for name, entry in merged.items():
        other = ranks[1][name]
        entry["samples_s"] = [max(a, b) for a, b in zip(entry["samples_s"], other["samples_s"],
                                                        strict=True)]  # fmt: skip
        entry["first_step_s"] = max(entry["first_step_s"], other["first_step_s"])
        for key in ("graphs_compiled", "compiled_runs_per_step"):
            if key in entry:
                entry[f"{key}_by_rank"] = [entry[key], other[key]]
                entry[key] = entry[key] + other[key]
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (1 and 2 processes) or cuda[:i]")
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer rounds")
    parser.add_argument("--smoke", action="store_true", help="toy sizes: the code path only")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("--processes", default="1,2", help="CPU: which worlds to run")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="no section starts past this many seconds (default: 170 with "
                        "--quick on a GPU, else none)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("compiled.py: no CUDA GPU visible", file=sys.stderr)
        return 2
    scale = (
        "smoke" if args.smoke else ("cuda" if on_gpu else "cpu") + ("-quick" if args.quick else "")
    )
    size = SCALES[scale]
    budget = (
        args.budget_s if args.budget_s is not None else (170.0 if on_gpu and args.quick else None)
    )
    if on_gpu:
        torch.cuda.set_device(torch.device(device).index or 0)
        torch.set_float32_matmul_precision("high")
    worlds = [1] if on_gpu else [int(w) for w in args.processes.split(",")]
    record = Record(args.out or default_out_path(f"compiled-{scale}"), script="bench/compiled.py",
                    argv=list(sys.argv[1:] if argv is None else argv), scale=scale,
                    size=asdict(size), backend=args.backend, environment=environment(device),
                    load_average=os.getloadavg())  # fmt: skip
    started = time.monotonic()

    def budget_left() -> bool:
        return budget is None or time.monotonic() - started < budget

    with watchdog(0 if args.smoke else 570.0):
        if 1 in worlds:
            found = contenders(size, device, args.backend, plain=True)
            try:
                results = measure(found, size, device)
            finally:
                for contender in found:
                    contender.close()
            data, table = report(results, "plain, eager")
            record.add("one process", data, table)
            print(f"## one process, {size}, on {device}\n\n{table}\n", flush=True)
        if 2 in worlds and budget_left():
            results = two_processes(size, args.backend, timeout_s=900)
            data, table = report(results, None)
            record.add("two processes", data, table)
            print(f"## two processes (gloo), {size}\n\n{table}\n", flush=True)
        if budget_left():
            torch._dynamo.reset()  # the timing's graphs counted against dynamo's recompile limit
            exact = exactness(device, args.backend)
            record.add("exactness", exact)
            print(f"## exactness (float64, compiled, 1f1b): {exact}\n", flush=True)
        record.data["seconds"] = time.monotonic() - started
        record.save()
    print(f"record: {record.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
