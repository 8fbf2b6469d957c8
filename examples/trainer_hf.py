"""Fine-tune transformers' LlamaForCausalLM with PipelineTrainer, transformers' Trainer with the
pipe inside, on this repository's docs; then load the saved directory with from_pretrained, in
one process, and generate a few characters.

    python examples/trainer_hf.py                                      # one process, 2 CPU cells
    torchrun --standalone --nproc-per-node 2 examples/trainer_hf.py --pp 2
    torchrun --standalone --nproc-per-node 4 examples/trainer_hf.py --pp 2 --dp 2

(on this machine: GLOO_SOCKET_IFNAME=lo). The script is a plain Trainer script but for its
import, the class name and the pipe's keywords (pp_size, chunks, schedule). The model is a
character-level LLaMA built from a small config (no download), or with --pretrained DIR one
saved earlier (this script's own output, say), built on the meta device and read by each
rank for its own stages. It trains on documents cut from README.md and docs/*.md (the text of
examples/train_lm.py), each padded to its batch's longest and its prompt and padding masked
with -100, as supervised fine-tuning does. Trainer does the rest: AdamW and a cosine
schedule from TrainingArguments, gradient accumulation, clipping, logging, evaluation,
checkpoints every --save-steps into --output-dir (resume with --resume), and save_model,
which writes --output-dir/final: a directory that from_pretrained loads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# train_lm.py (next to this file) holds the corpus; importing it puts a built checkout on
# sys.path.
from train_lm import Corpus

PROMPT = "Pipeline parallelism "


class Documents(torch.utils.data.Dataset[dict[str, Tensor]]):
    """`count` documents cut from `text` (a tensor of character ids), document i drawn from a
    generator seeded by (seed, i): a quarter of `context` characters up to all of it plus the
    one it predicts, labelled from the end of its prompt (its first characters, up to half)."""

    def __init__(self, text: Tensor, count: int, context: int, seed: int) -> None:
        self.text, self.count, self.context, self.seed = text, count, context, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        length = int(torch.randint(self.context // 4, self.context + 2, (), generator=generator))
        offset = int(torch.randint(0, len(self.text) - length, (), generator=generator))
        ids = self.text[offset : offset + length]
        prompt = int(torch.randint(1, length // 2 + 1, (), generator=generator))
        labels = ids.clone()
        labels[:prompt] = -100
        return {"input_ids": ids, "labels": labels}


class PadToLongest:
    """Trainer's data collator: a batch padded on the right to its longest document with the
    padding token, which attention skips and the loss leaves out (label -100)."""

    def __init__(self, pad: int) -> None:
        self.pad = pad

    def __call__(self, items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        longest = max(len(item["input_ids"]) for item in items)
        ids = torch.full((len(items), longest), self.pad)
        mask = torch.zeros(len(items), longest, dtype=torch.long)
        labels = torch.full((len(items), longest), -100)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            ids[row, :n], mask[row, :n], labels[row, :n] = item["input_ids"], 1, item["labels"]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def build_model(vocab: int, args: argparse.Namespace) -> Any:
    """A LlamaForCausalLM from a small config, seeded (the same on every rank); one more token
    than the text's characters, the padding. With --pretrained: that directory's model, on
    the meta device (PipelineTrainer reads each rank's stages' weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.pretrained is not None:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.pretrained))
    config = LlamaConfig(
        vocab_size=vocab + 1, hidden_size=args.width, intermediate_size=2 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=256,
        use_cache=False, pad_token_id=vocab,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def generate(folder: Path, chars: list[str], count: int) -> str:
    """The saved model loaded alone, without any pipe, continuing PROMPT greedily."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    index = {c: i for i, c in enumerate(chars)}
    prompt = torch.tensor([[index[c] for c in PROMPT if c in index]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=count, do_sample=False,
                             pad_token_id=model.config.pad_token_id)  # fmt: skip
    return "".join(chars[i] for i in out[0, prompt.shape[1] :].tolist() if i < len(chars))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--pp", type=int, default=1, help="processes per pipeline (torchrun)")
    p.add_argument("--dp", type=int, default=1, help="replicas of the pipeline")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (max_steps)")
    p.add_argument("--batch", type=int, default=16, help="documents per replica and batch")
    p.add_argument("--accumulate", type=int, default=2, help="batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=Path("runs/trainer_hf"))
    p.add_argument("--save-steps", type=int, default=100, help="a checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="from the latest checkpoint")
    p.add_argument("--pretrained", type=Path, default=None, help="start from this directory")
    p.add_argument("--generate", type=int, default=40, help="characters to generate at the end")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.pp * args.dp != world:
        raise SystemExit(f"--pp {args.pp} x --dp {args.dp} must equal the {world} processes")
    from transformers import TrainingArguments

    from gpipe_fast.integrations.transformers import PipelineTrainer

    corpus = Corpus()
    training = TrainingArguments(
        output_dir=str(args.output_dir), per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, gradient_accumulation_steps=args.accumulate,
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=min(20, args.steps // 10), weight_decay=0.01, max_grad_norm=1.0,
        logging_steps=max(1, args.steps // 10), eval_strategy="steps",
        eval_steps=max(1, args.steps // 2), save_steps=args.save_steps, report_to=[],
        disable_tqdm=args.no_progress, use_cpu=not torch.cuda.is_available(), seed=args.seed,
    )  # fmt: skip
    trainer = PipelineTrainer(
        model=build_model(corpus.vocab, args),
        args=training,
        data_collator=PadToLongest(pad=corpus.vocab),
        train_dataset=Documents(corpus.train, 100_000, args.context, args.seed),
        eval_dataset=Documents(corpus.val, 4 * args.batch, args.context, seed=12345),
        pp_size=args.pp,
        chunks=args.chunks,
        schedule=args.schedule,
        pretrained=args.pretrained,
    )
    if trainer.is_world_process_zero():
        print(f"split points {trainer.pipe.split_points}; pp={args.pp} dp={args.dp} "
              f"schedule={args.schedule} chunks={args.chunks}", flush=True)  # fmt: skip
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()
    final = args.output_dir / "final"
    trainer.save_model(str(final))  # every rank writes its own stages' tensors
    text = ""
    if trainer.is_world_process_zero():
        (final / "characters.json").write_text(json.dumps(corpus.chars))
        print(f"final validation loss: {metrics['eval_loss']:.4f}")
        text = generate(final, corpus.chars, args.generate)
        print(f"generated: {PROMPT}{text!r}", flush=True)
    trainer.end()  # the pipe's workers, then the process group
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
