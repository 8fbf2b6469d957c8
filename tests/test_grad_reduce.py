"""Gradients summed over processes: tensors bucketed by dtype and device under a byte limit,
every gradient replaced by its sum over the group (a missing one counted as zeros)."""

from __future__ import annotations

import pytest
import torch
from cluster import Cluster, values

from gpipe_fast.distributed.grad_reduce import BUCKET_BYTES, buckets


def test_buckets_keep_dtypes_apart_and_cut_at_the_limit() -> None:
    doubles = [torch.randn(4, dtype=torch.float64) for _ in range(3)]  # 32 bytes each
    floats = [torch.randn(n) for n in (2, 14, 1)]  # 8, 56 and 4 bytes
    mixed = [doubles[0], floats[0], doubles[1], floats[1], floats[2], doubles[2]]
    cut = buckets(mixed, 64)
    # Each dtype's tensors in their order; a bucket is closed when the next would exceed the
    # limit, and a tensor larger than the limit still gets one.
    assert [[id(t) for t in b] for b in cut] == [
        [id(doubles[0]), id(doubles[1])],
        [id(doubles[2])],
        [id(floats[0]), id(floats[1])],
        [id(floats[2])],
    ]
    assert [[id(t) for t in b] for b in buckets(floats, 4)] == [[id(t)] for t in floats]
    assert [len(b) for b in buckets(mixed, BUCKET_BYTES)] == [3, 3]
    assert buckets([], 64) == []


@pytest.mark.parametrize("limit", [16, BUCKET_BYTES])  # a bucket per tensor, or one per dtype
def test_gradients_are_summed_over_the_group(two: Cluster, limit: int) -> None:
    results = values(two.run("grad_sync_cases.summed_gradients", limit=limit))
    dtypes = [torch.float64, torch.float32, torch.float64]
    for i, dtype in enumerate(dtypes):
        before = [r["before"][i] for r in results]
        assert before[0] is not None and before.count(None) == (1 if i == 0 else 0)
        want = sum(torch.tensor(b, dtype=dtype) for b in before if b is not None)
        assert isinstance(want, torch.Tensor)
        for rank, result in enumerate(results):
            got = torch.tensor(result["after"][i], dtype=dtype)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {rank}, param {i}")
    # A parameter that learns nothing gets no gradient.
    assert [r["after"][3] for r in results] == [None, None]
