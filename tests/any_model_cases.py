"""Real transformers models for test_any_model.py (tiny configs, float64, no dropout), the plain
model's reference training, and the cases its Cluster workers run."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import gpipe_fast as gf

VOCAB = 31
WIDTH = 16
BLOCKS = 4


def llama() -> nn.Module:
    """LlamaForCausalLM: rotary cos/sin computed once and taken by every layer, GQA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                         num_hidden_layers=BLOCKS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def gpt2() -> nn.Module:
    """GPT2LMHeadModel: the head tied to the token embedding (first and last stage)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=WIDTH, n_layer=BLOCKS,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).double()


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": llama, "gpt2": gpt2}
BLOCK_NAMES = {"llama": "model.layers", "gpt2": "transformer.h"}


def split_points(name: str, stages: int) -> list[str]:
    """Split points giving `stages` stages of the blocks (2: in the middle; 4: one each)."""
    blocks = BLOCK_NAMES[name]
    return [f"{blocks}.2"] if stages == 2 else [f"{blocks}.{i}" for i in range(1, BLOCKS)]


def tokens(size: int, length: int, step: int) -> Tensor:
    return torch.randint(0, VOCAB, (size, length), generator=torch.Generator().manual_seed(step))


def lm_loss(output: Any, target: Tensor) -> Tensor:
    return nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))


def relative(got: Tensor, want: Tensor) -> float:
    scale = want.norm().item()
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
    model = MODELS[name]()
    plain = copy.deepcopy(model)
    example = {"input_ids": tokens(2, shapes[0][1], 99)}
    pipe = make_pipe(model, example)
    try:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
        reference = dict(plain.named_parameters(remove_duplicate=False))
        steps, names = [], set()
        for step, (size, length) in enumerate(shapes):
            ids = tokens(size, length, step)
            optimizer.zero_grad(set_to_none=True)
            plain_optimizer.zero_grad(set_to_none=True)
            share = ids.tensor_split(replicas)[replica]
            loss = pipe.train_step({"input_ids": share}, share, lm_loss)
            plain_loss = lm_loss(plain(input_ids=ids), ids)
            plain_loss.backward()
            worst = 0.0
            for key, param in pipe.named_parameters(remove_duplicate=False):
                worst = max(worst, relative(param.grad, reference[key].grad))
                names.add(key)
            steps.append({"loss": None if loss is None else loss.item(),
                          "plain": plain_loss.item(), "grad_error": worst})  # fmt: skip
            optimizer.step()
            plain_optimizer.step()
        params = max(relative(p, reference[k]) for k, p in pipe.named_parameters())
        keys = sorted(pipe.state_dict())
    finally:
        pipe.close()
    return {"steps": steps, "param_error": params, "names": sorted(names), "keys": keys,
            "split_points": pipe.split_points, "transport": pipe.transport_kind}  # fmt: skip


def across(
    rank: int, world: int, *, model: str, schedule: str, stages: int, pp: int,
    shapes: list[tuple[int, int]],
) -> dict[str, Any]:  # fmt: skip
    """A Cluster case: train_against_plain on `world` processes, `pp` per pipeline and the
    rest data-parallel replicas (a (dp, pp) mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dp = world // pp
    if dp == 1:
        pp_group, dp_group, replica = dist.group.WORLD, None, 0
    else:
        mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
        pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        replica = mesh.get_coordinate()[0]  # type: ignore[index]

    def make(net: nn.Module, example: dict[str, Tensor]) -> Any:
        return gf.pipeline(net, example, split_points(model, stages), chunks=3,
                           schedule=schedule, pp_group=pp_group, dp_group=dp_group,
                           timeout=60)  # fmt: skip

    return train_against_plain(model, make, shapes, replica, dp)
