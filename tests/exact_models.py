"""Real models as nn.Sequentials for the float64 "plain vs pipe" harness (test_exact_models.py):
transformers' GPT-2 blocks with a tied head, LLaMA decoder layers with rotary cos/sin carried
as skips or as tuples, and the demo's U-Net. Each comes with its batches and its loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gpipe_fast.demo import unet
from gpipe_fast.skip import pop, skippable, stash

try:  # the harness skips its transformers models where transformers is missing
    from transformers import GPT2Config, LlamaConfig
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
    )
except ImportError:  # pragma: no cover - transformers is in the test extra
    GPT2Config = None

VOCAB = 23
WIDTH = 16
TOKENS = 8  # per sequence
BLOCKS = 4  # transformer blocks: 6 layers with the embedding and the head


@dataclass(frozen=True)
class Case:
    """A model of the harness: its builder (float64, seeded), a batch maker (whole batch of
    `size` for step `step`), its loss, and the number of layers of its Sequential."""

    build: Callable[[], nn.Sequential]
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    layers: int


def tokens(size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets."""
    g = torch.Generator().manual_seed(900 + step)
    ids = torch.randint(0, VOCAB, (size, TOKENS + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


# -- GPT-2: blocks of transformers, the head tied to the token embedding --------------------


def _gpt2_config() -> GPT2Config:
    config = GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=WIDTH, n_layer=BLOCKS,
                        n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    config._attn_implementation = "sdpa"
    return config


class GPT2Embedding(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.size(1), device=ids.device))


class GPT2Head(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def gpt2() -> nn.Sequential:
    torch.manual_seed(0)
    config = _gpt2_config()
    embedding, head = GPT2Embedding(config), GPT2Head(config)
    head.lm_head.weight = embedding.wte.weight  # tied: the first and the last cell share it
    blocks = [GPT2Block(config, layer_idx=i) for i in range(BLOCKS)]
    return nn.Sequential(embedding, *blocks, head).double()


# -- LLaMA: decoder layers of transformers, rotary cos/sin as skips or along a tuple ---------


def _llama_config() -> LlamaConfig:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                         num_hidden_layers=BLOCKS, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=TOKENS)  # fmt: skip
    config._attn_implementation = "sdpa"
    return config


def _rotary(embedding: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(hidden.size(1), device=hidden.device)[None].expand(hidden.size(0), -1)
    cos, sin = embedding(hidden, positions)
    return cos, sin


class LlamaHead(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, value: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden = value[0] if isinstance(value, tuple) else value
        return self.lm_head(self.norm(hidden))


def llama_skips() -> nn.Sequential:
    """The embedding stashes each decoder layer's (cos, sin); every layer pops its own: skips
    from cell 0 to every later cell."""
    torch.manual_seed(0)
    config = _llama_config()
    names = [f"{part}{i}" for i in range(BLOCKS) for part in ("cos", "sin")]

    @skippable(stash=names)
    class Embedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.rotary = LlamaRotaryEmbedding(config)

        def forward(self, ids: torch.Tensor):  # type: ignore[no-untyped-def]
            hidden = self.embed_tokens(ids)
            cos, sin = _rotary(self.rotary, hidden)
            for i in range(BLOCKS):
                yield stash(f"cos{i}", cos)
                yield stash(f"sin{i}", sin)
            return hidden

    def decoder(i: int) -> nn.Module:
        @skippable(pop=[f"cos{i}", f"sin{i}"])
        class Decoder(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layer = LlamaDecoderLayer(config, layer_idx=i)

            def forward(self, hidden: torch.Tensor):  # type: ignore[no-untyped-def]
                cos = yield pop(f"cos{i}")
                sin = yield pop(f"sin{i}")
                return self.layer(hidden, position_embeddings=(cos, sin))

        return Decoder()

    layers = [Embedding(), *(decoder(i) for i in range(BLOCKS)), LlamaHead(config)]
    return nn.Sequential(*layers).double()


class LlamaTupleEmbedding(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.embed_tokens(ids)
        return (hidden, *_rotary(self.rotary, hidden))


class LlamaTupleDecoder(nn.Module):
    """A decoder layer that passes (hidden, cos, sin) on: cos and sin need no gradient."""

    def __init__(self, config: LlamaConfig, i: int) -> None:
        super().__init__()
        self.layer = LlamaDecoderLayer(config, layer_idx=i)

    def forward(
        self, value: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, cos, sin = value
        return self.layer(hidden, position_embeddings=(cos, sin)), cos, sin


def llama_tuples() -> nn.Sequential:
    torch.manual_seed(0)
    config = _llama_config()
    decoders = [LlamaTupleDecoder(config, i) for i in range(BLOCKS)]
    return nn.Sequential(LlamaTupleEmbedding(config), *decoders, LlamaHead(config)).double()


# -- the demo's U-Net: convolutions whose skips cross cells -------------------------------


def unet_model() -> nn.Sequential:
    torch.manual_seed(0)
    return unet.unet().double()


def unet_batch(size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    noisy, clean = unet.batch(step, size, pixels=8)
    return noisy.double(), clean.double()


CASES: dict[str, Case] = {
    "gpt2": Case(gpt2, tokens, lm_loss, BLOCKS + 2),
    "llama_skips": Case(llama_skips, tokens, lm_loss, BLOCKS + 2),
    "llama_tuples": Case(llama_tuples, tokens, lm_loss, BLOCKS + 2),
    "unet": Case(unet_model, unet_batch, nn.functional.mse_loss, 8),
}


def even_balance(layers: int, cells: int) -> list[int]:
    """`layers` in `cells` consecutive cells as even as can be (the larger ones first)."""
    return [layers // cells + (1 if k < layers % cells else 0) for k in range(cells)]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (|got - want| where want is 0), in float64."""
    got, want = got.detach().double(), want.detach().double()
    scale = want.norm().item()
    error = (got - want).norm().item()
    return error / scale if scale > 0 else error


def train_against_plain(
    name: str,
    pipe_of: Callable[[nn.Sequential], nn.Module],
    batches: list[int],
    replica: int = 0,
    replicas: int = 1,
) -> dict[str, object]:
    """Trains the pipe `pipe_of` makes of model `name` and the plain model side by side with
    AdamW (the pipe on replica `replica`'s share of each batch, the plain model on the whole
    batch). Per step: both losses and the worst relative error of this process's gradients;
    then the worst of its parameters, and the names it compared (plain Python data)."""
    case = CASES[name]
    plain = case.build()
    pipe = pipe_of(case.build())
    try:
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        reference = dict(plain.named_parameters(remove_duplicate=False))
        steps: list[dict[str, object]] = []
        names: set[str] = set()
        for step, size in enumerate(batches):
            x, y = case.batch(size, step)
            optimizer.zero_grad(set_to_none=True)
            plain_optimizer.zero_grad(set_to_none=True)
            share = (x.tensor_split(replicas)[replica], y.tensor_split(replicas)[replica])
            loss = pipe.train_step(*share, case.loss)  # type: ignore[operator]
            plain_loss = case.loss(plain(x), y)
            plain_loss.backward()
            worst, at = 0.0, ""
            for key, param in pipe.named_parameters(remove_duplicate=False):
                want = reference[key].grad
                assert want is not None and param.grad is not None, f"no gradient for {key}"
                error = relative(param.grad, want)
                names.add(key)
                if error >= worst:
                    worst, at = error, key
            steps.append({
                "loss": None if loss is None else loss.item(),
                "plain_loss": plain_loss.item(), "grad_error": worst, "at": at,
            })  # fmt: skip
            optimizer.step()
            plain_optimizer.step()
        params = {key: relative(p, reference[key]) for key, p in pipe.named_parameters()}
    finally:
        pipe.close()  # type: ignore[operator]
    return {"steps": steps, "param_error": max(params.values()), "names": sorted(names)}


def across(
    rank: int,
    world: int,
    *,
    model: str,
    schedule: str,
    balance: list[int],
    checkpoint: str,
    pp: int,
    batches: list[int],
) -> dict[str, object]:
    """A Cluster case: train_against_plain on `world` processes, `pp` per pipeline and
    world // pp data-parallel replicas (a (dp, pp) mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import gpipe_fast as gf

    dp = world // pp
    if dp == 1:
        pp_group, dp_group, replica = dist.group.WORLD, None, 0
    else:
        mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
        pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        replica = mesh.get_coordinate()[0]  # type: ignore[index]

    def pipe_of(model: nn.Sequential) -> nn.Module:
        return gf.GPipe(model, balance, chunks=3, schedule=schedule, checkpoint=checkpoint,
                        pp_group=pp_group, dp_group=dp_group, timeout=60)  # fmt: skip

    return train_against_plain(model, pipe_of, batches, replica, dp)
