"""Scatter and gather of micro-batches: near-equal sizes, nothing dropped, tuples kept."""

from __future__ import annotations

import pytest
import torch

from gpipe_fast.nn.microbatch import gather, scatter, split_sizes


@pytest.mark.parametrize(
    ("n", "chunks", "sizes"),
    [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (3, 8, [1, 1, 1]), (1, 1, [1]), (7, 1, [7])],
)
def test_split_sizes(n: int, chunks: int, sizes: list[int]) -> None:
    assert split_sizes(n, chunks) == sizes


def test_scatter_gather_round_trip_tensor_and_tuple() -> None:
    x = torch.randn(10, 3)
    parts = scatter(x, 4)
    assert [p.shape[0] for p in parts] == [3, 3, 2, 2]
    assert torch.equal(gather(parts), x)
    pair = (torch.randn(5, 2), torch.arange(5))
    parts = scatter(pair, 2)
    assert all(isinstance(p, tuple) and len(p) == 2 for p in parts)
    joined = gather(parts)
    assert torch.equal(joined[0], pair[0]) and torch.equal(joined[1], pair[1])


def test_gather_rejects_dtype_changes_and_ragged_tuples() -> None:
    with pytest.raises(
        TypeError, match=r"output\[0\] has dtype torch.float32 in micro-batch 0 but "
    ):
        gather([torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64)])
    with pytest.raises(
        ValueError, match=r"different batch sizes \(dim 0\) in micro-batch 1: \[1, 2\]"
    ):
        gather([(torch.randn(2), torch.randn(2)), (torch.randn(2), torch.randn(1))])
    with pytest.raises(ValueError, match="scalar"):
        gather([torch.tensor(1.0)])
    with pytest.raises(TypeError, match="micro-batch 1 has 1 tensors"):
        gather([(torch.randn(2), torch.randn(2)), (torch.randn(2),)])


def test_scatter_rejects_tensors_on_unsupported_devices() -> None:
    with pytest.raises(ValueError, match=r"input\[0\] is on device meta"):
        scatter(torch.empty(4, 2, device="meta"), 2)


def test_gather_joins_a_pytree_leaf_by_leaf() -> None:
    parts = [
        {"h": torch.randn(3, 2), "mask": torch.rand(3) > 0.5, "k": 2, "none": None},
        {"h": torch.randn(2, 2), "mask": torch.rand(2) > 0.5, "k": 2, "none": None},
    ]
    joined = gather(parts)
    assert type(joined) is dict and joined["k"] == 2 and joined["none"] is None
    assert torch.equal(joined["h"], torch.cat([parts[0]["h"], parts[1]["h"]]))
    assert torch.equal(joined["mask"], torch.cat([parts[0]["mask"], parts[1]["mask"]]))


def test_gather_names_the_pytree_leaf_that_differs() -> None:
    with pytest.raises(ValueError, match=r"output\['n'\] is 3 in micro-batch 0 but 2 in "):
        gather([{"h": torch.randn(3), "n": 3}, {"h": torch.randn(2), "n": 2}])
    with pytest.raises(TypeError, match=r"another structure"):
        gather([{"h": torch.randn(3)}, {"x": torch.randn(2)}])
    with pytest.raises(TypeError, match=r"output\[1\] is a Tensor in micro-batch 0 but a "):
        gather([[torch.randn(3), torch.randn(3)], [torch.randn(2), None]])
    with pytest.raises(ValueError, match=r"output\['h'\] is a scalar tensor"):
        gather([{"h": torch.tensor(1.0), "n": 3}])
