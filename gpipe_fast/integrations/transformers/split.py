"""Default split points from a transformers model's own pipeline plan (`_pp_plan`)."""

from __future__ import annotations

from torch import nn

from gpipe_fast.balancing.balance import partition


def plan_blocks(model: nn.Module) -> list[str]:
    """The blocks of the outermost module that declares a pipeline plan (LLaMA's
    `{"model.embed_tokens", "model.layers", "model.norm", "lm_head"}`), named from `model`:
    the children of its ModuleLists (`model.layers.0`, ...), in order. Empty without a plan."""
    for prefix, module in model.named_modules():
        # The module's own plan, not one a wrapper forwards from the model it wraps (PEFT).
        plan = vars(module).get("_pp_plan") or getattr(type(module), "_pp_plan", None)
        if not plan:
            continue
        blocks = []
        for entry in plan:
            child = module.get_submodule(entry)
            if isinstance(child, nn.ModuleList):
                name = f"{prefix}.{entry}" if prefix else entry
                blocks += [f"{name}.{index}" for index in child._modules]
        return blocks
    return []


def plan_split_points(model: nn.Module, stages: int) -> list[str] | None:
    """`stages - 1` split points among the plan's blocks, balancing their parameter counts
    (what comes before the first block goes with it, the rest with the last); None when the
    model declares no plan, or too few blocks for `stages`."""
    blocks = plan_blocks(model)
    if not blocks or len(blocks) < stages:
        return None
    if stages == 1:
        return []
    inside = {id(p) for name in blocks for p in model.get_submodule(name).parameters()}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in inside)
    costs = [float(sum(p.numel() for p in model.get_submodule(n).parameters())) for n in blocks]
    costs[0] += rest / 2  # the embedding before the blocks, the norm and head after them
    costs[-1] += rest / 2
    points, at = [], 0
    for size in partition(costs, stages)[:-1]:
        at += size
        points.append(blocks[at])
    return points
