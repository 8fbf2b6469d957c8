"""On paper: the simulator's step time and bubble of a pipeline over many processes.

Each of K processes holds one stage of a model whose forward of one micro-batch costs
`--model-ms` in all (so a stage's forward costs model-ms / K, its backward twice that); a
boundary tensor of `--boundary-mib` crosses an inter-node link of `--link-gbps` GB/s on every
send (the receive task lasts the transfer; a rank receives one tensor at a time). M = 4K
micro-batches. The schedules are the ones the runtime runs, lowered onto the processes with
their sends and receives (gf._C.lowered_program), and simulated as they are.

Reported per K: the step time, its bubble (idle share of the compute workers, transfers
included), the time per micro-batch, and the throughput against the smallest K's (the paper's
Table 2 normalises throughput the same way: at M >> K it grows almost linearly with K).

    python bench/simulate_scaling.py [--model-ms 256] [--link-gbps 25] [--boundary-mib 8]
                                     [--stages 8 32 128]
"""

from __future__ import annotations

import argparse
import sys
import time

from gpipe_fast import _C


def simulate(
    kind: str, stages: int, microbatches: int, forward: float, transfer: float
) -> tuple[float, float]:
    """(makespan, bubble of the compute workers) of `kind` lowered onto `stages` ranks."""
    program, _ = _C.lowered_program(
        kind, stages, stages, microbatches, "never", list(range(stages)), False
    )
    schedule = _C.link(program, stages, microbatches, [s % stages for s in range(stages)])
    names = _C.actions()
    cost = {
        "forward": forward,
        "backward": 2 * forward,
        "loss": 0.0,
        "recv_forward": transfer,
        "recv_backward": transfer,
    }
    costs = [cost.get(names[t.action], 0.0) for t in schedule.tasks]
    timeline = _C.simulate(schedule, costs)
    busy = sum(c for t, c in zip(schedule.tasks, costs, strict=True) if t.worker < stages)
    return timeline.makespan, 1.0 - busy / (stages * timeline.makespan)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-ms", type=float, default=256.0)
    parser.add_argument("--link-gbps", type=float, default=25.0)
    parser.add_argument("--boundary-mib", type=float, default=8.0)
    parser.add_argument("--stages", type=int, nargs="+", default=[8, 32, 128])
    args = parser.parse_args()
    transfer = args.boundary_mib * 2**20 / (args.link_gbps * 1e9) * 1e3  # ms
    print(
        f"model forward {args.model_ms} ms per micro-batch in all; transfer {transfer:.3f} ms "
        f"per boundary tensor ({args.boundary_mib} MiB at {args.link_gbps} GB/s); M = 4K"
    )
    print(
        "| K | M | schedule | step (ms) | bubble | ms per micro-batch | throughput vs "
        f"K={args.stages[0]} (ideal) |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind in ("gpipe", "1f1b"):
        base = None
        for stages in args.stages:
            microbatches = 4 * stages
            start = time.perf_counter()
            makespan, bubble = simulate(
                kind, stages, microbatches, args.model_ms / stages, transfer
            )
            per_microbatch = makespan / microbatches
            # One micro-batch's work is shared by K devices: micro-batches per ms grow with K
            # as far as the bubble and the transfers allow (ideally K / K0 times).
            throughput = microbatches / makespan
            base = base or throughput
            ideal = stages / args.stages[0]
            print(
                f"| {stages} | {microbatches} | {kind} | {makespan:.1f} | {bubble:.1%} | "
                f"{per_microbatch:.3f} | {throughput / base:.2f}x ({ideal:.0f}x) |"
            )
            print(f"  (simulated in {time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
