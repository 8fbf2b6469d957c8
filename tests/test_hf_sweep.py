"""bench/hf_sweep.py: gf.pipeline over transformers' auto mappings, split anywhere, in float64.
The fast suite sweeps one architecture (LLaMA); the full suite sweeps a few of each family,
then them all, and holds the targets: no case off, no error that is not the library's own
refusal, at least 90% of the decoder LMs that run exact at every split."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import hf_sweep

FEW = [("causal", "llama"), ("causal", "opt"), ("seq2seq", "bart"), ("masked", "bert"),
       ("image", "vit")]  # fmt: skip


@pytest.mark.parametrize(("family", "model_type"), FEW, ids=[m for _, m in FEW])
def test_a_few_architectures_are_exact_at_every_split(family: str, model_type: str) -> None:
    row = hf_sweep.sweep_one(family, model_type)
    assert not row.built, row.built
    ran = {case: o for case, o in row.outcomes.items() if o.status != "n/a"}
    assert {split for split, _ in ran} >= {"2 stages", "4 stages", "head", "inside a block"}
    assert all(o.status == "exact" for o in ran.values()), {c: o.cell() for c, o in ran.items()}


def test_every_architecture_of_the_auto_mappings() -> None:
    families = hf_sweep.FAMILIES
    rows = [
        hf_sweep.sweep_one(f, model_type)
        for f in families
        for model_type in hf_sweep.model_types(f)
    ]
    print(hf_sweep.table(rows))
    cases = [(r.model_type, case, o) for r in rows for case, o in r.outcomes.items()]
    off = [(m, c, o.detail) for m, c, o in cases if o.status == "off"]
    errors = [(m, c, o.detail) for m, c, o in cases if o.status == "error"]
    assert not off, off
    assert not errors, errors
    decoders = [r for r in rows if r.family == "causal" and not r.built]
    exact = [r for r in decoders if all(o.status in ("exact", "n/a") for o in r.outcomes.values())]
    assert len(exact) >= 0.9 * len(decoders), (len(exact), len(decoders))
