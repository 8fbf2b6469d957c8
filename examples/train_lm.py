"""Train a small GPT-style character language model on this repository's own docs through a
gpipe_fast pipe, with DCP checkpoints that a restarted job resumes from without losing a step.

    python examples/train_lm.py                                   # one process, 2 CPU cells
    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --pp 2
    torchrun --standalone --nproc-per-node 4 examples/train_lm.py --pp 2 --dp 2

(on this machine: GLOO_SOCKET_IFNAME=lo). With --checkpoint-dir the job writes
DIR/step-<N>/ every --checkpoint-every steps and, when started again, resumes from the latest
complete one: the model, AdamW's state and the step come back, the learning rate and the
batches are derived from the step, so the resumed run computes exactly what the
uninterrupted run would have. The checkpoint's keys are the model's own, so a checkpoint
written at one --pp/--dp/--schedule resumes at another.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if any((ROOT / "gpipe_fast").glob("_C*")):  # run from a built checkout: use its gpipe_fast
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor  # noqa: E402

import gpipe_fast as gf  # noqa: E402

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


# --- data -----------------------------------------------------------------------------------


class Corpus:
    """README.md and docs/*.md as one character-level text; the last 10% is validation."""

    def __init__(self, root: Path = ROOT) -> None:
        files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
        text = "\n\n".join(path.read_text(encoding="utf-8") for path in files if path.exists())
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor([index[c] for c in text], dtype=torch.long)
        cut = int(len(data) * 0.9)
        self.train, self.val = data[:cut], data[cut:]

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, step: int, size: int, context: int, seed: int) -> tuple[Tensor, Tensor]:
        """Step `step`'s global batch: its offsets come from a generator seeded by (seed,
        step) alone, so a resumed run draws exactly the batches the uninterrupted one did."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        offsets = torch.randint(0, len(self.train) - context - 1, (size,), generator=generator)
        return _windows(self.train, offsets, context)

    def val_batch(self, size: int, context: int) -> tuple[Tensor, Tensor]:
        """A fixed validation batch: `size` windows evenly spaced over the validation text."""
        offsets = torch.linspace(0, len(self.val) - context - 1, size).long()
        return _windows(self.val, offsets, context)


def _windows(data: Tensor, offsets: Tensor, context: int) -> tuple[Tensor, Tensor]:
    rows = offsets[:, None] + torch.arange(context + 1)
    ids = data[rows]
    return ids[:, :-1], ids[:, 1:]


# --- model ----------------------------------------------------------------------------------


class Embeddings(nn.Module):
    """Token and position embedding, one module (one layer of the pipe)."""

    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.size(1), device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual. No dropout: a resumed
    run needs no random state but the step's."""

    def __init__(self, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        for linear in (self.qkv, self.proj, self.fc, self.out):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)
        for linear in (self.proj, self.out):  # GPT-2's scaled residual projections
            nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(nn.functional.gelu(self.fc(self.ln_2(x))))


def build_model(vocab: int, layers: int, width: int, heads: int, context: int,
                seed: int) -> nn.Sequential:  # fmt: skip
    """Embeddings, `layers` blocks, a final LayerNorm and an LM head tied to the token
    embedding (the tie spans the first and the last cell)."""
    torch.manual_seed(seed)
    embeddings = Embeddings(vocab, width, context)
    blocks = [Block(width, heads, layers) for _ in range(layers)]
    head = nn.Linear(width, vocab, bias=False)
    head.weight = embeddings.tokens.weight
    return nn.Sequential(embeddings, *blocks, nn.LayerNorm(width), head)


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                       targets.reshape(-1))  # fmt: skip


def even_balance(layers: int, cells: int) -> list[int]:
    """`layers` split into `cells` contiguous near-equal parts (the later ones larger)."""
    if layers < cells:
        raise SystemExit(f"{layers} layers cannot fill {cells} cells: raise --layers")
    base, extra = divmod(layers, cells)
    return [base + (1 if i >= cells - extra else 0) for i in range(cells)]


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10% at `steps`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


# --- checkpoints ----------------------------------------------------------------------------


def latest_checkpoint(directory: Path) -> tuple[int, Path] | None:
    """The latest complete checkpoint: a step-<N> folder exists only once every rank's
    dcp.save has returned (it is written as step-<N>.tmp and renamed after a barrier)."""
    found = []
    for path in directory.glob("step-*"):
        suffix = path.name[len("step-") :]
        if path.is_dir() and suffix.isdigit() and (path / ".metadata").exists():
            found.append((int(suffix), path))
    return max(found) if found else None


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whole: a shard of a sharded stage (a DTensor) gathered."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def save_checkpoint(directory: Path, step: int, pipe: gf.GPipe, opt: torch.optim.Optimizer,
                    rank: int, distributed: bool,
                    saved: Callable[[], None] = lambda: None) -> tuple[float, int]:  # fmt: skip
    """Writes DIR/step-<step>/ with model, optimizer and step; returns (seconds, bytes this
    rank wrote). `saved` runs when this rank's dcp.save has returned (a test kills it there)."""
    start = time.perf_counter()
    final = directory / f"step-{step}"
    partial = directory / f"step-{step}.tmp"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed mid-save
    if distributed:
        dist.barrier()
    model_state, optim_state = get_state_dict(pipe, opt, options=FLAT)
    state = {"model": model_state, "optim": optim_state, "train": {"step": step}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process: DCP warns that it saves alone
        dcp.save(state, checkpoint_id=str(partial))
    size = sum(f.stat().st_size for f in partial.glob(f"__{rank}_*"))  # before the rename
    saved()
    if distributed:
        dist.barrier()  # every rank's shards are written
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)  # atomic: step-<N> is complete or absent
    if distributed:
        dist.barrier()
    return time.perf_counter() - start, size


def load_checkpoint(path: Path, pipe: gf.GPipe, opt: torch.optim.Optimizer) -> int:
    model_state, optim_state = get_state_dict(pipe, opt, options=FLAT)
    state = {"model": model_state, "optim": optim_state, "train": {"step": -1}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(pipe, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=FLAT)  # fmt: skip
    return int(state["train"]["step"])


# --- the job --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--pp", type=int, default=1, help="pipeline processes")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--dp-shard", action="store_true",
                   help="shard each stage over the replicas (FSDP2), not replicate it")  # fmt: skip
    p.add_argument("--schedule", choices=gf.schedules(), default="1f1b")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per replica's batch")
    p.add_argument("--bf16", action="store_true", help="torch.autocast bf16 around train_step")
    p.add_argument("--clip", type=float, default=1.0, help="max grad norm (0: no clipping)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="global batch (split over --dp)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument(
        "--eval-every", type=int, default=0, help="validation every N steps (0: only at the end)"
    )
    p.add_argument("--val-batch", type=int, default=32)
    p.add_argument("--loss-curve", type=Path, default=None, help="PNG of the loss curve")
    p.add_argument(
        "--loss-log",
        type=Path,
        default=None,
        help="rank 0 appends one JSON line per step: step, loss, lr",
    )
    p.add_argument(
        "--save-final",
        type=Path,
        default=None,
        help="folder: each rank writes rank<r>.pt, its own part of the final model state",
    )
    p.add_argument(
        "--die-at-step",
        type=int,
        default=None,
        help="(testing) rank 1 SIGKILLs "
        "itself after this step, on a torchrun job's first attempt only",
    )
    p.add_argument(
        "--die-while-saving",
        action="store_true",
        help="(testing) with --die-at-step N, a checkpoint step: die in the save of step N, "
        "after this rank's dcp.save returned and before the checkpoint is renamed complete",
    )
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> dict:
    """Process group, device mesh and this rank's groups and replica."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.pp * args.dp != world:
        raise SystemExit(f"--pp {args.pp} x --dp {args.dp} must equal the {world} processes")
    cuda = torch.cuda.is_available()
    device_type = "cuda" if cuda else "cpu"
    env = {"world": world, "rank": 0, "replica": 0, "pp_group": None, "dp_group": None,
           "device_type": device_type, "distributed": world > 1}  # fmt: skip
    if world == 1:
        return env
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    env["rank"] = dist.get_rank()
    if args.pp > 1 and args.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (args.dp, args.pp), mesh_dim_names=("dp", "pp"))
        env["pp_group"], env["dp_group"] = mesh["pp"].get_group(), mesh["dp"].get_group()
        env["replica"] = mesh.get_coordinate()[0]
    elif args.pp > 1:
        env["pp_group"] = dist.group.WORLD
    else:
        env["dp_group"], env["replica"] = dist.group.WORLD, env["rank"]
    return env


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    env = setup(args)
    rank, distributed = env["rank"], env["distributed"]
    corpus = Corpus()
    model = build_model(corpus.vocab, args.layers, args.width, args.heads, args.context,
                        args.seed)  # fmt: skip
    per_process = 2 if args.schedule in ("interleaved", "zbv") else 1
    if args.pp > 1:  # this rank runs its cells on its own device (cuda:LOCAL_RANK or cpu)
        cells, devices = args.pp * per_process, None
    else:  # one process per pipeline: 2 devices (of the same kind), 2 cells each for V
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local}" if env["device_type"] == "cuda" else "cpu"
        cells, devices = 2 * per_process, [device] * 2
    balance = even_balance(len(model), cells)
    pipe = gf.GPipe(model, balance, devices=devices, chunks=args.chunks, checkpoint="never",
                    schedule=args.schedule, pp_group=env["pp_group"],
                    dp_group=env["dp_group"], timeout=120,
                    dp_shard=args.dp_shard and env["dp_group"] is not None)  # fmt: skip
    decay = [p for n, p in pipe.named_parameters() if p.dim() >= 2 and "positions" not in n]
    others = [p for n, p in pipe.named_parameters() if not (p.dim() >= 2 and "positions" not
                                                             in n)]  # fmt: skip
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": others, "weight_decay": 0.0}], lr=args.lr,
                            betas=(0.9, 0.95))  # fmt: skip

    start = 0
    if args.checkpoint_dir is not None:
        found = latest_checkpoint(args.checkpoint_dir) if rank == 0 else None
        if distributed:  # every rank resumes from what rank 0 saw
            box = [found]
            dist.broadcast_object_list(box, src=0)
            found = box[0]
        if found is not None:
            start = load_checkpoint(found[1], pipe, opt)
            if rank == 0:
                print(f"resumed from {found[1]} at step {start}", flush=True)
    # The learning rate is a function of the step: LambdaLR started at `start`.
    for group in opt.param_groups:
        group["initial_lr"] = args.lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, args.warmup, args.steps), last_epoch=start - 1
    )

    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"corpus: {len(corpus.train) + len(corpus.val)} characters, vocabulary "
              f"{corpus.vocab}; model: {params / 1e6:.2f} M parameters, {len(model)} layers, "
              f"balance {balance}; pp={args.pp} dp={args.dp} schedule={args.schedule} "
              f"chunks={args.chunks}", flush=True)  # fmt: skip
    xv, yv = corpus.val_batch(args.val_batch, args.context)
    xv, yv = xv.tensor_split(args.dp)[env["replica"]], yv.tensor_split(args.dp)[env["replica"]]
    autocast = torch.autocast(env["device_type"], dtype=torch.bfloat16, enabled=args.bf16)

    def evaluate() -> float:
        with autocast:
            return float(pipe.eval_step(xv, yv, loss_fn))

    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, desc="train", dynamic_ncols=True)
    log = None
    if args.loss_log is not None and rank == 0:
        args.loss_log.parent.mkdir(parents=True, exist_ok=True)
        log = args.loss_log.open("a")
    losses: list[tuple[int, float]] = []
    evals: list[tuple[int, float]] = []
    tokens = args.batch * args.context
    checkpoint_times: list[tuple[float, int]] = []

    def die(done: int, where: str) -> None:
        """--die-at-step: rank 1 (or the only one) SIGKILLs itself, on a first attempt."""
        if (
            args.die_at_step is not None
            and done == args.die_at_step
            and (where == "while saving") == args.die_while_saving
            and rank == min(1, env["world"] - 1)
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        ):
            print(f"rank {rank}: dying {where} {done} (--die-at-step)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    trained_s, rate = 0.0, None
    tick = time.perf_counter()
    for step in range(start, args.steps):
        x, y = corpus.batch(step, args.batch, args.context, args.seed)
        x, y = x.tensor_split(args.dp)[env["replica"]], y.tensor_split(args.dp)[env["replica"]]
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = float(pipe.train_step(x, y, loss_fn))
        if args.clip > 0:
            pipe.clip_grad_norm_(args.clip)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        scheduler.step()
        done = step + 1
        losses.append((done, loss))
        now = time.perf_counter()
        trained_s += now - tick
        # tokens/s, smoothed over the last ~20 steps (one step's time is noisy on CPU)
        rate = tokens / (now - tick) if rate is None else 0.95 * rate + 0.05 * tokens / (now - tick)
        tick = now
        if log is not None:
            log.write(json.dumps({"step": done, "loss": loss, "lr": lr}) + "\n")
            log.flush()
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}")
            bar.update(1)
        if args.eval_every and done % args.eval_every == 0 and done < args.steps:
            evals.append((done, evaluate()))
            tick = time.perf_counter()  # evaluation is not training throughput
        if args.checkpoint_dir is not None and done % args.checkpoint_every == 0:
            seconds, size = save_checkpoint(
                args.checkpoint_dir, done, pipe, opt, rank, distributed,
                saved=functools.partial(die, done, "while saving"),
            )  # fmt: skip
            checkpoint_times.append((seconds, size))
            sizes = [size]
            if distributed:
                sizes = [0] * env["world"]
                dist.all_gather_object(sizes, size)
            if rank == 0:
                message = (
                    f"checkpoint step-{done}: {seconds:.2f} s, "
                    f"{', '.join(f'{s / 1e6:.2f} MB' for s in sizes)} per rank"
                )
                (bar.write if bar is not None else print)(message)
            tick = time.perf_counter()  # the save is not training throughput
        die(done, "after step")
    if bar is not None:
        bar.close()
    if log is not None:
        log.close()

    val = evaluate()
    evals.append((args.steps, val))
    if rank == 0:
        if losses:
            print(
                f"train loss: first {losses[0][1]:.4f} (step {losses[0][0]}), last "
                f"{losses[-1][1]:.4f} (step {losses[-1][0]}); "
                f"{tokens * len(losses) / trained_s:,.0f} tokens/s over the training steps"
            )
        print(f"final validation loss: {val:.4f}", flush=True)
    if args.save_final is not None:
        args.save_final.mkdir(parents=True, exist_ok=True)
        # Whole tensors: a sharded stage's are gathered over its replicas (a collective).
        state = {k: whole(v).detach().clone() for k, v in pipe.state_dict().items()}
        torch.save(state, args.save_final / f"rank{rank}.pt")
    if args.loss_curve is not None and rank == 0:
        plot(losses, evals, args.loss_curve)
    pipe.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return val


def plot(losses: list[tuple[int, float]], evals: list[tuple[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.plot(*zip(*losses, strict=True), lw=1, label="train (one batch)")
    ax.plot(*zip(*evals, strict=True), "o-", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("examples/train_lm.py: character LM on the project's docs")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"loss curve: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
