"""Per-rank peak memory of a training step: each stage replicated over dp, or sharded (dp_shard).

Run under torchrun, with glibc returning freed memory at once so that the peak resident set
(VmHWM, reset before each step) follows live tensors:

    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_ARENA_MAX=2 OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo \\
      torchrun --standalone --nproc-per-node 2 bench/shard_memory.py [--width 512 --blocks 8]

An MLP of `blocks` blocks (Linear(w, 4w), ReLU, Linear(4w, w)) with AdamW and a
small batch per replica, so that the model's state (16 bytes per parameter replicated)
outweighs the activations: the case sharding is for. Each layout runs `--steps` steps in
turn in the same processes; the table gives, per rank, the peak of the last step above what
the process held before the model was built.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf


def _status(key: str) -> float:
    """A /proc/self/status figure in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _model(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers)


def _peak(args: argparse.Namespace, shard: bool) -> float:
    """The last step's peak resident set above the process's before the model, in MiB."""
    before = _status("VmRSS")
    model = _model(args.width, args.blocks)
    pipe = gf.GPipe(model, [len(model)], devices=["cpu"], chunks=args.chunks,
                    checkpoint="never", dp_group=dist.group.WORLD, dp_shard=shard,
                    timeout=300)  # fmt: skip
    del model
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    peak = 0.0
    try:
        for _ in range(args.steps):
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
            opt.zero_grad(set_to_none=True)
            pipe.train_step(x, y, nn.functional.mse_loss)
            opt.step()
            peak = _status("VmHWM") - before
    finally:
        pipe.close()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="rows per replica")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    params = sum(p.numel() for p in _model(args.width, args.blocks).parameters())
    replicated = _peak(args, shard=False)
    sharded = _peak(args, shard=True)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (dist.get_rank(), replicated, sharded))
    if dist.get_rank() == 0:
        print(f"{params / 1e6:.1f} M parameters ({16 * params / 2**20:.0f} MiB of parameters, "
              f"gradients and AdamW state), dp={dist.get_world_size()}, batch {args.batch} "
              "per replica")  # fmt: skip
        print("| rank | replicated peak MiB | sharded peak MiB | ratio |")
        print("|---|---|---|---|")
        for rank, rep, sha in rows:  # type: ignore[misc]
            print(f"| {rank} | {rep:.0f} | {sha:.0f} | {rep / sha:.2f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
