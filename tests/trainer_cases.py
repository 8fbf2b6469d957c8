"""PipelineTrainer runs for tests/test_pipeline_trainer.py: tiny LLaMA and GPT-2 (its head tied
to the embedding), their data, a plain transformers Trainer's run to equal, and the cases each
Cluster worker runs as one rank of a torchrun-like job."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from helpers import whole

VOCAB, LENGTH = 31, 12
ROWS = 30  # the last batch of each epoch is short
STEPS = 4


def model(family: str, dtype: torch.dtype = torch.float32, *, meta: bool = False) -> nn.Module:
    """A tiny causal LM built from its config (no download), seeded, without dropout. GPT-2's
    loss_type is set so that a plain Trainer counts its tokens as the loss does (shifted):
    transformers derives none from the class name GPT2LMHeadModel."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        if family == "llama":
            config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=32,
                                 use_cache=False)  # fmt: skip
            built: nn.Module = LlamaForCausalLM(config)
        else:
            config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=4, n_head=4,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                bos_token_id=0, eos_token_id=0)  # fmt: skip
            built = GPT2LMHeadModel(config)
            built.loss_type = "ForCausalLM"
    config._attn_implementation = "sdpa"
    return built.to(dtype)


class Windows(torch.utils.data.Dataset[dict[str, Tensor]]):
    """`rows` random sequences; each item the model's inputs and its own labels. With
    `padded`, each row's tail (0 to 6 tokens) is padding: attention mask 0, label -100."""

    def __init__(self, rows: int = ROWS, *, seed: int = 0, padded: bool = False) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (rows, LENGTH), generator=generator)
        keep = LENGTH - torch.randint(0, 7, (rows,), generator=generator) if padded else None
        self.mask = (torch.arange(LENGTH) < keep[:, None]).long() if keep is not None else None

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if self.mask is None:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def causal_lm_loss(outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
    """A compute_loss_func in the model's dtype (transformers' own loss computes in float32):
    the next token's cross-entropy, summed over `num_items_in_batch` tokens when Trainer
    counts them, else averaged."""
    logits, target = outputs.logits[:, :-1], labels[:, 1:]
    total = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                        ignore_index=-100, reduction="sum")  # fmt: skip
    count = num_items_in_batch if num_items_in_batch is not None else (target != -100).sum()
    return total / count


def arguments(output_dir: str, batch: int = 4, **overrides: Any) -> Any:
    """TrainingArguments of every run: AdamW at a learning rate that moves the weights,
    accumulation over 2 batches, clipping, a log per step; overrides on top."""
    from transformers import TrainingArguments

    settings: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=batch, per_device_eval_batch_size=8,
        max_steps=STEPS, gradient_accumulation_steps=2, max_grad_norm=0.5,
        learning_rate=1e-2, warmup_steps=1, logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, use_cpu=True, seed=7,
    )  # fmt: skip
    settings.update(overrides)
    return TrainingArguments(**settings)


def result(trainer: Any, state: dict[str, Tensor], evaluation: dict[str, float]) -> dict[str, Any]:
    """What a run is compared by: its logged losses and grad norms by step, the eval loss,
    and the trained tensors (this rank's, whole)."""
    logs = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    return {
        "losses": {h["step"]: h["loss"] for h in logs},
        "grad_norms": {h["step"]: h["grad_norm"] for h in logs},
        "eval_loss": evaluation["eval_loss"],
        "state": {k: whole(v).detach().clone() for k, v in state.items()},
    }


def plain(family: str, folder: str, *, batch: int = 4, dtype: torch.dtype = torch.float32,
          padded: bool = False, loss: Any = None, rows: int = ROWS,
          **overrides: Any) -> dict[str, Any]:  # fmt: skip
    """The reference: a plain Trainer on the same model, data and seed, in this process."""
    from transformers import Trainer

    net = model(family, dtype)
    trainer = Trainer(model=net, args=arguments(folder, batch, **overrides),
                      train_dataset=Windows(rows, padded=padded),
                      eval_dataset=Windows(16, seed=1, padded=padded),
                      compute_loss_func=loss)  # fmt: skip
    trainer.train()
    return result(trainer, net.state_dict(), trainer.evaluate())


def pipelined(family: str, folder: str, *, batch: int = 4, dtype: torch.dtype = torch.float32,
              padded: bool = False, resume: str | None = None, pp_size: int | None = None,
              save_to: str | None = None, loss: Any = None, rows: int = ROWS,
              dp_shard: bool = False, **overrides: Any) -> dict[str, Any]:  # fmt: skip
    """The same run through PipelineTrainer (in whatever process layout this is)."""
    from gpipe_fast.integrations.transformers import PipelineTrainer

    trainer = PipelineTrainer(model=model(family, dtype),
                              args=arguments(folder, batch, **overrides),
                              train_dataset=Windows(rows, padded=padded),
                              eval_dataset=Windows(16, seed=1, padded=padded), pp_size=pp_size,
                              chunks=2, compute_loss_func=loss, dp_shard=dp_shard)  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    out = result(trainer, trainer.pipe.state_dict(), trainer.evaluate())
    if save_to is not None:
        trainer.save_model(save_to)
    out["split_points"] = trainer.pipe.split_points
    trainer.pipe.close()  # (not trainer.end(): it ends the job's process group)
    return out


def as_rank(rank: int, world: int) -> None:
    """The environment torchrun gives a rank, which accelerate reads (the worker's process
    group is already up: accelerate uses it)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")  # fmt: skip


def pipelined_rank(rank: int, world: int, **kwargs: Any) -> dict[str, Any]:
    """A Cluster case: this rank's part of `pipelined`."""
    as_rank(rank, world)
    return pipelined(**kwargs)


def saved_then_loaded(rank: int, world: int, family: str, folder: str,
                      **kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """A Cluster case: PipelineTrainer trains (at pp=world, or as `kwargs` say) and saves its
    model (every rank writes its own files); rank 0 then loads the directory with
    from_pretrained, alone."""
    from transformers import AutoModelForCausalLM

    as_rank(rank, world)
    saved = str(Path(folder) / "model")
    out = pipelined(family, folder, save_to=saved, **kwargs)
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(saved)
        out["loaded"] = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
        out["files"] = sorted(os.listdir(saved))
        out["tied"] = loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    return out


def pretrained_into_meta(rank: int, world: int, family: str, folder: str) -> dict[str, Any]:
    """A Cluster case: a model built on the meta device, pipelined at pp=world, each rank
    loading its stages' tensors from a save_pretrained directory (gf.pipeline and
    load_pretrained, no Trainer): what it loaded, and what stayed on meta."""
    import torch.distributed as dist

    import gpipe_fast as gf
    from gpipe_fast.integrations.transformers import load_pretrained

    net = model(family, meta=True)
    ids = torch.randint(1, VOCAB, (2, LENGTH))
    pipe = gf.pipeline(net, {"input_ids": ids, "labels": ids}, chunks=2,
                       pp_group=dist.group.WORLD, init_fn=net._init_weights)  # fmt: skip
    missing = load_pretrained(pipe, folder)
    loss = pipe.eval_step({"input_ids": ids, "labels": ids}, None, lambda out, _: out.loss)
    out = {
        "missing": missing,
        "state": {k: v.detach().clone() for k, v in pipe.state_dict().items()},
        "meta": sorted(n for n, p in net.named_parameters() if p.is_meta),
        "loss": float(loss),
    }
    pipe.close()
    return out


def predicted_rank(rank: int, world: int, family: str, folder: str) -> dict[str, Any]:
    """A Cluster case: PipelineTrainer.predict at pp=world (the logits come from the last
    stage's rank to every rank)."""
    from gpipe_fast.integrations.transformers import PipelineTrainer

    as_rank(rank, world)
    data = Windows(12, seed=3)
    trainer = PipelineTrainer(model=model(family), args=arguments(folder), eval_dataset=data,
                              chunks=3)  # fmt: skip
    found = trainer.predict(data)
    trainer.pipe.close()
    return {"predictions": found.predictions, "loss": found.metrics["test_loss"]}


def adapter_saved(rank: int, world: int, folder: str) -> dict[str, Any]:
    """A Cluster case: a PEFT LoRA of LLaMA (float64) trains one step at pp=world, then
    save_pretrained writes its adapter; rank 0 returns the file's tensors and the trained
    adapter of a plain copy of the model."""
    import copy

    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    import gpipe_fast as gf
    from gpipe_fast.integrations.transformers import save_pretrained

    lora = get_peft_model(model("llama", torch.float64),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                     init_lora_weights=False))  # fmt: skip
    plain = copy.deepcopy(lora)
    ids = torch.randint(1, VOCAB, (8, LENGTH), generator=torch.Generator().manual_seed(0))
    pipe = gf.pipeline(lora, {"input_ids": ids[:2], "labels": ids[:2]},
                       ["base_model.model.model.layers.2"], chunks=4,
                       pp_group=dist.group.WORLD)  # fmt: skip
    trainable = [p for p in pipe.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    plain_optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    pipe.train_step({"input_ids": ids, "labels": ids}, None, lambda out, _: out.loss)
    plain(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    plain_optimizer.step()
    save_pretrained(lora, pipe, folder)
    pipe.close()
    if rank != 0:
        return {}
    trained = {k.replace(".default", ""): v for k, v in plain.state_dict().items() if "lora" in k}
    return {"saved": load_file(str(Path(folder) / "adapter_model.safetensors")),
            "trained": trained, "files": sorted(os.listdir(folder))}  # fmt: skip


def own_save_pretrained(rank: int, world: int, folder: str) -> list[str]:
    """A Cluster case: the model's own save_pretrained on each rank of a pipe at pp=world,
    into a folder of its own; the warnings it gave."""
    import warnings

    import torch.distributed as dist

    import gpipe_fast as gf

    net = model("llama")
    ids = torch.randint(1, VOCAB, (2, LENGTH))
    pipe = gf.pipeline(net, {"input_ids": ids}, ["model.layers.2"], pp_group=dist.group.WORLD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.save_pretrained(str(Path(folder) / f"rank{rank}"))
    pipe.close()
    return [str(w.message) for w in caught if "gpipe_fast" in str(w.message)]
