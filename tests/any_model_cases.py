"""Real transformers models for test_any_model.py (tiny configs, float64, no dropout), the plain
model's reference training, and the cases its Cluster workers run."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import gpipe_fast as gf

from helpers import whole

VOCAB = 31
WIDTH = 16
BLOCKS = 4


def _decoder(config_class: Any, model_class: Any) -> nn.Module:
    """A LLaMA-shaped causal LM of this family: rotary, GQA, 4 blocks."""
    config = config_class(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                          num_hidden_layers=BLOCKS, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=32)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_class(config).double()


def llama() -> nn.Module:
    """LlamaForCausalLM: rotary cos/sin computed once and taken by every layer, GQA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _decoder(LlamaConfig, LlamaForCausalLM)


def gpt2() -> nn.Module:
    """GPT2LMHeadModel: the head tied to the token embedding (first and last stage)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=WIDTH, n_layer=BLOCKS,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).double()


def qwen2() -> nn.Module:
    """Qwen2ForCausalLM (Mistral's layout: GQA, rotary, biases on q, k, v)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _decoder(Qwen2Config, Qwen2ForCausalLM)


def bert() -> nn.Module:
    """BertForMaskedLM: a padding attention mask, the decoder tied to the word embeddings."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=BLOCKS,
                        num_attention_heads=4, intermediate_size=2 * WIDTH,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        max_position_embeddings=32)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return BertForMaskedLM(config).double()


def t5() -> nn.Module:
    """T5ForConditionalGeneration: `shared` embeds the encoder's and the decoder's inputs
    (and ties the head), the encoder's output reaches every decoder layer."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=4, d_ff=2 * WIDTH, num_layers=2,
                      num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config).double()


def gemma2() -> nn.Module:
    """Gemma2ForCausalLM: the head tied to the embedding, sliding-window layers between
    global ones, logits soft-capped; its norms and softmax compute in float32 even in a
    float64 model (see TOLERANCE)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                          num_hidden_layers=BLOCKS, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=4, max_position_embeddings=32, sliding_window=8,
                          tie_word_embeddings=True)  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).double()


class VisionNet(nn.Module):
    """A convolutional net written in torch.nn: BatchNorm, and a skip from the stem to the
    third block added in the net's own forward (across stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            for _ in range(BLOCKS)
        )
        self.head = nn.Linear(8, VOCAB)

    def forward(self, pixels: Tensor) -> Tensor:
        first = hidden = self.stem(pixels)
        for i, block in enumerate(self.blocks):
            hidden = block(hidden)
            if i == 2:
                hidden = hidden + first
        return self.head(hidden.mean((2, 3)))


def vision() -> nn.Module:
    torch.manual_seed(0)
    return VisionNet().double().eval()  # BatchNorm on running statistics: exact per sample


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": llama, "gpt2": gpt2}
MORE_MODELS: dict[str, Callable[[], nn.Module]] = {
    "qwen2": qwen2, "bert": bert, "t5": t5, "vision": vision, "gemma2": gemma2,
}  # fmt: skip
# Relative tolerances where the model computes in float32 inside a float64 model: there the
# plain model itself differs by about 1e-7 between the whole batch and its micro-batches.
TOLERANCE = {"gemma2": 1e-6}
BLOCK_NAMES = {
    "llama": "model.layers", "gpt2": "transformer.h", "qwen2": "model.layers",
    "bert": "bert.encoder.layer", "vision": "blocks", "gemma2": "model.layers",
}  # fmt: skip


def split_points(name: str, stages: int) -> list[str]:
    """Split points giving `stages` stages of the blocks (2: in the middle; 4: one each; T5's
    3: in the encoder and in the decoder)."""
    if name == "t5":
        return ["encoder.block.1", "decoder.block.0"]
    blocks = BLOCK_NAMES[name]
    return [f"{blocks}.2"] if stages == 2 else [f"{blocks}.{i}" for i in range(1, BLOCKS)]


def tokens(size: int, length: int, step: int) -> Tensor:
    return torch.randint(0, VOCAB, (size, length), generator=torch.Generator().manual_seed(step))


def inputs(name: str, size: int, length: int, step: int) -> dict[str, Tensor]:
    """A batch of the model's inputs (its loss's target: `targets`)."""
    if name == "vision":
        generator = torch.Generator().manual_seed(step)
        return {"pixels": torch.randn(size, 3, length, length, generator=generator,
                                      dtype=torch.float64)}  # fmt: skip
    ids = tokens(size, length, step)
    if name == "bert":  # padding at the ends of some sequences
        mask = torch.ones_like(ids)
        mask[::2, length // 2 :] = 0
        return {"input_ids": ids, "attention_mask": mask}
    if name == "t5":
        return {"input_ids": ids, "labels": ids.flip(1)}
    return {"input_ids": ids}


def targets(name: str, batch: dict[str, Tensor]) -> Tensor:
    if name == "vision":
        return batch["pixels"].sum((1, 2, 3)).remainder(VOCAB).long()
    return batch.get("labels", batch["input_ids"])


def any_loss(output: Any, target: Tensor) -> Tensor:
    """Cross entropy of the logits in the model's dtype (transformers' own loss is float32)."""
    logits = output if isinstance(output, Tensor) else output.logits
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def make_model(name: str) -> nn.Module:
    return {**MODELS, **MORE_MODELS}[name]()


def relative(got: Tensor, want: Tensor, floor: float = 0.0) -> float:
    """|got - want| / |want|, with |want| at least `floor`: a gradient that is zero in exact
    arithmetic (an attention key's bias: softmax ignores what it adds to every logit) is
    rounding noise whose relative error means nothing."""
    scale = max(want.norm().item(), floor)
    return (got - want).norm().item() / scale if scale else (got - want).norm().item()


def train_against_plain(
    name: str,
    make_pipe: Callable[[nn.Module, dict[str, Tensor]], Any],
    shapes: list[tuple[int, int]],
    replica: int = 0,
    replicas: int = 1,
) -> dict[str, Any]:
    """SGD steps of batches of `shapes` ((batch, length) each) through the pipe and the plain
    model side by side: per step both losses and this process's worst relative gradient
    error; then its worst parameter error, and the names it compared."""
    model = make_model(name)
    plain = copy.deepcopy(model)
    pipe = make_pipe(model, inputs(name, 2, shapes[0][1], 99))
    try:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
        reference = dict(plain.named_parameters(remove_duplicate=False))
        steps, names = [], set()
        for step, (size, length) in enumerate(shapes):
            batch = inputs(name, size, length, step)
            target = targets(name, batch)
            optimizer.zero_grad(set_to_none=True)
            plain_optimizer.zero_grad(set_to_none=True)
            share = {key: value.tensor_split(replicas)[replica] for key, value in batch.items()}
            loss = pipe.train_step(share, target.tensor_split(replicas)[replica], any_loss)
            plain_loss = any_loss(plain(**batch), target)
            plain_loss.backward()
            worst = 0.0
            scale = torch.stack([p.grad.norm() for p in plain.parameters() if p.grad is not None])
            floor = 1e-6 * scale.norm().item()
            for key, param in pipe.named_parameters(remove_duplicate=False):
                worst = max(worst, relative(whole(param.grad), reference[key].grad, floor))
                names.add(key)
            steps.append({"loss": None if loss is None else loss.item(),
                          "plain": plain_loss.item(), "grad_error": worst})  # fmt: skip
            optimizer.step()
            plain_optimizer.step()
        floor = 1e-6 * torch.stack([p.norm() for p in plain.parameters()]).norm().item()
        params = max(relative(whole(p), reference[k], floor) for k, p in pipe.named_parameters())
        keys = sorted(pipe.state_dict())
    finally:
        pipe.close()
    return {"steps": steps, "param_error": params, "names": sorted(names), "keys": keys,
            "split_points": pipe.split_points, "transport": pipe.transport_kind}  # fmt: skip


def across(
    rank: int, world: int, *, model: str, schedule: str, stages: int, pp: int,
    shapes: list[tuple[int, int]], dp_shard: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """A Cluster case: train_against_plain on `world` processes, `pp` per pipeline and the
    rest data-parallel replicas (a (dp, pp) mesh), sharded with `dp_shard`."""
    from dist_cases import groups

    dp = world // pp
    pp_group, dp_group, replica = groups(pp, dp)

    def make(net: nn.Module, example: dict[str, Tensor]) -> Any:
        return gf.pipeline(net, example, split_points(model, stages), chunks=3,
                           schedule=schedule, pp_group=pp_group, dp_group=dp_group,
                           timeout=60, dp_shard=dp_shard)  # fmt: skip

    return train_against_plain(model, make, shapes, replica, dp)
