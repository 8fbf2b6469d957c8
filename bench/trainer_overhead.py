"""Tokens/s of PipelineTrainer against gf.pipeline in its own training loop (the cost of
transformers' Trainer machinery around the pipe; target: at most 5%) and against a plain
transformers Trainer with DDP on the same processes.

    python bench/trainer_overhead.py                              # 2 processes, pp=2
    python bench/trainer_overhead.py --processes 4 --pp 2         # pp2 x dp2 (and DDP on 4)
    python bench/trainer_overhead.py --width 64 --layers 2 --steps 6 --rounds 1   # a smoke run

It starts one torchrun job of --processes ranks (gloo; CUDA when there is a GPU per rank),
in which three contenders train the same LlamaForCausalLM (built from a config, no
download) on the same random token batches, in rounds, one after the other within each
round, so that a slower or busier host slows all three:

- `PipelineTrainer`: PipelineTrainer(model, args, train_dataset=..., pp_size=--pp).
- `own loop`: gf.pipeline with the same split points, chunks and schedule, and a loop of
  train_step (with the batch's num_items_in_batch, as Trainer passes it), clip_grad_norm_,
  the same optimizer class and settings as Trainer's (Trainer.get_optimizer_cls_and_kwargs),
  a linear schedule, zero_grad.
- `Trainer + DDP`: a plain transformers Trainer on every process (accelerate wraps the
  model in DistributedDataParallel), the global batch split over all of them.

Each contender runs --steps optimizer steps per round; its rate is measured from the end of
its --warmup-th step to the end of its last (data loading, logging and callbacks included),
in tokens of the global batch per second. Rank 0 prints each contender's median over the
rounds and the ratios of the medians; per-round ratios are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if any((ROOT / "gpipe_fast").glob("_C*")):  # run from a built checkout: use its gpipe_fast
    sys.path.insert(0, str(ROOT))

CONTENDERS = ("PipelineTrainer", "own loop", "Trainer + DDP")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--pp", type=int, default=None, help="processes per pipeline (default: all)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--length", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences per optimizer step, global")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per round")
    p.add_argument("--warmup", type=int, default=2, help="steps not timed in each round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.width * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.width // 64),
        num_key_value_heads=max(1, args.width // 256), max_position_embeddings=args.length,
        use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class Tokens:
    """Random sequences, each its own labels: every step's batch the same for all three."""

    def __init__(self, rows: int, length: int, vocab: int) -> None:
        import torch

        self.ids = torch.randint(
            0, vocab, (rows, length), generator=torch.Generator().manual_seed(1)
        )

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_arguments(args: argparse.Namespace, per_device: int, folder: str) -> Any:
    import torch
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=folder, per_device_train_batch_size=per_device, max_steps=args.steps,
        learning_rate=1e-4, warmup_steps=0, lr_scheduler_type="linear", max_grad_norm=1.0,
        logging_steps=args.steps, save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True,
        accelerator_config={"even_batches": True},
    )  # fmt: skip


def step_times() -> Any:
    """A Trainer callback keeping the time at the end of each optimizer step."""
    from transformers import TrainerCallback

    class Times(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.ends = []

        def on_step_end(self, *_: Any, **__: Any) -> None:
            _synchronize()
            self.ends.append(time.perf_counter())

    return Times()


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rate(ends: list[float], warmup: int, tokens_per_step: int) -> float:
    """Tokens per second from the end of step `warmup` to the end of the last step."""
    timed = ends[warmup - 1 :] if warmup > 0 else ends
    return tokens_per_step * (len(timed) - 1) / (timed[-1] - timed[0])


def worker(args: argparse.Namespace) -> None:
    import tempfile

    import torch.distributed as dist
    from transformers import Trainer

    from gpipe_fast.integrations.transformers import PipelineTrainer

    world = int(os.environ["WORLD_SIZE"])
    pp = args.pp or world
    dp = world // pp
    if args.batch % dp or args.batch % world:
        raise SystemExit(f"--batch {args.batch} must divide over {dp} replicas and {world} ranks")
    data = Tokens(args.batch * args.steps, args.length, args.vocab)
    tokens = args.batch * args.length
    folder = tempfile.mkdtemp(prefix="gpipe-trainer-overhead-")

    times = step_times()
    piped = PipelineTrainer(
        model=build_model(args), args=training_arguments(args, args.batch // dp, folder),
        train_dataset=data, callbacks=[times], pp_size=pp, chunks=args.chunks,
        schedule=args.schedule,
    )  # fmt: skip
    own = OwnLoop(args, piped, data, dp)
    ddp_times = step_times()
    plain = Trainer(model=build_model(args),
                    args=training_arguments(args, args.batch // world, folder),
                    train_dataset=data, callbacks=[ddp_times])  # fmt: skip

    results: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for _ in range(args.rounds):
        piped.train()
        results["PipelineTrainer"].append(rate(times.ends, args.warmup, tokens))
        results["own loop"].append(rate(own.run(), args.warmup, tokens))
        plain.train()
        results["Trainer + DDP"].append(rate(ddp_times.ends, args.warmup, tokens))
    own.pipe.close()
    if dist.get_rank() == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    # Every rank past its last collective before the groups are torn down (piped.end()): a
    # rank that ended first left the other's DDP reducer, freed at exit, joining a gloo run
    # loop that waited for it (a hang seen once in CI).
    del plain
    dist.barrier()
    piped.end()


class OwnLoop:
    """gf.pipeline and a training loop of its own, on the PipelineTrainer's split and data."""

    def __init__(self, args: argparse.Namespace, piped: Any, data: Tokens, dp: int) -> None:
        import torch
        from transformers import Trainer

        import gpipe_fast as gf

        self.args, self.data, self.dp, self.mesh = args, data, dp, piped.mesh
        model = build_model(args)
        example = {"input_ids": data.ids[:2], "labels": data.ids[:2]}
        self.pipe = gf.pipeline(model, example, piped.pipe.split_points, chunks=args.chunks,
                                schedule=args.schedule, pp_group=piped.mesh.pp_group,
                                dp_group=piped.mesh.dp_group)  # fmt: skip
        optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(piped.args)
        self.optimizer = optimizer_class(self.pipe.parameters(), **kwargs)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: 1 - step / args.steps
        )

    def run(self) -> list[float]:
        ends = []
        per_replica = self.args.batch // self.dp
        for step in range(self.args.steps):
            rows = self.data.ids[step * self.args.batch : (step + 1) * self.args.batch]
            ids = rows.tensor_split(self.dp)[self.mesh.dp_index] if self.dp > 1 else rows
            assert len(ids) == per_replica
            count = (rows[:, 1:] != -100).sum()  # the window's labels over every replica
            self.pipe.train_step({"input_ids": ids, "labels": ids}, None,
                                 lambda out, _: out.loss, num_items_in_batch=count)  # fmt: skip
            self.pipe.clip_grad_norm_(1.0)
            self.optimizer.step()
            self.schedule.step()
            self.optimizer.zero_grad(set_to_none=True)
            _synchronize()
            ends.append(time.perf_counter())
        return ends


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))  # fmt: skip
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.processes}", __file__, "--worker", *forwarded]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"the job failed\n{result.stdout[-4000:]}{result.stderr[-4000:]}")
    results: dict[str, list[float]] = json.loads(lines[0][len("RESULTS ") :])
    pp = args.pp or args.processes
    print(f"LlamaForCausalLM {args.layers} x {args.width}, vocabulary {args.vocab}; global "
          f"batch {args.batch} x {args.length} tokens; {args.processes} processes: pp={pp} "
          f"dp={args.processes // pp}, chunks={args.chunks}, schedule={args.schedule}; "
          f"{args.rounds} rounds of {args.steps} steps ({args.warmup} untimed)\n")  # fmt: skip
    median = {name: statistics.median(values) for name, values in results.items()}
    print("| contender | tokens/s (median) | per round |")
    print("|---|---|---|")
    for name in CONTENDERS:
        rounds = ", ".join(f"{value:,.0f}" for value in results[name])
        print(f"| {name} | {median[name]:,.0f} | {rounds} |")
    piped, own, ddp = (median[name] for name in CONTENDERS)
    overheads = [o / p - 1 for o, p in zip(results["own loop"], results["PipelineTrainer"],
                                           strict=True)]  # fmt: skip
    print(f"\nTrainer's machinery around the pipe: {own / piped - 1:+.1%} (own loop / "
          f"PipelineTrainer - 1; per round {', '.join(f'{o:+.1%}' for o in overheads)}; "
          "target <= 5%)")  # fmt: skip
    print(f"PipelineTrainer / Trainer + DDP: {piped / ddp:.2f}x")


if __name__ == "__main__":
    main()
