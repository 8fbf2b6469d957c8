"""The shape of the GPipe paper's Table 1 on CPU: the deepest model whose training step fits
a memory budget, plain model ("naive") vs gpipe_fast per checkpoint mode.

Model: depth x (Linear(64, 64) + ReLU), batch 2048, forward + out.sum().backward(); the
pipes use K = 4 CPU cells (devices ["cpu"] * 4, near-equal balance), M = 8 micro-batches,
checkpoint "never", "except_last" or "always". Narrow layers and a large batch make the
activations, not the parameters, the memory that grows with depth (0.5 MiB per layer of
the plain model).

Memory measure: every probe (one mode, one depth) runs in a fresh subprocess, with
MALLOC_MMAP_THRESHOLD_=65536 so that glibc maps every tensor of 64 KiB or more on its own
and unmaps it when freed (the resident set then follows the live tensors, without glibc
keeping freed blocks in its arenas). The subprocess builds the model, runs a warm-up step
on M samples (which allocates the gradients, the worker threads and their arenas), then
resets the kernel's peak-RSS mark (writing 5 to /proc/self/clear_refs), reads VmRSS as the
baseline, runs one training step on the full batch and reads VmHWM. The step's memory is
VmHWM - baseline: the activations, the autograd graph and the transient buffers of the
step, above the model, its gradients and the input batch. PyTorch's CPU allocator keeps no
statistics, so the resident set is the honest measure here.

Search per mode: depths on a grid of 8 layers; probes at 16 and 64 layers fit a line,
then probes around its prediction (interpolating between the deepest fitting and the
shallowest non-fitting depth) until those two are 8 layers apart. A second table gives each
mode's step memory at the naive model's largest depth.

CPU cells share one memory, so this is the total memory of all cells (the paper's
"Pipeline-1" column, re-materialisation on one device), not memory per device.

With --device cuda every cell is cuda:0 (again "Pipeline-1") and the step memory is read from
PyTorch's caching allocator instead of the resident set: after the warm-up step the probe
resets the peak (torch.cuda.reset_peak_memory_stats), and the step memory is
torch.cuda.max_memory_allocated() at the end of the step minus memory_allocated() before it.

    python bench/side_by_side_table1.py [--budget-mib 128] [--json out.json]
    python bench/side_by_side_table1.py --device cuda [--budget-mib 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WIDTH, BATCH, CELLS, CHUNKS, GRID = 64, 2048, 4, 8, 8
MODES = ("naive", "never", "except_last", "always")
PROBE_TIMEOUT_S = 300


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def probe(mode: str, depth: int, device: str = "cpu") -> dict[str, float]:
    """Runs in the subprocess: one training step of `depth` layers in `mode` on `device`."""
    import torch
    from torch import nn

    import gpipe_fast as gf

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(depth)]
    ).to(device)
    params = sum(p.numel() for p in model.parameters())
    if mode == "naive":
        net: nn.Module = model
    else:
        balance = [depth // CELLS + (k < depth % CELLS) for k in range(CELLS)]
        net = gf.GPipe(model, balance, devices=[device] * CELLS, chunks=CHUNKS, checkpoint=mode)
    net(torch.randn(CHUNKS, WIDTH, device=device)).sum().backward()  # warm-up: gradients, threads
    x = torch.randn(BATCH, WIDTH, device=device)
    on_cuda = device != "cpu"
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        baseline = _status_bytes("VmRSS:")
    start = time.perf_counter()
    net(x).sum().backward()
    if on_cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if on_cuda else _status_bytes("VmHWM:")
    return {
        "step_bytes": peak - baseline,
        "baseline_bytes": baseline,
        "params": params,
        "seconds": seconds,
    }


def run_probe(mode: str, depth: int, device: str = "cpu") -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--probe",
            mode,
            str(depth),
            "--device",
            device,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"probe {mode} depth {depth} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def largest_depth(
    mode: str, budget: int, log: dict[int, dict[str, float]], device: str = "cpu"
) -> int:
    """Largest depth on the grid whose step memory is within budget (probes into log)."""

    def measure(depth: int) -> int:
        if depth not in log:
            log[depth] = run_probe(mode, depth, device)
            mib = log[depth]["step_bytes"] / 2**20
            print(
                f"  {mode:<12} depth {depth:>5}: {mib:8.1f} MiB "
                f"({log[depth]['seconds']:.1f} s step)",
                flush=True,
            )
        return int(log[depth]["step_bytes"])

    def on_grid(depth: float) -> int:
        return max(GRID, int(depth) // GRID * GRID)

    fits, fails = 0, 0  # deepest depth known to fit, shallowest known not to (0: none)
    for depth in (16, 64):
        if measure(depth) <= budget:
            fits = depth
        else:
            fails = depth
            break
    if fits == 0:
        return 0
    while fails == 0 or fails - fits > GRID:
        if fails == 0:  # extrapolate the line through the shallowest and deepest probes
            a, b = min(log), max(log)
            slope = (log[b]["step_bytes"] - log[a]["step_bytes"]) / (b - a)
            guess = b + (budget - log[b]["step_bytes"]) / max(slope, 1.0)
            depth = min(max(on_grid(guess), fits + GRID), 64 * fits)
        else:  # interpolate between the brackets, strictly inside them
            low, high = log[fits]["step_bytes"], log[fails]["step_bytes"]
            guess = fits + (budget - low) * (fails - fits) / max(high - low, 1.0)
            depth = min(max(on_grid(guess), fits + GRID), fails - GRID)
        # The line's guess usually lands next to the limit: probe its neighbour as well.
        if measure(depth) <= budget:
            fits = depth
            if fails == 0 or depth + GRID < fails:
                if measure(depth + GRID) <= budget:
                    fits = depth + GRID
                else:
                    fails = depth + GRID
        else:
            fails = depth
            if depth - GRID > fits:
                if measure(depth - GRID) <= budget:
                    fits = depth - GRID
                else:
                    fails = depth - GRID
    return fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mib", type=int, default=128)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda", "cuda:0"),
        help="cuda: all cells on cuda:0, step memory from torch.cuda's allocator statistics",
    )
    parser.add_argument("--probe", nargs=2, metavar=("MODE", "DEPTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = "cpu" if args.device == "cpu" else "cuda:0"
    if args.probe:
        print(json.dumps(probe(args.probe[0], int(args.probe[1]), device)))
        return
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            print(
                "side_by_side_table1.py: --device cuda needs a CUDA GPU; none is visible",
                file=sys.stderr,
            )
            sys.exit(2)

    budget = args.budget_mib * 2**20
    started = time.perf_counter()
    print(
        f"budget: {args.budget_mib} MiB of step memory above the model; width {WIDTH}, "
        f"batch {BATCH}, K={CELLS}, M={CHUNKS}, cells on {device}; load average "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )
    logs: dict[str, dict[int, dict[str, float]]] = {mode: {} for mode in MODES}
    best = {mode: largest_depth(mode, budget, logs[mode], device) for mode in MODES}
    naive_depth = best["naive"]
    at_naive = {}
    for mode in MODES:
        if naive_depth and naive_depth not in logs[mode]:
            logs[mode][naive_depth] = run_probe(mode, naive_depth, device)
        at_naive[mode] = logs[mode].get(naive_depth, {}).get("step_bytes", float("nan"))

    print(f"\nlargest depth within {args.budget_mib} MiB (grid of {GRID} layers)")
    header = f"{'mode':<14}{'depth':>7}{'params':>11}{'step MiB':>10}{'vs naive':>10}{'step s':>8}"
    print(header)
    print("-" * len(header))
    for mode in MODES:
        depth = best[mode]
        row = logs[mode][depth]
        ratio = depth / naive_depth if naive_depth else float("nan")
        print(
            f"{mode:<14}{depth:>7}{row['params'] / 1e6:>10.2f}M"
            f"{row['step_bytes'] / 2**20:>10.1f}{ratio:>9.2f}x{row['seconds']:>8.1f}"
        )
    print(f"\nstep memory at the naive model's largest depth ({naive_depth} layers)")
    for mode in MODES:
        mib = at_naive[mode] / 2**20
        print(f"{mode:<14}{mib:>10.1f} MiB{at_naive[mode] / at_naive['naive']:>9.2f}x of naive")
    print(f"\n(total {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device,
                    "budget_mib": args.budget_mib,
                    "largest_depth": best,
                    "probes": {m: {str(d): r for d, r in log.items()} for m, log in logs.items()},
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
