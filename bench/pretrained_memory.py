"""Peak memory of each rank loading a pretrained LLaMA into a pipe: the whole model on every
rank (from_pretrained, then gf.pipeline) against the model built on the meta device,
pipelined, and each rank reading only its stages' tensors
(gpipe_fast.integrations.transformers.load_pretrained).

    python bench/pretrained_memory.py                       # 2 processes, a 0.17 B-parameter LLaMA
    python bench/pretrained_memory.py --processes 4 --layers 16

It saves a randomly initialised model with save_pretrained into a temporary folder (built from a
config, no download), then runs each way of loading as a torchrun job of --processes ranks, one
stage each. Each rank reports its peak resident memory (ru_maxrss) above what it held once
torch and transformers were imported; the table prints the largest rank's and the model's size.
Memory, not time: the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if any((ROOT / "gpipe_fast").glob("_C*")):  # run from a built checkout: use its gpipe_fast
    sys.path.insert(0, str(ROOT))

WAYS = ("whole", "meta")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def save_model(folder: Path, args: argparse.Namespace) -> float:
    """A LlamaForCausalLM of the given size saved into `folder`; its size in MiB."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.width * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.width // 64,
        num_key_value_heads=max(1, args.width // 256), use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    model.to(torch.bfloat16).save_pretrained(folder)  # as pretrained weights come: bfloat16
    return size


def worker(way: str, folder: str) -> None:
    """One rank of a job: load the pretrained model into a pipe `way`, report the peak."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import gpipe_fast as gf
    from gpipe_fast.integrations.transformers import load_pretrained

    dist.init_process_group("gloo")
    base = peak_mib()
    ids = torch.zeros(1, 8, dtype=torch.long)
    if way == "whole":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        pipe = gf.pipeline(model, {"input_ids": ids}, pp_group=dist.group.WORLD)
    else:
        with torch.device("meta"):
            config = AutoConfig.from_pretrained(folder)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        pipe = gf.pipeline(model, {"input_ids": ids}, pp_group=dist.group.WORLD,
                           init_fn=model._init_weights)  # fmt: skip
        load_pretrained(pipe, folder)
    held = sum(t.numel() * t.element_size() for t in pipe.state_dict().values()) / 2**20
    with torch.no_grad():  # the pipe runs: every rank's stages hold their weights
        pipe(input_ids=ids)
    report = {"rank": dist.get_rank(), "peak_mib": peak_mib() - base, "stage_mib": held}
    print("REPORT " + json.dumps(report), flush=True)
    pipe.close()
    dist.destroy_process_group()


def run(way: str, folder: Path, processes: int) -> list[dict[str, float]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={processes}", __file__, "--worker", way, str(folder)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"{way}: the job failed\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    return sorted((json.loads(line[len("REPORT ") :]) for line in lines), key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--worker", nargs=2, metavar=("WAY", "FOLDER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return
    with tempfile.TemporaryDirectory(prefix="gpipe-pretrained-") as scratch:
        folder = Path(scratch)
        size = save_model(folder, args)
        print(f"LlamaForCausalLM, {args.layers} layers of width {args.width}, vocabulary "
              f"{args.vocab}: {size:.0f} MiB of float32 weights; {args.processes} processes, "
              f"one stage each\n")  # fmt: skip
        print("| loading | stage held (MiB, largest rank) | peak above baseline (MiB, largest "
              "rank) | peak / model size |")  # fmt: skip
        print("|---|---|---|---|")
        for way in WAYS:
            reports = run(way, folder, args.processes)
            peak = max(r["peak_mib"] for r in reports)
            stage = max(r["stage_mib"] for r in reports)
            label = {"whole": "from_pretrained on every rank, then gf.pipeline",
                     "meta": "meta device, gf.pipeline, load_pretrained"}[way]  # fmt: skip
            print(f"| {label} | {stage:.0f} | {peak:.0f} | {peak / size:.2f} |", flush=True)


if __name__ == "__main__":
    main()
