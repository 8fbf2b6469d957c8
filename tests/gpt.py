"""A small GPT-2-shaped language model in torch.nn for tests, with GPT-2's traps for a pipe.

- The head's weight is the token embedding's (a tie between the first and the last cell).
- Its projections are `Conv1D` layers, as in transformers' GPT-2: initialised in `__init__`,
  with no `reset_parameters()`, so a model built on the meta device needs `init_fn`.
- `init_weights` is the model's own initialisation (as GPT-2's `_init_weights`), given to a
  pipe as `init_fn`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

VOCAB = 13
WIDTH = 8
HEADS = 2
CONTEXT = 6


class Conv1D(nn.Module):
    """A linear layer with its weight transposed; no reset_parameters (transformers' Conv1D)."""

    def __init__(self, outputs: int, inputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(inputs, outputs))
        self.bias = nn.Parameter(torch.zeros(outputs))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(
            *x.shape[:-1], -1
        )


class Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(CONTEXT, WIDTH)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.size(1), device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = Conv1D(3 * WIDTH, WIDTH)
        self.proj = Conv1D(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.fc = Conv1D(4 * WIDTH, WIDTH)
        self.out = Conv1D(WIDTH, 4 * WIDTH)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(WIDTH, dim=-1)
        q, k, v = (t.view(batch, length, HEADS, -1).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(batch, length, WIDTH)))
        return x + self.dropout(self.out(nn.functional.gelu(self.fc(self.ln_2(x)))))


def gpt(blocks: int = 2, seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    """Embeddings, `blocks` blocks, a final norm and the head tied to the token embedding."""
    torch.manual_seed(seed)
    embeddings = Embeddings()
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = embeddings.tokens.weight
    layers = [embeddings, *(Block(dropout) for _ in range(blocks)), nn.LayerNorm(WIDTH), head]
    return nn.Sequential(*layers)


def init_weights(module: nn.Module) -> None:
    """The model's own initialisation of one module (GPT-2's _init_weights, in short)."""
    if isinstance(module, Conv1D):
        nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)


def batch(size: int, seed: int) -> tuple[Tensor, Tensor]:
    """Token ids and their next-token targets."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, CONTEXT + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
