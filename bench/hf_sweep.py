"""gf.pipeline over every architecture of transformers' auto mappings, split anywhere, in float64.

For causal LMs, seq2seq LMs, masked LMs and image classifiers, each architecture is built from
a tiny config (its defaults, sizes shrunk, dropout off, evaluation mode) with no download; those
that cannot be built or whose plain model does not run on the example are listed with why.
Each that runs is pipelined at several splits, each with a schedule:

- "2 stages" (gpipe, 1f1b, zbv): between the outermost repeated blocks, in the middle;
- "4 stages" (1f1b, zbv): at a quarter, a half and three quarters of the blocks;
- "first block" (1f1b): at the first block (the embedding alone on stage 0);
- "head" (1f1b): at the output head (`get_output_embeddings()`, or the last module called);
- "inside a block" (1f1b): inside the second block, at the middle one of the modules it calls;
- "encoder/decoder" (1f1b, seq2seq): at the decoder's first block.

Each pipe runs one train_step of a batch of 4 in 2 micro-batches, its loss a fixed random
weighting of the logits (summed), against the plain model run on the same 2 micro-batches:
"exact" when the loss and every gradient agree to 1e-9 (relative, a gradient's error against
its norm floored at 1e-6 of the whole gradient's); "off" (by how much); "refused" (the
library's own ValueError or TypeError, with its reason); or "error".

    python bench/hf_sweep.py [--families causal,seq2seq,masked,image] [--models llama,opt]
                             [--splits "2 stages,head"] [--out table.md]

It prints a markdown table (one row per architecture, one column per split and schedule) and
the totals. tests/test_hf_sweep.py runs a few architectures in the fast suite and the whole
sweep in the full one; the guide's "Any model" page keeps the table.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import gpipe_fast as gf

FAMILIES = {
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
# (split, schedule) columns, in order.
CASES = [
    ("2 stages", "gpipe"), ("2 stages", "1f1b"), ("2 stages", "zbv"),
    ("4 stages", "1f1b"), ("4 stages", "zbv"),
    ("first block", "1f1b"), ("head", "1f1b"), ("inside a block", "1f1b"),
    ("encoder/decoder", "1f1b"),
]  # fmt: skip
EXACT = 1e-9
BATCH, MICRO, LENGTH = 4, 2, 8

# Config fields shrunk wherever a config has them (composite configs: in each sub-config).
SIZES: dict[str, Any] = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "dim": 32, "embed_dim": 32, "n_embed": 32,
    "embedding_size": 32, "word_embed_proj_dim": 32, "d_embed": 32, "hidden_dim": 64,
    "intermediate_size": 64, "ffn_dim": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    "d_ff": 64, "n_inner": 64, "ffn_hidden_size": 64, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_hidden_layers": 4, "n_layer": 4, "num_layers": 4, "n_layers": 4,
    "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "d_kv": 8, "kv_channels": 8, "vocab_size": 96, "max_position_embeddings": 64,
    "n_positions": 64, "n_ctx": 64, "num_local_experts": 4, "num_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "image_size": 32, "patch_size": 8, "num_channels": 3,
    "num_labels": 5, "use_cache": False, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2, "decoder_start_token_id": 1, "sliding_window": 16, "rotary_dim": 4,
    "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "kv_lora_rank": 16,
    "q_lora_rank": 16, "rope_head_dim": 4, "n_group": 1, "topk_group": 1, "qk_head_dim": 8,
    # state-space and recurrent layers
    "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_chunk_size": 8,
    "mamba_d_head": 8, "mamba_headdim": 8, "mamba_num_heads": 4, "mamba_head_dim": 8,
    "mamba_dt_rank": 4, "state_size": 8, "ssm_state_size": 8, "time_step_rank": 4,
    "chunk_size": 8, "adapter_rank": 4, "attention_hidden_size": 32, "attention_head_dim": 8,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "lru_width": 32, "attention_window_size": 16,
    "context_length": 64, "embedding_dim": 32, "block_multiple_of": 8,
    "moe_shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "local_attention_window_len": 16, "encoder_hash_byte_group_vocab": 64,
    "max_inference_chunksize": 64,
}  # fmt: skip
# Where a model reads a field otherwise (DeepSeek's head_dim is its rotary part's).
ROTARY_HEAD_DIM = ["deepseek_v3", "deepseek_v32", "deepseek_v4", "glm4_moe_lite",
                   "glm_moe_dsa", "longcat_flash", "kimi_linear", "mimo_v2_flash", "sarvam_mla",
                   "youtu"]  # fmt: skip
PER_MODEL: dict[str, dict[str, Any]] = {
    **{name: {"head_dim": 4} for name in ROTARY_HEAD_DIM},
    "gpt_neo": {"attention_types": [[["global", "local"], 2]]},  # pairs of its 4 layers
    "mamba2": {"head_dim": 16},  # its heads cover expand x hidden_size
}
# A tiny config that still builds a large model (a field this list does not shrink) is
# listed as not built rather than run.
MAX_PARAMETERS = 3_000_000


@dataclass
class Outcome:
    """One cell of the table."""

    status: str  # "exact", "off", "refused", "error", "n/a"
    detail: str = ""

    def cell(self) -> str:
        if self.status == "exact":
            return "exact"
        if self.status == "n/a":
            return ""
        detail = self.detail.replace("|", "/").replace("\n", " ")
        return f"{self.status}: {detail[:300]}"


@dataclass
class Row:
    family: str
    model_type: str
    built: str = ""  # why it could not be built or run ("" when it ran)
    outcomes: dict[tuple[str, str], Outcome] = field(default_factory=dict)


# -- models ------------------------------------------------------------------------------------


def _shrunk(defaults: dict[str, Any]) -> dict[str, Any]:
    """Overrides for a config's __init__: the SIZES it has, dropout off, sub-configs too."""
    overrides: dict[str, Any] = {}
    for key, value in defaults.items():
        if key in SIZES and not isinstance(value, dict):
            overrides[key] = SIZES[key]
        elif isinstance(value, float) and _drops(key):
            overrides[key] = 0.0
        elif isinstance(value, dict) and "model_type" in value:
            # Per-layer lists (layer_types, ...) left out: the sub-config makes them anew for
            # its fewer layers.
            layers = [value.get(k) for k in ("num_hidden_layers", "num_layers", "n_layer")]
            kept = {k: v for k, v in value.items()
                    if not (isinstance(v, list) and len(v) in layers)}  # fmt: skip
            overrides[key] = {**kept, **_shrunk(value)}
    return overrides


def _drops(key: str) -> bool:
    """Whether a config field is a probability of dropping something."""
    return "dropout" in key or key.endswith("_pdrop") or "drop_path" in key or key == "layerdrop"


def tiny_config(model_type: str) -> Any:
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    overrides = {**_shrunk(defaults), **PER_MODEL.get(model_type, {})}
    return AutoConfig.for_model(model_type, **overrides)


def build(family: str, model_type: str) -> nn.Module:
    import transformers
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, FAMILIES[family])
    class_name = names[model_type]
    cls = getattr(transformers, class_name)
    config = tiny_config(model_type)
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny config still makes {size / 1e6:.0f} M parameters")
    torch.manual_seed(0)
    model = cls(config).double().eval()
    experts = getattr(config, "_experts_implementation", None)
    if experts == "grouped_mm" and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("batched_mm")  # grouped_mm has no float64 kernel
    return model


def inputs(family: str, model: nn.Module, size: int, seed: int) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    if family == "image":
        vision = getattr(config, "vision_config", config)
        channels = getattr(vision, "num_channels", 3)
        side = getattr(vision, "image_size", 32)
        side = side[0] if isinstance(side, (list, tuple)) else side
        pixels = torch.randn(size, channels, side, side, generator=generator, dtype=torch.float64)
        return {"pixel_values": pixels}
    text = getattr(config, "text_config", None) or config
    vocab = getattr(text, "vocab_size", None) or 96
    ids = torch.randint(3, min(vocab, 96), (size, LENGTH), generator=generator)
    if family == "seq2seq":
        decoder = torch.randint(3, min(vocab, 96), (size, LENGTH), generator=generator)
        return {"input_ids": ids, "decoder_input_ids": decoder}
    return {"input_ids": ids}


def _logits(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)):
        logits = output[0]
    if not isinstance(logits, Tensor):
        raise TypeError(f"no logits in the model's output ({type(output).__name__})")
    return logits


def _loss(output: Any, weights: Tensor) -> Tensor:
    return (_logits(output) * weights).sum()


# -- splits ------------------------------------------------------------------------------------


def _calls(model: nn.Module, batch: dict[str, Tensor]) -> list[str]:
    """The model's module calls in order (names), on one forward."""
    names = {id(m): n for n, m in model.named_modules()}
    order: list[str] = []
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: order.append(names[id(module)]) if id(module) in names else None
    )
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        handle.remove()
    return order


def splits(family: str, model: nn.Module, batch: dict[str, Tensor]) -> dict[str, list[str]]:
    """Each split's points for this model (a split it cannot have is left out)."""
    calls = _calls(model, batch)
    lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    outer = [n for n in lists if not any(n.startswith(f"{o}.") for o in lists if o != n)]
    blocks = list(dict.fromkeys(c for c in calls if c.rpartition(".")[0] in outer))
    found: dict[str, list[str]] = {}
    if len(blocks) >= 2:
        found["2 stages"] = [blocks[len(blocks) // 2]]
        found["first block"] = [blocks[0]]
    if len(blocks) >= 4:
        found["4 stages"] = [blocks[len(blocks) * k // 4] for k in (1, 2, 3)]
    head = _head(model, calls)
    if head:
        found["head"] = [head]
    if blocks:
        inner = blocks[1] if len(blocks) > 1 else blocks[0]
        children = [c for c in dict.fromkeys(calls) if c.rpartition(".")[0] == inner]
        if len(children) >= 2:
            found["inside a block"] = [children[len(children) // 2]]
    decoder = [b for b in blocks if "decoder" in b]
    if family == "seq2seq" and decoder:
        found["encoder/decoder"] = [decoder[0]]
    return found


def _head(model: nn.Module, calls: list[str]) -> str | None:
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in model.named_modules():
        if output is not None and module is output and name in calls:
            return name
    tops = [c for c in calls if c and "." not in c]
    return tops[-1] if len(tops) > 1 else None


# -- one case ----------------------------------------------------------------------------------


def _relative(got: Tensor | None, want: Tensor | None, floor: float) -> float:
    if got is None or want is None:
        return 0.0 if got is None and (want is None or not want.any()) else float("inf")
    return ((got - want).norm() / max(want.norm().item(), floor)).item()


def run_case(family: str, model: nn.Module, points: list[str], schedule: str) -> Outcome:
    """One pipe of a copy of `model` at `points` with `schedule` against the plain model."""
    plain = copy.deepcopy(model)
    piped = copy.deepcopy(model)
    batch = inputs(family, model, BATCH, 1)
    with torch.no_grad():
        shape = _logits(plain(**{k: v[:MICRO] for k, v in batch.items()})).shape
    weights = torch.randn((BATCH, *shape[1:]), generator=torch.Generator().manual_seed(2),
                          dtype=torch.float64)  # fmt: skip
    want_loss = 0.0
    for part, weight in zip(_parts(batch), weights.split(MICRO), strict=True):
        loss = _loss(plain(**part), weight)
        loss.backward()
        want_loss += loss.item()
    stages = len(points) + 1
    devices = ["cpu"] * (stages // 2 if schedule == "zbv" else stages)
    example = {k: v[:MICRO] for k, v in batch.items()}
    pipe = None
    try:
        pipe = gf.pipeline(piped, example, points, devices=devices, chunks=BATCH // MICRO,
                           schedule=schedule, checkpoint="except_last")  # fmt: skip
        got_loss = pipe.train_step(batch, weights, _loss, reduction="sum").item()
    except (ValueError, TypeError) as error:
        if _ours(error):
            return Outcome("refused", str(error))
        return Outcome("error", f"{type(error).__name__}: {error}")
    except Exception as error:
        return Outcome("error", f"{type(error).__name__}: {_first_line(error)}")
    finally:
        if pipe is not None:
            pipe.close()
    wants = dict(plain.named_parameters())
    norm = torch.stack([p.grad.norm() for p in wants.values() if p.grad is not None]).norm()
    floor = 1e-6 * norm.item()
    worst = abs(got_loss - want_loss) / max(abs(want_loss), 1e-30)
    worst_name = "the loss"
    for name, param in piped.named_parameters():
        error = _relative(param.grad, wants[name].grad, floor)
        if error > worst:
            worst, worst_name = error, name
    if worst <= EXACT:
        return Outcome("exact")
    return Outcome("off", f"{worst:.1e} ({worst_name})")


def _parts(batch: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
    for start in range(0, BATCH, MICRO):
        yield {k: v[start : start + MICRO] for k, v in batch.items()}


def _ours(error: Exception) -> bool:
    """A refusal of the library's own: its message says who refuses."""
    text = str(error)
    return text.startswith(("gpipe_fast", "split_points", "devices", "example_inputs",
                            "inputs", "balance", "dp_shard"))  # fmt: skip


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0]


# -- the sweep ---------------------------------------------------------------------------------


def model_types(family: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    return sorted(getattr(modeling_auto, FAMILIES[family]))


def sweep_one(family: str, model_type: str, wanted: set[str] | None = None,
              cases: Sequence[tuple[str, str]] = CASES) -> Row:  # fmt: skip
    """One architecture's row: each of `cases` (split, schedule) whose split is `wanted`
    (None: every split)."""
    row = Row(family, model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = build(family, model_type)
            batch = inputs(family, model, MICRO, 0)
            pristine = copy.deepcopy(model)  # a forward may leave tensors in its modules
            model_splits = splits(family, model, batch)
            _logits(model(**batch))
        except Exception as error:
            row.built = f"{type(error).__name__}: {_first_line(error)}"[:150]
            return row
        for split, schedule in cases:
            if wanted is not None and split not in wanted:
                continue
            points = model_splits.get(split)
            if points is None:
                row.outcomes[(split, schedule)] = Outcome("n/a")
                continue
            row.outcomes[(split, schedule)] = run_case(family, pristine, points, schedule)
    return row


def table(rows: list[Row]) -> str:
    """The markdown table (a cell says exact, off, refused or error; blank: no such split),
    then why for each cell that is not exact."""
    columns = [c for c in CASES if any(c in r.outcomes and r.outcomes[c].status != "n/a"
                                       for r in rows)]  # fmt: skip
    head = ["family", "model"] + [f"{s} ({k})" for s, k in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    why: dict[tuple[str, str, str], list[str]] = {}  # (model, split, why) -> schedules
    for row in rows:
        if row.built:
            continue
        cells = []
        for split, schedule in columns:
            outcome = row.outcomes.get((split, schedule), Outcome("n/a"))
            cells.append("" if outcome.status == "n/a" else outcome.status)
            if outcome.status not in ("exact", "n/a"):
                why.setdefault((row.model_type, split, outcome.cell()), []).append(schedule)
        lines.append("| " + " | ".join([row.family, row.model_type, *cells]) + " |")
    notes = [f"- {model}, {split} ({', '.join(schedules)}): {reason}"
             for (model, split, reason), schedules in why.items()]  # fmt: skip
    return "\n".join(lines + (["", *notes] if notes else []))


def _exact(row: Row) -> bool:
    return all(o.status in ("exact", "n/a") for o in row.outcomes.values())


def totals(rows: list[Row]) -> dict[str, Any]:
    ran = [r for r in rows if not r.built]
    outcomes = [o for r in ran for o in r.outcomes.values() if o.status != "n/a"]
    decoders = [r for r in ran if r.family == "causal"]
    exact_decoders = [r for r in decoders if _exact(r)]
    return {
        "architectures": len(rows),
        "ran": len(ran),
        "not built": len(rows) - len(ran),
        "cases": len(outcomes),
        **{
            status: sum(o.status == status for o in outcomes)
            for status in ("exact", "off", "refused", "error")
        },
        "decoder LMs exact at every split": f"{len(exact_decoders)} of {len(decoders)}",
    }


def misses(rows: list[Row]) -> list[str]:
    """The sweep's targets that `rows` miss: a case off, an error that is not the library's own
    refusal, fewer than 90% of the decoder LMs that ran exact at every split."""
    found = [
        f"{r.model_type} {split}/{schedule}: {o.status}: {o.detail[:200]}"
        for r in rows
        for (split, schedule), o in r.outcomes.items()
        if o.status in ("off", "error")
    ]
    decoders = [r for r in rows if r.family == "causal" and not r.built]
    exact = sum(_exact(r) for r in decoders)
    if exact < 0.9 * len(decoders):
        found.append(f"decoder LMs exact at every split: {exact} of {len(decoders)}, under 90%")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--models", default="", help="model types (default: every one)")
    parser.add_argument("--splits", default="", help="splits to run (default: every one)")
    parser.add_argument("--out", default="", help="also write the table to this file")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a target is missed (a case off, an error that is not "
        "a refusal, under 90%% of the decoder LMs exact at every split)",
    )
    args = parser.parse_args(argv)
    import transformers

    torch.set_num_threads(1)
    wanted = set(args.splits.split(",")) if args.splits else None
    models = set(args.models.split(",")) if args.models else None
    rows: list[Row] = []
    for family in args.families.split(","):
        for model_type in model_types(family):
            if models is not None and model_type not in models:
                continue
            start = time.perf_counter()
            row = sweep_one(family, model_type, wanted)
            rows.append(row)
            status = row.built or " ".join(o.status for o in row.outcomes.values())
            print(f"{family:8} {model_type:28} {time.perf_counter() - start:5.1f}s {status}",
                  file=sys.stderr, flush=True)  # fmt: skip
    text = [f"transformers {transformers.__version__}, torch {torch.__version__}", "",
            table(rows), "", "Not built or not run on the example:", ""]  # fmt: skip
    text += [f"- {r.family} {r.model_type}: {r.built}" for r in rows if r.built]
    text += ["", "Totals: " + ", ".join(f"{k} {v}" for k, v in totals(rows).items())]
    missed = misses(rows)
    text += ["", "Targets missed:" if missed else "Targets: all met.", ""]
    text += [f"- {miss}" for miss in missed]
    report = "\n".join(text)
    print(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(report + "\n")
    return 1 if args.check and missed else 0


def cases_of(row: Row) -> Callable[[], None]:  # pragma: no cover - for interactive use
    return lambda: print(traceback.format_exc())


if __name__ == "__main__":
    sys.exit(main())
