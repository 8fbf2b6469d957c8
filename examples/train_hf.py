"""Train transformers' LlamaForCausalLM, unmodified, through gf.pipeline: a character-level
model of this repository's own docs, with AdamW, clipping and DCP checkpoints that resume.

    python examples/train_hf.py                                   # one process, 2 CPU cells
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --pp 2
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --pp 2 --dp 2

(on this machine: GLOO_SOCKET_IFNAME=lo). The model is built from a small LlamaConfig (no
download) and computes its own loss from `labels`. It trains on documents of different
lengths cut from examples/train_lm.py's text, each batch padded to its longest document, the
padding and each document's prompt masked with -100 in `labels`, as supervised fine-tuning
does: the pipe's loss is the mean over the tokens the labels count, over the whole batch,
as the plain model's. The learning rate and the checkpoints are examples/train_lm.py's:
with --checkpoint-dir the job writes DIR/step-<N>/
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

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def build_model(vocab: int, args: argparse.Namespace) -> torch.nn.Module:
    """A LlamaForCausalLM from a small config (rotary positions, grouped-query attention),
    the same weights on every rank (seeded); one more token than the text's characters,
    the padding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab + 1, hidden_size=args.width, intermediate_size=2 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.context + 1,
        use_cache=False, pad_token_id=vocab,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config).to(DTYPES[args.dtype])


def documents(
    data: Tensor, generator: torch.Generator, size: int, context: int, pad: int
) -> dict[str, Tensor]:
    """`size` documents cut from `data` at random, of random lengths (a quarter of the
    context up to all of it, plus the token it predicts), as the model's inputs: padded on
    the right to the longest with `pad`, which attention skips (`attention_mask`), and
    labelled from the end of each document's prompt (its first tokens, up to half of it)
    to its end: -100 on the prompt and the padding, which the loss leaves out."""
    lengths = torch.randint(context // 4, context + 2, (size,), generator=generator).tolist()
    longest = max(lengths)
    offsets = torch.randint(0, len(data) - longest, (size,), generator=generator).tolist()
    ids = torch.full((size, longest), pad)
    mask = torch.zeros(size, longest, dtype=torch.long)
    labels = torch.full((size, longest), -100)
    for row, (length, offset) in enumerate(zip(lengths, offsets, strict=True)):
        document = data[offset : offset + length]
        prompt = int(torch.randint(1, length // 2 + 1, (), generator=generator))
        ids[row, :length] = document
        mask[row, :length] = 1
        labels[row, prompt:length] = document[prompt:]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train_batch(
    corpus: Corpus, step: int, size: int, args: argparse.Namespace
) -> dict[str, Tensor]:
    """Step `step`'s global batch, drawn from a generator seeded by (seed, step) alone, so a
    resumed run draws exactly the batches the uninterrupted one did."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    return documents(corpus.train, generator, size, args.context, corpus.vocab)


def val_batch(corpus: Corpus, size: int, args: argparse.Namespace) -> dict[str, Tensor]:
    """A fixed validation batch of documents from the validation text."""
    generator = torch.Generator().manual_seed(12345)
    return documents(corpus.val, generator, size, args.context, corpus.vocab)


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
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
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
    example = train_batch(corpus, 0, 2, args)
    # No split points given: gf.pipeline cuts among model.layers.*, balancing parameters.
    pipe = gf.pipeline(model, example, num_stages=per_process * max(args.pp, 2),
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

    def share(batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """This replica's contiguous share of a global batch."""
        return {key: value.tensor_split(args.dp)[env["replica"]] for key, value in batch.items()}

    log = None
    if args.loss_log is not None and rank == 0:
        args.loss_log.parent.mkdir(parents=True, exist_ok=True)
        log = args.loss_log.open("a")
    tick, losses = time.perf_counter(), []
    for step in range(start, args.steps):
        opt.zero_grad(set_to_none=True)
        batch = share(train_batch(corpus, step, args.batch, args))
        # The model's own loss: its mean over the tokens `labels` counts in the whole global
        # batch, however they fall in micro-batches and replicas.
        loss = float(pipe.train_step(batch, None, model_loss))
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

    val = float(pipe.eval_step(share(val_batch(corpus, args.val_batch, args)), None, model_loss))
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
