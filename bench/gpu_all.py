"""Every GPU measurement in one process, in order, within one time budget, into one JSON record:
a GPU session's single command (the scripts it runs also run alone)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import gpu_copy_bandwidth
import gpu_harness as harness
import gpu_largest_model
import gpu_peak_memory
import gpu_recompute_pool
import gpu_step_overhead
import gpu_transformers

SCRIPTS = {
    script.NAME: script
    for script in (
        gpu_step_overhead,
        gpu_copy_bandwidth,
        gpu_peak_memory,
        gpu_largest_model,
        gpu_recompute_pool,
        gpu_transformers,
    )
}
# No measurement starts after this many seconds, so the session's device time (30 minutes,
# 10 per command) holds the build and the whole run.
BUDGET_S = {"full": 300.0, "quick": 180.0, "smoke": 60.0}


def parse_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCRIPTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown measurement(s) {unknown}; pick from {', '.join(SCRIPTS)}"
        )
    return [name for name in SCRIPTS if name in names]  # always in the documented order


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser(__doc__, Path(__file__).name)
    parser.add_argument(
        "--only",
        type=parse_names,
        default=list(SCRIPTS),
        help=f"comma-separated subset of {','.join(SCRIPTS)} (default: all, in that order)",
    )
    gpu_largest_model.add_arguments(parser)
    args = parser.parse_args(argv)
    measurements = [SCRIPTS[name].measurement(args) for name in args.only]
    budget = BUDGET_S[harness.scale(args)]
    return harness.run(Path(__file__).name, measurements, args, argv, budget_s=budget)


if __name__ == "__main__":
    sys.exit(main())
