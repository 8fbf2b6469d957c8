"""A model's own save_pretrained on one rank of a pipe across processes warns: it would save
the other ranks' stages as they were when the pipe was built. The warning names them and the
writer that saves every rank's own tensors (the reproducer of issue 42's sixth case)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from cluster import Cluster, values


def test_save_pretrained_on_a_rank_names_the_other_ranks_stages(
    two: Cluster, tmp_path: Path
) -> None:
    warned = values(two.run("trainer_cases.own_save_pretrained", folder=str(tmp_path)))
    for rank, other in ((0, "model.layers.2."), (1, "model.embed_tokens.weight")):
        assert len(warned[rank]) == 1, warned[rank]
        message = warned[rank][0]
        assert f"LlamaForCausalLM, rank {rank} of the pipe" in message
        assert other in message and "not as trained" in message
        assert "gpipe_fast.integrations.transformers.save_pretrained" in message
