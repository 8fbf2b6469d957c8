"""The figures the README and the guide quote, measured afresh: run it, then copy them in.

    python bench/readme_figures.py            # about a minute on 2 idle CPU cores
    python bench/readme_figures.py --pp 2     # train_lm.py across 2 processes (torchrun)

- README.md, "Training a language model": `python examples/train_lm.py` with its defaults
  (the corpus and its vocabulary, the parameters, the first and last training loss, the
  validation loss, tokens/s, the time of the training steps, a checkpoint's time and size);
- docs/skip.md: `python examples/unet.py --cells 3 --steps 60 --schedule 1f1b` (its loss,
  its time);
- docs/concepts.md and docs/usage.md: the simulator's bubble per schedule (4 workers, M = 8,
  a backward twice a forward), as bench/schedule_memory.py computes it.

Each example runs as the guide shows it, in a process of its own, and the figures are read
from what it prints. Timings are only as good as the machine is idle: the load average is
printed beside them. `--steps N` shortens the runs to check that the script works (then the
figures are not the README's).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from schedule_memory import WORKERS, predicted_bubble

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")
LM_STEPS, LM_CHECKPOINT_EVERY, UNET_STEPS = 600, 300, 60


def _run(command: list[str]) -> str:
    """`command`'s stdout; it must succeed. gpipe_fast comes from this checkout."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # torchrun on one machine: gloo over loopback
    print("+", " ".join(command), flush=True)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{command} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result.stdout


def _find(pattern: str, text: str) -> re.Match[str]:
    match = re.search(pattern, text)
    if match is None:
        raise SystemExit(f"no line matching {pattern!r} in:\n{text[-3000:]}")
    return match


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _span(values: list[float]) -> str:
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}-{high}"


def train_lm(pp: int, steps: int) -> list[str]:
    script = str(ROOT / "examples" / "train_lm.py")
    with tempfile.TemporaryDirectory() as scratch:
        flags = ["--no-progress", "--checkpoint-dir", scratch,
                 "--checkpoint-every", str(min(LM_CHECKPOINT_EVERY, steps))]  # fmt: skip
        if steps != LM_STEPS:
            flags += ["--steps", str(steps)]
        launcher = [sys.executable]
        if pp > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone",
                         f"--nproc-per-node={pp}"]  # fmt: skip
            flags += ["--pp", str(pp)]
        out = _run([*launcher, script, *flags])
    corpus = _find(r"corpus: ([\d,]+) characters, vocabulary (\d+); model: ([\d.]+) M", out)
    vocab = int(corpus.group(2))
    losses = _find(r"train loss: first ([\d.]+) \(step 1\), last ([\d.]+) \(step (\d+)\); "
                   r"([\d,]+) tokens/s", out)  # fmt: skip
    validation = _number(_find(r"final validation loss: ([\d.]+)", out).group(1))
    rate = _number(losses.group(4))
    saves = re.findall(r"checkpoint step-\d+: ([\d.]+) s, (.+) per rank", out)
    seconds = [float(s) for s, _ in saves]
    sizes = sorted({size for _, per_rank in saves for size in per_rank.split(", ")})
    where = f"{pp} processes, one cell each" if pp > 1 else "one process, 2 CPU cells"
    trained = int(losses.group(3)) * 32 * 32 / rate  # 32 x 32 characters a step (defaults)
    return [
        f"README.md, 'Training a language model': examples/train_lm.py ({where})",
        f"  corpus {corpus.group(1)} characters, vocabulary {vocab} (a uniform guess: "
        f"ln {vocab} = {math.log(vocab):.2f}); model {corpus.group(3)} M parameters",
        f"  train loss {_number(losses.group(1)):.2f} at step 1 -> "
        f"{_number(losses.group(2)):.2f} at step {losses.group(3)}; validation {validation:.2f}",
        f"  {trained:.0f} s of training steps, {rate / 1000:.1f} k tokens/s",
        f"  a checkpoint: {_span(seconds)} s, {' / '.join(sizes)} per rank",
    ]


def unet(steps: int) -> list[str]:
    flags = ["--cells", "3", "--steps", str(steps), "--schedule", "1f1b"]
    out = _run([sys.executable, str(ROOT / "examples" / "unet.py"), *flags])
    seconds = _find(r"trained \d+ steps in ([\d.]+) s", out).group(1)
    first, last = _find(r"loss ([\d.]+) -> ([\d.]+)", out).groups()
    return [
        f"docs/skip.md: examples/unet.py {' '.join(flags)}",
        f"  loss {float(first):.3f} -> {float(last):.4f} in {steps} steps, {seconds} s",
    ]


def stages(schedule: str) -> int:
    """The cells of the guide's comparison: one per worker, two for interleaved and zbv."""
    return 2 * WORKERS if schedule in ("interleaved", "zbv") else WORKERS


def bubbles() -> list[str]:
    shares = [f"{s} {predicted_bubble(s, stages(s)):.1%}" for s in SCHEDULES]
    return [
        f"docs/concepts.md, docs/usage.md: the simulator's bubble, {WORKERS} workers, M = 8, "
        "a backward twice a forward (interleaved: V = 2)",
        "  " + ", ".join(shares),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=1, help="train_lm.py's pipeline processes")
    parser.add_argument("--steps", type=int, default=None, help="shorter runs (a smoke test)")
    args = parser.parse_args(argv)
    lines = [
        *train_lm(args.pp, args.steps or LM_STEPS),
        *unet(args.steps or UNET_STEPS),
        *bubbles(),
        f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end "
        f"(timings hold for an idle machine only), torch {torch.__version__}",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
