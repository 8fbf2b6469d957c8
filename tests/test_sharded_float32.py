"""dp_shard trains float32 models on gloo: FSDP2 reduces float32 gradients with a
pre-multiplied sum when given a divide factor, which gloo does not have."""

from __future__ import annotations

import dist_cases
import pytest
import torch
from cluster import Cluster
from torch import nn


@pytest.mark.parametrize("sync", ["per_microbatch", "per_step"])
def test_a_float32_model_trains_sharded_on_gloo(two: Cluster, sync: str) -> None:
    size = 8
    replies = two.run("sharded_float32_cases.train_float32", sync=sync, size=size)
    assert all(not reply.failed for reply in replies), replies  # 'PREMUL_SUM with Gloo'
    net = dist_cases.model(2).float()
    x, y = dist_cases.batch(size, seed=100)
    loss = nn.functional.mse_loss(net(x.float()), y.float())
    loss.backward()
    for reply in replies:
        assert reply.value["loss"] == pytest.approx(loss.item(), rel=1e-5)
        grads = reply.value["grads"]
        assert set(grads) == {name for name, _ in net.named_parameters()}
        for name, param in net.named_parameters():
            torch.testing.assert_close(torch.tensor(grads[name]), param.grad, rtol=1e-5, atol=1e-6)
