"""schedule="auto": the pipe's own pick against an exhaustive measured sweep, and gf.plan's error.

For each workload, in 1 process and in 2 (gloo over 127.0.0.1, shared memory between the
ranks), a pipe built with schedule, chunks and checkpoint "auto" runs ``pipe.tune()`` on the
job's batch (timed: the tuning's cost). Then every candidate the tuning priced (every
schedule kind with its cells, every balance or split points it tried, every micro-batch
count and checkpoint mode whose predicted memory fits) is measured against the tuned pipe
itself, in groups of pipes interleaved round by round, each turn running a pipe's
train_steps one after another for about 50 ms (two at least) and taking the median of the
latter half, as a training loop runs them (order rotated; across processes each step starts
at a barrier and takes the slower rank's time). Steps of a few milliseconds take several
steps to settle after another pipe's: turns of two steps ranked them as they start, and
favoured one micro-batch, which settles at once, by 15-25% over what wins settled.
A config's time is the tuned pipe's median step times the median of its per-round ratios to
the tuned pipe in the same round, so that load that comes and goes between groups cancels
out. The sweep's four fastest are then measured again with the defaults (GPipe or
gf.pipeline with no schedule, chunks or checkpoint given), for three times the rounds: the
least of a hundred noisy medians is low by chance, and the best is the confirmed one.

Reported per workload and process count:
- the auto pick against the best of the sweep (target: within 5%) and against the defaults;
- the tuning's cost in seconds;
- gf.plan's prediction error on every candidate measured, before calibration (profiled
  layers) and after (calibrated from the steps the tuning measured): median and worst
  |predicted / measured - 1|; and the chosen plan's prediction (``pipe.tuning.plan``) against
  the tuned pipe's median step when its steps run one after another, as in training: right
  after the tuning, as a user's training goes on from it (target: within 10%), and again
  after the sweep, minutes later (how far this host's speed drifted meanwhile).

Workloads: compute-bound MLP (8 x Linear(1024) + ReLU, batch 256), overhead-bound MLP
(8 x Linear(128) + ReLU, batch 512), a transformers LlamaForCausalLM through gf.pipeline
(8 layers of width 256, batch 16 x 64 tokens), the U-Net with skips of the demo
(widths 16, 32, 64; batch 32 of 64 x 64). `--small` shrinks every one for a quick check.

    python bench/auto_plan.py [--workloads compute,overhead,llama,unet] [--processes 1,2]
        [--rounds 5] [--group 8] [--block 2] [--turn-ms 50] [--confirm 4] [--most N] [--small]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_pair import WorkerPair, in_gloo_pair, requests_of

WORKLOADS = ("compute", "overhead", "llama", "unet")
REPLY_TIMEOUT_S = 3600.0


def _small() -> bool:
    return os.environ.get("AUTO_PLAN_SMALL") == "1"


def _mlp(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(8)])


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    small = _small()
    config = LlamaConfig(vocab_size=128 if small else 1024, hidden_size=32 if small else 256,
                         intermediate_size=64 if small else 512,
                         num_hidden_layers=4 if small else 8, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class Workload:
    """A model, one batch (input and target), its loss, and how to build a pipe of it."""

    def __init__(self, name: str) -> None:
        self.name = name
        small = _small()
        generator = torch.Generator().manual_seed(1)
        self.example: Any = None
        if name in ("compute", "overhead"):
            width, rows = {"compute": (1024, 256), "overhead": (128, 512)}[name]
            if small:
                width, rows = width // 8, rows // 8
            self.model: nn.Module = _mlp(width)
            self.input: Any = torch.randn(rows, width, generator=generator)
            self.target: Any = torch.randn(rows, width, generator=generator)
            self.loss = nn.functional.mse_loss
        elif name == "unet":
            from gpipe_fast.demo.unet import batch, unet

            torch.manual_seed(0)
            self.model = unet((8, 16, 32) if small else (16, 32, 64))
            self.input, self.target = batch(0, size=8 if small else 32, pixels=16 if small else 64)
            self.loss = nn.functional.mse_loss
        elif name == "llama":
            self.model = _llama()
            vocab = self.model.config.vocab_size
            rows, length = (4, 16) if small else (16, 64)
            ids = torch.randint(0, vocab, (rows, length), generator=generator)
            self.input = {"input_ids": ids}
            self.target = ids
            self.example = {"input_ids": ids[:2]}

            def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
                return nn.functional.cross_entropy(
                    output.logits.reshape(-1, vocab), target.reshape(-1)
                )

            self.loss = loss
        else:
            raise ValueError(f"unknown workload {name!r}")

    def pipe(self, world: int, **kwargs: Any) -> Any:
        import torch.distributed as dist

        import gpipe_fast as gf

        if world > 1:
            kwargs["pp_group"] = dist.group.WORLD
        if self.example is not None:
            return gf.pipeline(self.model, self.example, **kwargs)
        return gf.GPipe(self.model, **kwargs)  # type: ignore[arg-type]

    def of_config(self, world: int, config: dict[str, Any], devices: list[str]) -> Any:
        """The pipe of one candidate (see _config)."""
        kwargs: dict[str, Any] = {"schedule": config["schedule"], "chunks": config["chunks"],
                                  "checkpoint": config["checkpoint"]}  # fmt: skip
        if world == 1:
            kwargs["devices"] = devices
        if self.example is not None:
            kwargs["split_points"] = list(config["split_points"] or ())
            return self.pipe(world, **kwargs)
        return self.pipe(world, balance=list(config["balance"]), **kwargs)

    def step(self, pipe: Any, rank: int, world: int) -> None:
        first, last = rank == 0, rank == world - 1
        pipe.train_step(self.input if first else None, self.target if last else None,
                        self.loss)  # fmt: skip


def _config(config: Any) -> dict[str, Any]:
    cut = config.cut
    return {"schedule": cut.schedule, "balance": list(cut.balance),
            "split_points": None if cut.split_points is None else list(cut.split_points),
            "chunks": config.chunks, "checkpoint": config.checkpoint}  # fmt: skip


def _candidate(candidate: Any) -> dict[str, Any]:
    return {**_config(candidate.config), "predicted_s": candidate.predicted_s,
            "calibrated_s": candidate.calibrated_s, "tuning_s": candidate.measured_s,
            "peak_memory": candidate.peak_memory}  # fmt: skip


def _label(config: dict[str, Any]) -> str:
    cut = (f"split {config['split_points']}" if config.get("split_points") is not None
           else f"balance {config['balance']}")  # fmt: skip
    return f"{config['schedule']}, {cut}, M={config['chunks']}, {config['checkpoint']}"


class Job:
    """A rank's side: the workloads, the tuned pipe of each, the groups measured."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.workloads: dict[str, Workload] = {}
        self.tuned: dict[str, Any] = {}

    def tune(self, name: str) -> dict[str, Any]:
        from gpipe_fast.api.auto import worker_devices

        workload = self.workloads[name] = Workload(name)
        pipe = workload.pipe(self.world, schedule="auto", chunks="auto", checkpoint="auto")
        first, last = self.rank == 0, self.rank == self.world - 1
        start = time.perf_counter()
        tuning = pipe.tune(workload.input if first else None, workload.target if last else None,
                           workload.loss, progress=self.rank == 0)  # fmt: skip
        seconds = time.perf_counter() - start
        self.tuned[name] = pipe
        return {
            "seconds": seconds,
            "choice": _config(tuning.choice),
            "devices": [str(d) for d in worker_devices(pipe)],
            "plan_s": tuning.plan.step_time if tuning.plan is not None else None,
            "fit": asdict(tuning.fit) if tuning.fit is not None else None,
            "candidates": [_candidate(c) for c in tuning.candidates],
            "notes": list(tuning.notes),
            "text": str(tuning),
        }

    def group(self, name: str, configs: list[dict[str, Any] | None], devices: list[str],
              rounds: int, warmup: int, block: int, turn_s: float,
              ) -> list[list[float]]:  # fmt: skip
        """Per round, the time of a step of the tuned pipe (first) and of each config's pipe
        (None: the defaults), interleaved, order rotated each round. Each turn runs a pipe's
        steps one after another for about `turn_s` (`block` steps at least; the count from
        the warm-up rounds' slowest rank, the same on every rank) and takes the median of
        the latter half, as a training loop runs them: the first steps after another pipe's
        find its threads asleep and its caches cold, and steps of a few milliseconds take
        several to settle."""
        import torch.distributed as dist

        from gpipe_fast.planning.measure import turn_steps

        workload = self.workloads[name]
        pipes = [self.tuned[name]]
        built = []
        try:
            for config in configs:
                if config is None:  # the defaults: nothing given but the process group
                    built.append(workload.pipe(self.world))
                else:
                    built.append(workload.of_config(self.world, config, devices))
            pipes += built
            times: list[list[float]] = [[] for _ in pipes]
            last = [0.0] * len(pipes)
            turns = [block] * len(pipes)
            for index in range(warmup + rounds):
                if index == warmup > 0:  # the turns' lengths, from the warm-up's steps
                    slowest = torch.tensor(last, dtype=torch.float64)
                    if self.world > 1:
                        dist.all_reduce(slowest, dist.ReduceOp.MAX)
                    turns = [turn_steps(t, turn_s, block) for t in slowest.tolist()]
                shift = index % len(pipes)
                for which in [*range(shift, len(pipes)), *range(shift)]:
                    steps = []
                    for _ in range(turns[which]):
                        if self.world > 1:
                            dist.barrier()
                        start = time.perf_counter()
                        workload.step(pipes[which], self.rank, self.world)
                        steps.append(time.perf_counter() - start)
                    last[which] = steps[-1]
                    if index >= warmup:
                        times[which].append(statistics.median(steps[len(steps) // 2 :]))
            return times
        finally:
            for pipe in built:
                pipe.close()

    def steady(self, name: str, steps: int) -> list[float]:
        """The tuned pipe's consecutive steps, as a training loop runs them (what its plan,
        calibrated from such steps, predicts): each one's time on this rank, after as many
        untimed (the first steps after the groups' pipes were closed ran 1.7x slower)."""
        workload, pipe = self.workloads[name], self.tuned[name]
        times = []
        for _ in range(2 * steps):
            start = time.perf_counter()
            workload.step(pipe, self.rank, self.world)
            times.append(time.perf_counter() - start)
        return times[steps:]


def worker(rank: int, port: int, requests: Any, replies: Any, parent: int) -> None:
    world = int(os.environ["AUTO_PLAN_WORLD"])
    with in_gloo_pair(rank, port, REPLY_TIMEOUT_S, replies, pin_threads=False, world=world):
        job = Job(rank, world)
        replies.put((rank, "ready", None, None))
        for request in requests_of(requests, parent):
            kind, payload = request
            if kind == "tune":
                replies.put((rank, kind, job.tune(payload), None))
            elif kind == "group":
                replies.put((rank, kind, job.group(**payload), None))
            elif kind == "steady":
                replies.put((rank, kind, job.steady(**payload), None))


def _spread(errors: list[float]) -> dict[str, float | None]:
    if not errors:
        return {"median": None, "worst": None}
    return {"median": statistics.median(errors), "worst": max(errors)}


def run(name: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    os.environ["AUTO_PLAN_WORLD"] = str(world)
    workers = WorkerPair(worker, REPLY_TIMEOUT_S, world=world)
    try:
        tuned = workers.ask(("tune", name), "tune")[0]
        print(tuned["text"])

        def steady() -> float:
            """The tuned pipe's median consecutive step (each the slower rank's)."""
            payload = {"name": name, "steps": 4 * args.rounds}
            ranks = workers.ask(("steady", payload), "steady")
            return statistics.median(max(step) for step in zip(*ranks, strict=True))

        steady_s = steady()  # as a user's training goes on from the tuning: the plan's check
        configs: list[dict[str, Any] | None] = [
            {k: c[k] for k in ("schedule", "balance", "split_points", "chunks", "checkpoint")}
            for c in tuned["candidates"]
        ]
        if args.most is not None:
            configs = configs[: args.most]
            if tuned["choice"] not in configs:
                configs.append(tuned["choice"])
        reference: list[float] = []

        def ratios(part: list[dict[str, Any] | None], rounds: int) -> list[float]:
            """Each config's median ratio to the tuned pipe in the same round."""
            payload = {"name": name, "configs": part, "devices": tuned["devices"],
                       "rounds": rounds, "warmup": args.warmup, "block": args.block,
                       "turn_s": args.turn_ms / 1e3}  # fmt: skip
            ranks = workers.ask(("group", payload), "group")
            # Each round's step: the slower rank's time.
            times = [[max(r) for r in zip(*(rank[i] for rank in ranks), strict=True)]
                     for i in range(len(part) + 1)]  # fmt: skip
            reference.extend(times[0])
            return [statistics.median(t / ref for t, ref in zip(series, times[0], strict=True))
                    for series in times[1:]]  # fmt: skip

        swept: list[float] = []
        for start in range(0, len(configs), args.group):
            swept += ratios(configs[start : start + args.group], args.rounds)
            print(f"  measured {min(start + args.group, len(configs))} / {len(configs)}",
                  flush=True)  # fmt: skip
        # The sweep's fastest again, with the defaults (None: nothing given), for 3x the
        # rounds: the least of many noisy medians is low by chance (the winner's curse), so
        # the best is confirmed.
        top = sorted(range(len(swept)), key=swept.__getitem__)[: args.confirm]
        *confirmed, defaults_ratio = ratios([configs[i] for i in top] + [None], 3 * args.rounds)
        later_s = steady()
    finally:
        workers.stop()
    auto_s = statistics.median(reference)
    sweep = [auto_s * r for r in swept]
    first = min(range(len(confirmed)), key=confirmed.__getitem__)
    best, best_s = top[first], auto_s * confirmed[first]
    defaults_s = auto_s * defaults_ratio
    before, after = [], []
    for candidate, seconds in zip(tuned["candidates"], sweep, strict=False):
        if candidate["predicted_s"]:
            before.append(abs(candidate["predicted_s"] / seconds - 1))
        if candidate["calibrated_s"]:
            after.append(abs(candidate["calibrated_s"] / seconds - 1))
    result = {
        "workload": name, "processes": world, "tuning_s": tuned["seconds"],
        "choice": tuned["choice"], "auto_ms": auto_s * 1e3,
        "best": configs[best], "best_ms": best_s * 1e3, "best_swept_ms": sweep[best] * 1e3,
        "auto_over_best": auto_s / best_s,
        "defaults_ms": defaults_s * 1e3, "defaults_over_auto": defaults_s / auto_s,
        "swept": len(sweep),
        "error_before": _spread(before), "error_after": _spread(after),
        "steady_ms": steady_s * 1e3, "steady_after_sweep_ms": later_s * 1e3,
        "plan_ms": None if tuned["plan_s"] is None else tuned["plan_s"] * 1e3,
        "plan_over_measured": None if tuned["plan_s"] is None else tuned["plan_s"] / steady_s,
        "plan_over_after_sweep": None if tuned["plan_s"] is None else tuned["plan_s"] / later_s,
        "fit": tuned["fit"], "notes": tuned["notes"],
        "candidates": [{**c, "swept_ms": seconds * 1e3}
                       for c, seconds in zip(tuned["candidates"], sweep, strict=False)],
    }  # fmt: skip
    _print(result)
    return result


def _print(r: dict[str, Any]) -> None:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    print(f"\n{r['workload']}, {r['processes']} process(es): tuning {r['tuning_s']:.1f} s; "
          f"auto {_label(r['choice'])}: {r['auto_ms']:.2f} ms")  # fmt: skip
    print(f"  best of {r['swept']} swept (confirmed): {_label(r['best'])}: {r['best_ms']:.2f} ms "
          f"(swept {r['best_swept_ms']:.2f}); auto / best {r['auto_over_best']:.3f} "
          "(target <= 1.05)")  # fmt: skip
    print(f"  defaults {r['defaults_ms']:.2f} ms: {r['defaults_over_auto']:.2f}x the auto pick")
    before, after = r["error_before"], r["error_after"]
    print(f"  gf.plan |predicted/measured - 1|: before calibration median "
          f"{pct(before['median'])}, worst {pct(before['worst'])}; after "
          f"median {pct(after['median'])}, worst {pct(after['worst'])}")  # fmt: skip
    if r["plan_over_measured"] is not None:
        ratio = r["plan_over_measured"]
        print(f"  the chosen plan predicts {r['plan_ms']:.2f} ms: {ratio:.3f} of its "
              f"consecutive steps' {r['steady_ms']:.2f} ms right after the tuning (target: "
              f"within 10%); {r['plan_over_after_sweep']:.3f} of their "
              f"{r['steady_after_sweep_ms']:.2f} ms after the sweep")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--group", type=int, default=8, help="pipes measured together")
    parser.add_argument("--block", type=int, default=2,
                        help="a turn's steps at least (the latter half timed)")  # fmt: skip
    parser.add_argument("--turn-ms", type=float, default=50.0,
                        help="a turn's steps last about this long")  # fmt: skip
    parser.add_argument("--confirm", type=int, default=4,
                        help="the sweep's fastest measured again, for 3x the rounds")  # fmt: skip
    parser.add_argument(
        "--most",
        type=int,
        default=None,
        help="sweep only the N best predicted candidates (and the pick)",
    )
    parser.add_argument("--small", action="store_true", help="small sizes: a quick check")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.small:
        os.environ["AUTO_PLAN_SMALL"] = "1"  # the spawned workers read it
    results = []
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            parser.error(f"--workloads: unknown {name!r}; choose among {WORKLOADS}")
        for world in (int(p) for p in args.processes.split(",")):
            results.append(run(name, world, args))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
