"""pipe.clip_grad_norm_ across processes where ties cross ranks: every rank returns the whole
model's norm, bitwise the same value and dtype, and the tied copies stay bitwise equal after
the optimizer's step, even on a rank holding tied copies only (which counts no gradient)."""

from __future__ import annotations

import math
from typing import Any

import clip_cases
import pytest
import torch
from cluster import Cluster, values
from torch import nn

# (schedule, balance, own_last): with [2, 4], rank 1 holds the two tied Linears and nothing
# else; with [3, 4] the second rank holds a tied copy and a Linear of its own.
LAYOUTS = {
    "one rank holds tied copies only": ("1f1b", [2, 4], False),
    "tied copies beside parameters of their own": ("1f1b", [3, 4], True),
    "zbv, tied copies only on rank 1": ("zbv", [2, 1, 1, 2], False),
}
TIED = {"0.weight", "2.weight", "4.weight", "0.bias", "2.bias", "4.bias"}
NORM_TYPES = (2.0, math.inf)


def _plain(dtype: torch.dtype, own_last: bool, norm_type: float) -> dict[str, Any]:
    """The whole model on the whole batch, clipped by torch at 0.3 times its norm: that
    max_norm, the norm, and the clipped gradients and stepped parameters under every name."""
    model = clip_cases.tied_linears(dtype, own_last)
    x, y = clip_cases.batch(dtype)
    nn.functional.mse_loss(model(x), y).backward()
    params = list(model.parameters())
    max_norm = 0.3 * torch.nn.utils.get_total_norm([p.grad for p in params], norm_type).item()
    norm = nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    named = dict(model.named_parameters(remove_duplicate=False))
    grads = {name: p.grad.clone() for name, p in named.items()}
    torch.optim.SGD(params, lr=1.0).step()
    return {"max_norm": max_norm, "norm": norm, "grads": grads,
            "params": {name: p.detach().clone() for name, p in named.items()}}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_clips_by_the_same_norm(two: Cluster, layout: str, dtype: str) -> None:
    schedule, balance, own_last = LAYOUTS[layout]
    plains = [_plain(getattr(torch, dtype), own_last, p) for p in NORM_TYPES]
    clips = [(plain["max_norm"], p) for plain, p in zip(plains, NORM_TYPES, strict=True)]
    ranks = values(two.run("clip_cases.clip_and_step", dtype=dtype, own_last=own_last,
                           schedule=schedule, balance=balance, clips=clips))  # fmt: skip
    exact = dtype == "float64"
    for k, plain in enumerate(plains):
        results = [steps[k] for steps in ranks]
        # Bitwise the same norm and dtype on every rank: the dtype of the plain model's.
        assert {r["dtype"] for r in results} == {str(plain["norm"].dtype)}, results
        assert results[0]["norm"] == results[1]["norm"], NORM_TYPES[k]
        assert results[0]["norm"] == pytest.approx(
            plain["norm"].item(), rel=1e-12 if exact else 1e-2
        )
        # Every copy of the tied weight and bias is bitwise the same after the step.
        for name in ("weight", "bias"):
            copies = [r["params"][f"{i}.{name}"] for r in results for i in (0, 2, 4)
                      if f"{i}.{name}" in r["params"]]  # fmt: skip
            assert len(copies) >= 2 and all(c == copies[0] for c in copies), name
        seen = set()
        for rank, result in enumerate(results):
            for kind in ("grads", "params"):
                for name, value in result[kind].items():
                    torch.testing.assert_close(
                        torch.tensor(value, dtype=plain[kind][name].dtype), plain[kind][name],
                        rtol=1e-12 if exact else 2e-2, atol=1e-14 if exact else 2e-2,
                        msg=f"rank {rank}, {kind} {name}, norm {NORM_TYPES[k]}",
                    )  # fmt: skip
            seen |= set(result["params"])
        assert seen == set(plain["params"])
        assert TIED & set(results[1]["params"]), "rank 1 holds a tied copy"
