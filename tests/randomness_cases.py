"""Models whose own code checkpoints and draws random numbers, for test_randomness.py: a
block calling torch.utils.checkpoint, GPT-2 and a LoRA-adapted LLaMA with dropout under
gradient checkpointing, and the case the Cluster's workers run."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from torch import Tensor, nn

import gpipe_fast as gf

VOCAB = 31


class CheckpointedBlock(nn.Module):
    """A residual block whose own forward checkpoints its dropout (as a model's code does);
    `reentrant`: torch.utils.checkpoint's use_reentrant, None: no checkpoint."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)
        self.reentrant = reentrant

    def inner(self, x: Tensor) -> Tensor:
        return self.b(F.dropout(torch.tanh(self.a(x)), 0.3, self.training))

    def forward(self, x: Tensor) -> Tensor:
        if self.reentrant is None:
            return x + self.inner(x)
        return x + tc.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def checkpointed(reentrant: bool | None, cells: int) -> nn.Sequential:
    """Linear, a CheckpointedBlock per cell and another, Linear; float64, seeded."""
    torch.manual_seed(0)
    blocks = [CheckpointedBlock(reentrant) for _ in range(cells + 1)]
    return nn.Sequential(nn.Linear(8, 16), *blocks, nn.Linear(16, 2)).double()


def gpt2(dropout: float = 0.2) -> nn.Module:
    """GPT-2 with dropout everywhere (embeddings, attention, residuals)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=4, n_head=4,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).double().train()


def lora_llama() -> nn.Module:
    """A LLaMA with LoRA adapters (lora_dropout) on its attention projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, use_cache=False)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.3,
                      init_lora_weights=False)  # fmt: skip
    return get_peft_model(LlamaForCausalLM(config).double(), lora).train()


def tokens(size: int, length: int, seed: int) -> Tensor:
    return torch.randint(0, VOCAB, (size, length), generator=torch.Generator().manual_seed(seed))


def token_loss(output: Any, ids: Tensor) -> Tensor:
    """Next-token cross entropy in the model's dtype."""
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def lora_pp2(rank: int, world: int, *, gradient_checkpointing: bool, schedule: str,
             checkpoint: str) -> dict[str, Any]:  # fmt: skip
    """A train_step at pp=2 of the LoRA LLaMA (split between its two layers), the model's
    gradient checkpointing on or off: the loss, and this rank's adapter gradients by name."""
    model = lora_llama()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    ids = tokens(6, 9, seed=1)
    pipe = gf.pipeline(model, {"input_ids": ids[:2]}, ["base_model.model.model.layers.1"],
                       chunks=3, checkpoint=checkpoint, schedule=schedule,
                       pp_group=torch.distributed.group.WORLD, timeout=60)  # fmt: skip
    try:
        torch.manual_seed(7)
        loss = pipe.train_step({"input_ids": ids} if rank == 0 else None,
                               ids if rank == world - 1 else None, token_loss)  # fmt: skip
    finally:
        pipe.close()
    grads = {name: p.grad.tolist() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads}
