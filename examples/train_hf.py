"""Train transformers' LlamaForCausalLM, unmodified, through gf.pipeline: a character-level
model of this repository's own docs, with AdamW, clipping and DCP checkpoints that resume.

    python examples/train_hf.py                                   # one process, 2 CPU cells
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --pp 2
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --pp 2 --dp 2

(on this machine: GLOO_SOCKET_IFNAME=lo). The model is built from a small LlamaConfig (no
download) and computes its own loss from `labels`. The data, the learning rate and the
checkpoints are examples/train_lm.py's: with --checkpoint-dir the job writes DIR/step-<N>/
every --checkpoint-every steps and, started again, resumes from the latest complete one. The
checkpoint's keys are the model's own (model.layers.0.self_attn.q_proj.weight, ...), so it
resumes at another --pp/--dp, and loads into a LlamaForCausalLM without any pipe.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

# train_lm.py (next to this file) holds the corpus, the learning-rate schedule, the process
# setup and the DCP checkpoint helpers; importing it puts a built checkout on sys.path.
from train_lm import (
    Corpus,
    latest_checkpoint,
    load_checkpoint,
    lr_factor,
    save_checkpoint,
    setup,
)

import gpipe_fast as gf


def build_model(vocab: int, args: argparse.Namespace) -> torch.nn.Module:
    """A LlamaForCausalLM from a small config (rotary positions, grouped-query attention),
    the same weights on every rank (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.width, intermediate_size=2 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.context + 1,
        use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def as_inputs(x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """A batch of windows as the model's inputs: the context and its next character, which
    the model's own loss predicts from what comes before (it shifts `labels` itself)."""
    ids = torch.cat([x, y[:, -1:]], dim=1)
    return {"input_ids": ids, "labels": ids}


def model_loss(output: object, _target: None) -> Tensor:
    """The loss transformers computed from `labels`, one micro-batch's."""
    return output.loss  # type: ignore[attr-defined, no-any-return]


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
    p.add_argument("--clip", type=float, default=1.0, help="max grad norm (0: no clipping)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
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
    p.add_argument("--val-batch", type=int, default=32)
    p.add_argument("--loss-log", type=Path, default=None,
                   help="rank 0 appends one JSON line per step: step, loss, lr")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    env = setup(args)
    rank, distributed = env["rank"], env["distributed"]
    corpus = Corpus()
    model = build_model(corpus.vocab, args)
    per_process = 2 if args.schedule in ("interleaved", "zbv") else 1
    devices = None if args.pp > 1 else ["cpu"] * 2  # one process: a pipe of 2 CPU cells
    x, y = corpus.batch(0, 2, args.context, args.seed)
    # No split points given: gf.pipeline cuts among model.layers.*, balancing parameters.
    pipe = gf.pipeline(model, as_inputs(x, y), num_stages=per_process * max(args.pp, 2),
                       devices=devices, chunks=args.chunks, checkpoint="never",
                       schedule=args.schedule, pp_group=env["pp_group"],
                       dp_group=env["dp_group"], timeout=120,
                       dp_shard=args.dp_shard and env["dp_group"] is not None)  # fmt: skip
    named = list(pipe.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": args.weight_decay},
         {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )  # fmt: skip

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
    for group in opt.param_groups:  # the learning rate is a function of the step
        group["initial_lr"] = args.lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, args.warmup, args.steps), last_epoch=start - 1
    )
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"LlamaForCausalLM: {params / 1e6:.2f} M parameters, vocabulary {corpus.vocab}; "
              f"split points {pipe.split_points}; pp={args.pp} dp={args.dp} "
              f"schedule={args.schedule} chunks={args.chunks}", flush=True)  # fmt: skip

    def share(x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """This replica's contiguous share of a global batch, as the model's inputs."""
        replica = env["replica"]
        return as_inputs(x.tensor_split(args.dp)[replica], y.tensor_split(args.dp)[replica])

    log = None
    if args.loss_log is not None and rank == 0:
        args.loss_log.parent.mkdir(parents=True, exist_ok=True)
        log = args.loss_log.open("a")
    tick, losses = time.perf_counter(), []
    for step in range(start, args.steps):
        opt.zero_grad(set_to_none=True)
        x, y = corpus.batch(step, args.batch, args.context, args.seed)
        loss = float(pipe.train_step(share(x, y), None, model_loss))  # the model's own loss
        if args.clip > 0:
            pipe.clip_grad_norm_(args.clip)  # the whole model's norm, on every rank alike
        lr = opt.param_groups[0]["lr"]
        opt.step()
        scheduler.step()
        done = step + 1
        losses.append(loss)
        if log is not None:
            log.write(json.dumps({"step": done, "loss": loss, "lr": lr}) + "\n")
            log.flush()
        if rank == 0 and (done % 50 == 0 or done == args.steps):
            print(f"step {done}: loss {loss:.4f}", flush=True)
        if args.checkpoint_dir is not None and done % args.checkpoint_every == 0:
            seconds, _ = save_checkpoint(args.checkpoint_dir, done, pipe, opt, rank, distributed)
            if rank == 0:
                print(f"checkpoint step-{done}: {seconds:.2f} s", flush=True)
    trained_s = time.perf_counter() - tick
    if log is not None:
        log.close()

    val = float(pipe.eval_step(share(*corpus.val_batch(args.val_batch, args.context)), None,
                               model_loss))  # fmt: skip
    if rank == 0:
        if losses:
            print(f"train loss: first {losses[0]:.4f}, last {losses[-1]:.4f}; {len(losses)} "
                  f"steps in {trained_s:.1f} s")  # fmt: skip
        print(f"final validation loss: {val:.4f}", flush=True)
    pipe.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return val


if __name__ == "__main__":
    main(sys.argv[1:])
