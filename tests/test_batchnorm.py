"""BatchNorm: deferred running statistics equal the whole mini-batch's; recompute counts once."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_deferred_batch_norm_tracks_the_whole_batch(make_pipe, checkpoint: str) -> None:
    module = _model()
    ref = copy.deepcopy(module)
    pipe = make_pipe(
        module,
        [2, 2],
        devices=["cpu", "cpu"],
        chunks=4,
        checkpoint=checkpoint,
        deferred_batch_norm=True,
    )
    for _ in range(3):
        x = torch.randn(16, 5) * 3 + 1
        pipe(x).sum().backward()
        ref(x)
    bn, want = pipe.partitions[0][1], ref[1]
    torch.testing.assert_close(bn.running_mean, want.running_mean)
    torch.testing.assert_close(bn.running_var, want.running_var)
    assert int(bn.num_batches_tracked) == int(want.num_batches_tracked) == 3
    assert module[1].running_mean is bn.running_mean  # state stays in the user's tensors


def test_plain_batch_norm_is_not_updated_twice_by_recompute(make_pipe) -> None:
    module = _model()
    ref = copy.deepcopy(module)
    pipe = make_pipe(module, [2, 2], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    x = torch.randn(8, 5)
    pipe(x).sum().backward()
    for half in x.chunk(2):  # one update per micro-batch, as BatchNorm on each would do
        ref(half)
    torch.testing.assert_close(module[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(module[1].running_var, ref[1].running_var)
    assert int(module[1].num_batches_tracked) == 2


def test_the_layers_normalising_by_batch_statistics_are_named() -> None:
    from gpipe_fast.nn.batchnorm import DeferredBatchNorm, batch_statistics_layers

    model = nn.Sequential(
        nn.Linear(5, 4),
        nn.BatchNorm1d(4),
        nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False)),
        DeferredBatchNorm(4),
        nn.LayerNorm(4),  # each row apart
    )
    assert batch_statistics_layers(model) == ["1", "2.0", "3"]
    model.eval()  # running statistics from now on, but for the layer that tracks none
    assert batch_statistics_layers(model) == ["2.0"]
