"""gf.pipeline against torch.distributed.pipelining's pipeline() on unmodified transformers models.

Two parts, each across processes (gloo on 127.0.0.1, one intra-op thread per process):

1. Capabilities. Tiny `from_config` models in float64 (LLaMA, GPT-2 with its tied head, BERT
   with a padding mask, T5 split in the decoder), each library building its pipe from one
   example micro-batch and the same split points, then training steps (GPipe schedule, two
   micro-batches, cross entropy on the logits) compared with the plain model on the whole
   batch: the loss and every gradient under its own name, relative errors. Columns: the pipe
   builds (torch: traces); 2 stages exact (batch 4, length 8, 2 processes); 4 stages exact
   (4 processes); tie exact (the gradient of every copy of a parameter the model uses under
   several names); uneven batch (5 in 2 micro-batches); new sequence length (12 after 8).
   A step that fails on one rank is abandoned on the others (their pipe waits on it) and the
   next column gets a fresh pipe on a fresh group. Every cell is what was measured.
2. Step time on 2 processes: a LLaMA (hidden 256, 8 layers, sequence 128, batch 8, 4
   micro-batches, float32), cross entropy and an AdamW step, split at model.layers.4.
   Contenders, each with its own copy of the model and optimizer, interleaved round by round
   in the same processes (order rotated): gf.pipeline with 1f1b and gpipe, torch's
   Schedule1F1B and ScheduleGPipe on its pipeline(), and gf.GPipe with 1f1b on an
   nn.Sequential of the same modules (embedding, decoder layers, norm and head) whose step
   less gf.pipeline's is the frontend's own cost (placeholders, glue on every stage, hooks).
   Each rank times its step from a barrier; a step takes the slower rank's time. Medians, and
   the ratio per round. Then one step at a new sequence length (re-planning) and the next.

    python bench/any_model.py [--quick] [--rounds 10] [--models llama,gpt2,bert,t5]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
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
    spawned_ranks,
    verdict,
)

VOCAB = 31
WIDTH = 16
EXACT = 1e-10  # float64: the pipe's rounding against the whole batch is ~1e-15
STEP_TIMEOUT_S = 120.0  # a step that runs this long on a tiny model hangs
MODELS = ("llama", "gpt2", "bert", "t5")
COLUMNS = ("builds", "2 stages exact", "4 stages exact", "tie exact", "uneven batch",
           "new sequence length")  # fmt: skip
# The columns' steps on the 2-stage pipe: (batch, sequence length); the example is (2, 8).
STEPS = {"2 stages exact": (4, 8), "uneven batch": (5, 8), "new sequence length": (4, 12)}
LIBRARIES = ("gpipe_fast", "torch")


# -- the models ---------------------------------------------------------------------------------


def build_model(name: str, blocks: int = 4) -> nn.Module:
    """A tiny float64 transformers model, no dropout, no cache, seeded."""
    import transformers as tf

    if name == "llama":
        config: Any = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH,
                                     intermediate_size=2 * WIDTH, num_hidden_layers=blocks,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=32, use_cache=False)  # fmt: skip
        kind: Any = tf.LlamaForCausalLM
    elif name == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=WIDTH, n_layer=blocks,
                               n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               bos_token_id=0, eos_token_id=0, use_cache=False)  # fmt: skip
        kind = tf.GPT2LMHeadModel
    elif name == "bert":
        config = tf.BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=blocks,
                               num_attention_heads=4, intermediate_size=2 * WIDTH,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                               max_position_embeddings=32)  # fmt: skip
        kind = tf.BertForMaskedLM
    elif name == "t5":
        options: dict[str, Any] = dict(
            vocab_size=VOCAB, d_model=WIDTH, d_kv=4, d_ff=2 * WIDTH, num_layers=blocks // 2,
            num_decoder_layers=blocks // 2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, use_cache=False)  # fmt: skip
        config = tf.T5Config(**options)
        kind = tf.T5ForConditionalGeneration
    else:
        raise ValueError(f"model: one of {MODELS}, got {name!r}")
    if name != "t5":
        config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return kind(config).double()


def split_points(name: str, stages: int) -> list[str]:
    """2 stages: in the middle of the blocks (T5: at the decoder); 4: one block each (T5: the
    encoder's second block and each decoder block)."""
    if name == "t5":
        return ["decoder.block.0"] if stages == 2 else [
            "encoder.block.1", "decoder.block.0", "decoder.block.1"]  # fmt: skip
    blocks = {"llama": "model.layers", "gpt2": "transformer.h", "bert": "bert.encoder.layer"}
    return [f"{blocks[name]}.2"] if stages == 2 else [f"{blocks[name]}.{i}" for i in (1, 2, 3)]


def make_batch(name: str, size: int, length: int, seed: int) -> tuple[dict[str, Tensor], Tensor]:
    """The model's inputs (fresh random tokens) and the loss's target."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, length), generator=generator)
    target = torch.randint(0, VOCAB, (size, length), generator=generator)
    if name == "bert":  # padding at the end of every other sequence
        mask = torch.ones_like(ids)
        mask[::2, length // 2 :] = 0
        return {"input_ids": ids, "attention_mask": mask}, target
    if name == "t5":
        return {"input_ids": ids, "decoder_input_ids": target.roll(1, 1)}, target
    return {"input_ids": ids}, target


def logits_loss(output: Any, target: Tensor) -> Tensor:
    """Cross entropy of the logits, whatever form the output takes (a ModelOutput for
    gf.pipeline, a tensor or a tuple of tensors for torch's last stage)."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    logits = output if isinstance(output, Tensor) else output.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def tied_names(model: nn.Module) -> set[str]:
    """Names of parameters the model holds under several names (GPT-2's wte and lm_head)."""
    names: dict[int, list[str]] = {}
    for key, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(key)
    return {key for group in names.values() if len(group) > 1 for key in group}


def first_line(error: BaseException) -> str:
    """The error's first line, and its root cause's where it wraps one (torch's stages say
    "failed to run forward:" around the error that says why)."""

    def line(e: BaseException) -> str:
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0].strip() if lines else ''}"

    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    text = line(error) if root is error else f"{line(error)} {line(root)}"
    return text[:300]


# -- the two libraries' pipes -------------------------------------------------------------------


class Contender:
    """One library's pipe on this rank: `step(batch, target)` runs one training step and
    returns the loss where this rank has it; `parameters()` are this rank's, by name."""

    def __init__(self, library: str, model: nn.Module, example: dict[str, Tensor],
                 points: list[str], chunks: int, schedule: str, group: Any,
                 threads: int = 1) -> None:  # fmt: skip
        import torch.distributed as dist

        self.library = library
        self.rank = dist.get_rank(group)
        self.last = self.rank == dist.get_world_size(group) - 1
        self.threads = threads
        if library == "gpipe_fast":
            import gpipe_fast as gf

            self.pipe: Any = gf.pipeline(model, example, points, chunks=chunks,
                                         schedule=schedule, checkpoint="never", pp_group=group,
                                         timeout=STEP_TIMEOUT_S,
                                         threads_per_cell=threads)  # fmt: skip
            self.module: nn.Module = self.pipe
        else:
            from torch.distributed.pipelining import SplitPoint, pipeline, schedules

            traced = pipeline(model, (), example,
                              split_spec={p: SplitPoint.BEGINNING for p in points})  # fmt: skip
            stage = traced.build_stage(self.rank, torch.device("cpu"), group)
            kind = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[schedule]
            self.schedule = getattr(schedules, kind)(stage, chunks, loss_fn=logits_loss)
            self.module = stage.submod

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(remove_duplicate=False)

    def step(self, batch: dict[str, Tensor], target: Tensor) -> Tensor | None:
        torch.set_num_threads(self.threads)
        if self.library == "gpipe_fast":
            loss = self.pipe.train_step(batch if self.rank == 0 else None, target, logits_loss)
            return loss if self.last else None
        losses: list[Tensor] = []
        if self.rank == 0:
            self.schedule.step(**batch)
        elif self.last:
            self.schedule.step(target=target, losses=losses)
        else:
            self.schedule.step()
        # torch scales each micro-batch's gradients by 1 / chunks: the mean of their losses.
        return torch.stack(losses).mean() if self.last else None

    def close(self) -> None:
        if self.library == "gpipe_fast":
            self.pipe.close()


# -- part 1: capabilities -----------------------------------------------------------------------


def relative(got: Tensor, want: Tensor, floor: float) -> float:
    """|got - want| / max(|want|, floor): a gradient that is zero in exact arithmetic (an
    attention key's bias) is rounding noise whose relative error means nothing."""
    scale = max(want.norm().item(), floor)
    return (got - want).norm().item() / scale if scale else (got - want).norm().item()


def compare(contender: Contender, plain: nn.Module, batch: dict[str, Tensor], target: Tensor,
            loss: Tensor | None) -> dict[str, Any]:  # fmt: skip
    """This rank's loss and gradients against the plain model's on the whole batch."""
    plain.zero_grad(set_to_none=True)
    want = logits_loss(plain(**batch), target)
    want.backward()
    reference = dict(plain.named_parameters(remove_duplicate=False))
    wants = {key: _grad(param) for key, param in reference.items()}
    floor = 1e-6 * torch.stack([want.norm() for want in wants.values()]).norm().item()
    errors: dict[str, float] = {}
    missing, unknown = [], []
    for key, param in contender.named_parameters():
        if key not in reference:
            unknown.append(key)  # a name the plain model does not have
        elif param.grad is None:
            if wants[key].norm() > 0:
                missing.append(key)  # this rank's copy of it got no gradient
        else:
            errors[key] = relative(param.grad, wants[key], floor)
    loss_error = None if loss is None else abs(loss.item() - want.item()) / abs(want.item())
    return {"status": "ok", "loss_error": loss_error, "grad_errors": errors,
            "no_gradient": missing, "unknown_names": unknown}  # fmt: skip


def _grad(param: Tensor) -> Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


class Coordinator:
    """Steps that may fail on one rank while the others wait on it: each runs in a thread;
    a rank whose step failed says so in the store and the others abandon theirs (their
    pipe is dropped, as are the group's pending messages); every rank leaves together."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world

    def run(self, key: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = body()
            except BaseException as error:
                box["result"] = {"status": "error", "error": first_line(error),
                                 "where": traceback.format_exc(limit=-3)}  # fmt: skip
                self.store.set(f"{key}/failed", str(self.rank))

        thread = threading.Thread(target=target, name=f"case {key}", daemon=True)
        thread.start()
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while thread.is_alive():
            thread.join(0.05)
            if thread.is_alive() and self.store.check([f"{key}/failed"]):
                thread.join(1.0)  # it may be failing too
                if thread.is_alive():
                    failed = self.store.get(f"{key}/failed").decode()
                    box.setdefault("result", {"status": "abandoned", "error": f"rank {failed}"
                                              " failed"})  # fmt: skip
                break
            if time.monotonic() > deadline:
                box.setdefault("result", {"status": "error", "error": "TimeoutError: no end "
                                          f"within {STEP_TIMEOUT_S:.0f} s"})  # fmt: skip
                self.store.set(f"{key}/failed", str(self.rank))
                break
        self.store.set(f"{key}/left/{self.rank}", "1")
        self.store.wait([f"{key}/left/{r}" for r in range(self.world)],
                        timedelta(seconds=STEP_TIMEOUT_S))  # fmt: skip
        return box["result"]


def capability_cases(rank: int, world: int, store: Any, models: list[str]) -> dict[str, Any]:
    """Every library x model case of a `world`-stage pipe on this rank: 2 stages run the
    three steps of STEPS, 4 stages the first."""
    import torch.distributed as dist

    coordinator = Coordinator(store, rank, world)
    variants = dict(STEPS) if world == 2 else {"4 stages exact": STEPS["2 stages exact"]}
    results: dict[str, Any] = {}
    for name in models:
        for library in LIBRARIES:
            case = f"{library}/{name}/{world}"
            model = build_model(name)
            plain = copy.deepcopy(model)
            example, _ = make_batch(name, 2, 8, 99)
            points = split_points(name, world)
            outcome: dict[str, Any] = {"split_points": points, "steps": {}}
            contender: Contender | None = None
            for column, (size, length) in variants.items():
                if contender is None:  # the first, or the last step failed: a fresh pipe
                    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
                    fresh = copy.deepcopy(plain)

                    def build(fresh: nn.Module = fresh, group: Any = group,
                              library: str = library, example: Any = example,
                              points: list[str] = points) -> dict[str, Any]:  # fmt: skip
                        built = Contender(library, fresh, example, points, 2, "gpipe", group)
                        return {"status": "ok", "contender": built}

                    built = coordinator.run(f"{case}/build/{column}", build)
                    outcome.setdefault("build", {k: v for k, v in built.items()
                                                 if k != "contender"})  # fmt: skip
                    if built["status"] != "ok":
                        outcome["steps"][column] = {"status": "no pipe"}
                        continue
                    contender = built["contender"]
                batch, target = make_batch(name, size, length, len(outcome["steps"]))

                def step(contender: Contender = contender, batch: Any = batch,
                         target: Tensor = target,
                         plain: nn.Module = plain) -> dict[str, Any]:  # fmt: skip
                    for param in contender.module.parameters():
                        param.grad = None
                    loss = contender.step(batch, target)
                    return compare(contender, plain, batch, target, loss)

                result = coordinator.run(f"{case}/{column}", step)
                outcome["steps"][column] = result
                if result["status"] != "ok":
                    contender = None  # left waiting on its group: never used again
            if contender is not None:
                contender.close()
            outcome["tied"] = sorted(tied_names(plain))
            results[case] = outcome
    return results


# -- part 2: step time --------------------------------------------------------------------------


def timing_model(size: dict[str, Any]) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"],
                         intermediate_size=size["intermediate"],
                         num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                         num_key_value_heads=size["heads"] // 2,
                         max_position_embeddings=2 * size["length"], use_cache=False)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class _Embed(nn.Module):
    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, ids: Tensor) -> Tensor:
        return self.embed(ids)


class _Layer(nn.Module):
    """A decoder layer with its own rotary embedding (the model computes cos/sin once and
    hands them to every layer; sdpa without a mask is causal, as the model's own path)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, hidden: Tensor) -> Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return self.layer(hidden, position_embeddings=self.rotary(hidden, positions))


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: Tensor) -> Tensor:
        return self.head(self.norm(hidden))


def as_sequential(model: Any) -> nn.Sequential:
    """The LLaMA's own modules as an nn.Sequential computing the same logits."""
    inner: Any = model.model
    layers = [_Layer(layer, copy.deepcopy(inner.rotary_emb)) for layer in inner.layers]
    return nn.Sequential(_Embed(inner.embed_tokens), *layers, _Head(inner.norm, model.lm_head))


def timing_contenders(rank: int, size: dict[str, Any], batch: dict[str, Tensor],
                      target: Tensor) -> dict[str, Callable[[], Tensor | None]]:  # fmt: skip
    """Each contender's step on this rank: its own model copy, its own AdamW."""
    import torch.distributed as dist

    import gpipe_fast as gf

    world = dist.group.WORLD
    half = size["layers"] // 2
    example = {key: value[: size["batch"] // size["chunks"]] for key, value in batch.items()}
    steps: dict[str, Callable[[], Tensor | None]] = {}

    def with_adamw(contender: Contender) -> Callable[[], Tensor | None]:
        optimizer = torch.optim.AdamW([p for _, p in contender.named_parameters()], lr=1e-4)

        def step() -> Tensor | None:
            optimizer.zero_grad(set_to_none=True)
            loss = contender.step(batch, target)
            optimizer.step()
            return loss

        return step

    pairs = [(library, schedule) for schedule in size["schedules"] for library in LIBRARIES]
    for library, schedule in pairs:
        contender = Contender(library, timing_model(size), example, [f"model.layers.{half}"],
                              size["chunks"], schedule, world)  # fmt: skip
        steps[f"{library} {schedule}"] = with_adamw(contender)
        if library == "gpipe_fast" and schedule == "1f1b":
            steps["_reshape"] = _new_length_steps(contender, batch, target)

    sequential = as_sequential(timing_model(size))
    pipe = gf.GPipe(sequential, [1 + half, len(sequential) - 1 - half], chunks=size["chunks"],
                    schedule="1f1b", checkpoint="never", pp_group=world, threads_per_cell=1,
                    timeout=STEP_TIMEOUT_S)  # fmt: skip
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    last = rank == 1

    def sequential_step() -> Tensor | None:
        torch.set_num_threads(1)
        optimizer.zero_grad(set_to_none=True)
        ids = batch["input_ids"] if rank == 0 else None  # other ranks read no input
        loss = pipe.train_step(ids, target, logits_loss)  # type: ignore[arg-type]
        optimizer.step()
        return loss if last else None

    steps["gf.GPipe 1f1b, nn.Sequential"] = sequential_step
    return steps


def _new_length_steps(contender: Contender, batch: dict[str, Tensor],
                      target: Tensor) -> Callable[[], Tensor | None]:  # fmt: skip
    """A step at a sequence length the pipe has not seen (it plans its placeholders anew),
    no optimizer step: timed once first, then again."""
    length = batch["input_ids"].shape[1] * 3 // 4
    short = {key: value[:, :length] for key, value in batch.items()}

    def step() -> Tensor | None:
        contender.module.zero_grad(set_to_none=True)
        return contender.step(short, target[:, :length])

    return step


def timing_rounds(rank: int, size: dict[str, Any], rounds: int, warmup: int) -> dict[str, Any]:
    """Every contender's step times on this rank, rounds interleaved, order rotated."""
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["length"]), generator=generator)
    target = torch.randint(0, size["vocab"], ids.shape, generator=generator)
    steps = timing_contenders(rank, size, {"input_ids": ids}, target)
    reshape = steps.pop("_reshape")
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    first_loss: dict[str, float | None] = {}
    for round_ in range(warmup + rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            loss = steps[name]()
            seconds = time.perf_counter() - start
            if round_ == 0:
                first_loss[name] = None if loss is None else loss.item()
            if round_ >= warmup:
                times[name].append(seconds)
    new_length = []
    for _ in range(2):
        dist.barrier()
        start = time.perf_counter()
        reshape()
        new_length.append(time.perf_counter() - start)
    return {"times": times, "first_loss": first_loss, "new_length": new_length}


# -- the workers --------------------------------------------------------------------------------


def worker(rank: int, world: int, folder: str, task: dict[str, Any]) -> None:
    """One rank: joins the gloo group, runs its parts, writes rank<r>.pt, and leaves at once
    (threads of abandoned steps may still wait on their groups)."""
    import torch.distributed as dist

    started = time.perf_counter()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    code = 1
    try:
        store = dist.FileStore(os.path.join(folder, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=STEP_TIMEOUT_S))  # fmt: skip
        out: dict[str, Any] = {"seconds": {"joined": time.perf_counter() - started}}
        if task.get("timing"):
            out["timing"] = timing_rounds(rank, task["timing"], task["rounds"], task["warmup"])
            out["seconds"]["timing"] = time.perf_counter() - started
        if task.get("models"):
            out["cases"] = capability_cases(rank, world, store, task["models"])
            out["seconds"]["cases"] = time.perf_counter() - started
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_world(world: int, task: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """`task` on `world` spawned processes; their outputs by rank."""
    return spawned_ranks(worker, world, (task,), timeout_s, "any_model_")


# -- reports ------------------------------------------------------------------------------------


def merge_step(per_rank: list[dict[str, Any]], tied: set[str]) -> dict[str, Any]:
    """One step's outcome over the ranks: the first error, else the loss's error and the
    worst gradient error, overall and over tied names."""
    for result in per_rank:
        if result["status"] not in ("ok", "abandoned"):
            return dict(result)
    if any(result["status"] != "ok" for result in per_rank):
        return {"status": "error", "error": "abandoned on every rank"}
    loss_errors = [r["loss_error"] for r in per_rank if r["loss_error"] is not None]
    worst: dict[str, float] = {}  # per name, over the ranks holding a copy
    for result in per_rank:
        for key, error in result["grad_errors"].items():
            worst[key] = max(error, worst.get(key, 0.0))
    missing = sorted({key for r in per_rank for key in r["no_gradient"]})
    unknown = sorted({key for r in per_rank for key in r["unknown_names"]})
    worst_name = max(worst, key=worst.__getitem__) if worst else None
    tied_seen = sorted(k for k in tied if k in worst or k in missing)
    return {"status": "ok", "loss_error": max(loss_errors) if loss_errors else None,
            "grad_error": worst[worst_name] if worst_name else None, "worst": worst_name,
            "no_gradient": missing, "unknown_names": unknown, "compared": sorted(worst),
            "tied_error": max((worst[k] for k in tied if k in worst), default=None),
            "tied_no_gradient": [k for k in missing if k in tied],
            "tied_seen": tied_seen}  # fmt: skip


def cell(step: dict[str, Any] | None, tie: bool = False) -> dict[str, Any]:
    """A table cell: "exact" / "not exact" with the relative error, or the error."""
    if step is None:
        return {"outcome": "not run"}
    if step["status"] != "ok":
        return {"outcome": "fails", "error": step.get("error")}
    if tie:
        if not step["tied_seen"]:
            return {"outcome": "n/a"}
        error, missing = step["tied_error"], step["tied_no_gradient"]
        exact = error is not None and error < EXACT and not missing
        return {"outcome": "exact" if exact else "not exact", "error": error,
                "no_gradient": missing, "names": step["tied_seen"]}  # fmt: skip
    errors = [e for e in (step["loss_error"], step["grad_error"]) if e is not None]
    error = max(errors) if errors else None
    exact = error is not None and error < EXACT and not step["unknown_names"] and not (
        step["no_gradient"])  # fmt: skip
    return {"outcome": "exact" if exact else "not exact", "error": error, "worst": step["worst"],
            "no_gradient": step["no_gradient"], "unknown_names": step["unknown_names"]}  # fmt: skip


def capability_table(two: list[dict[str, Any]], four: list[dict[str, Any]] | None,
                     models: list[str]) -> tuple[dict[str, Any], str]:  # fmt: skip
    """The measured cells, and the markdown table of them."""
    cells: dict[str, Any] = {}
    rows = []
    for name in models:
        for library in LIBRARIES:
            key = f"{library}/{name}"
            outcome = two[0]["cases"][f"{key}/2"]
            tied = set(outcome["tied"])
            steps = {column: merge_step([r["cases"][f"{key}/2"]["steps"][column] for r in two],
                                        tied) if outcome["steps"][column]["status"] != "no pipe"
                     else None for column in STEPS}  # fmt: skip
            builds = [r["cases"][f"{key}/2"]["build"] for r in two]
            failed = next((b for b in builds if b["status"] != "ok"), None)
            row = {"builds": {"outcome": "fails", "error": failed.get("error")} if failed
                   else {"outcome": "yes"}}  # fmt: skip
            row["2 stages exact"] = cell(steps["2 stages exact"])
            if four is not None:
                four_step = four[0]["cases"][f"{key}/4"]["steps"]["4 stages exact"]
                row["4 stages exact"] = cell(
                    None
                    if four_step["status"] == "no pipe"
                    else merge_step(
                        [r["cases"][f"{key}/4"]["steps"]["4 stages exact"] for r in four], tied
                    )
                )
            else:
                row["4 stages exact"] = cell(None)
            row["tie exact"] = cell(steps["2 stages exact"], tie=True) if tied else {
                "outcome": "n/a"}  # fmt: skip
            row["uneven batch"] = cell(steps["uneven batch"])
            row["new sequence length"] = cell(steps["new sequence length"])
            cells[key] = {"cells": row, "steps": steps}
            rows.append([name, library, *(_text(row[c]) for c in COLUMNS)])
    return cells, markdown_table(["model", "library", *COLUMNS], rows)


def _text(entry: dict[str, Any]) -> str:
    outcome = entry["outcome"]
    if outcome in ("exact", "not exact"):
        error = entry["error"]
        parts = ["n/a" if error is None else f"{error:.0e}"]
        if outcome != "exact" and entry.get("worst") and error is not None and error >= EXACT:
            parts[0] += f" at {entry['worst']}"
        if entry.get("no_gradient"):
            parts.append("no gradient: " + ", ".join(entry["no_gradient"]))
        return f"{outcome} ({'; '.join(parts)})"
    if outcome == "fails":
        # torch's stages wrap the error that says why in "[Stage k] failed to run forward:".
        error = str(entry["error"]).replace("RuntimeError: [Stage 0] failed to run forward: ",
                                            "stage 0 forward: ")  # fmt: skip
        return f"fails: {error}".replace("|", "/")[:150]
    return str(outcome)


def timing_report(ranks: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    times = [r["timing"]["times"] for r in ranks]
    names = list(times[0])
    # A step takes the slower rank's time, round by round.
    steps = {n: [max(pair) for pair in zip(times[0][n], times[1][n], strict=True)] for n in names}
    medians = {name: median(samples) for name, samples in steps.items()}
    speedups = {schedule: paired_ratio(steps[f"torch {schedule}"], steps[f"gpipe_fast {schedule}"])
                for schedule in ("1f1b", "gpipe") if f"torch {schedule}" in steps}  # fmt: skip
    sequential = "gf.GPipe 1f1b, nn.Sequential"
    frontend = 1 - 1 / paired_ratio(steps["gpipe_fast 1f1b"], steps[sequential])
    new_length = [
        max(pair) for pair in zip(*(r["timing"]["new_length"] for r in ranks), strict=True)
    ]
    losses = {name: ranks[1]["timing"]["first_loss"][name] for name in names}
    rows = [[name, fmt(medians[name] * 1e3, 1), fmt(losses[name], 6)] for name in names]
    entry = {"medians_ms": {n: m * 1e3 for n, m in medians.items()}, "steps_s": steps,
             "speedup_over_torch": speedups, "frontend_share": frontend,
             "first_step_loss": losses, "new_length_first_ms": new_length[0] * 1e3,
             "new_length_next_ms": new_length[1] * 1e3,
             "targets": {"speedup >= 1.10 (1f1b)": verdict(speedups["1f1b"], 1.10,
                                                             at_most=False),
                         "frontend <= 5%": verdict(frontend, 0.05, at_most=True)}}  # fmt: skip
    table = markdown_table(["contender", "median step ms", "first step's loss"], rows)
    faster = ", ".join(f"{schedule} {fmt(x)}x" for schedule, x in speedups.items())
    table += (f"\n\ntorch / gpipe_fast, per round: {faster}; frontend (gf.pipeline less "
              f"gf.GPipe on the Sequential, share of gf.pipeline's step): "
              f"{fmt(100 * frontend, 1)}%; a new sequence length: first step "
              f"{fmt(new_length[0] * 1e3, 1)} ms, next "
              f"{fmt(new_length[1] * 1e3, 1)} ms")  # fmt: skip
    return entry, table


SIZES = {  # the timing LLaMA: full (and --quick), --toy
    "full": {"hidden": 256, "intermediate": 688, "layers": 8, "heads": 8, "vocab": 1024,
             "length": 128, "batch": 8, "chunks": 4, "schedules": ["1f1b", "gpipe"]},
    "toy": {"hidden": 32, "intermediate": 64, "layers": 4, "heads": 4, "vocab": 64,
            "length": 16, "batch": 4, "chunks": 2, "schedules": ["1f1b"]},
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about 3 minutes)")
    parser.add_argument(
        "--toy", action="store_true", help="a smoke run: LLaMA only, a tiny timing model, one round"
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--skip-four", action="store_true", help="no 4-process part")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    mode = "toy" if args.toy else "quick" if args.quick else "full"
    models = ["llama"] if args.toy else [m for m in args.models.split(",") if m]
    rounds = args.rounds or {"full": 10, "quick": 3, "toy": 1}[mode]
    warmup = 1 if args.toy else args.warmup
    size = SIZES["toy" if args.toy else "full"]
    record = Record(args.json or default_out_path(f"any_model-{mode}"),
                    script="bench/any_model.py", mode=mode, models=models, rounds=rounds,
                    warmup=warmup, timing_size=size, environment=environment(torch.device("cpu")),
                    transformers=_transformers_version(), load_average=os.getloadavg())  # fmt: skip
    started = time.perf_counter()
    two = run_world(2, {"timing": size, "rounds": rounds, "warmup": warmup, "models": models},
                    timeout_s=1800)  # fmt: skip
    timing, timing_text = timing_report(two)
    timing["worker_seconds"] = two[0]["seconds"]
    record.add("step_time", timing, timing_text)
    print(f"step time, 2 processes, LLaMA {size}:\n{timing_text}\n", flush=True)
    four = None if args.skip_four else run_world(4, {"models": models}, timeout_s=900)
    cells, table = capability_table(two, four, models)
    seconds = {"2 processes": two[0]["seconds"], "4 processes": four and four[0]["seconds"]}
    record.add("capabilities", {"models": cells, "exact_below": EXACT, "worker_seconds": seconds},
               table)  # fmt: skip
    print(f"capabilities (float64, relative errors):\n{table}\n")
    record.data["seconds"] = time.perf_counter() - started
    record.save()
    print(f"record: {record.path}")
    return 0


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return str(transformers.__version__)


if __name__ == "__main__":
    sys.exit(main())
