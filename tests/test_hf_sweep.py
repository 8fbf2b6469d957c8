"""bench/hf_sweep.py: gf.pipeline over transformers' auto mappings, split anywhere, in float64.
One architecture in the fast suite (LLaMA), the others of a few and a wider sample against
the sweep's targets (no case off, no error that is not the library's own refusal) in the full
one, and the targets' check."""

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


# The full suite's wider sample: the architectures the issue that brought the sweep tried by
# hand, MoE as transformers builds it among them. The whole mapping (hundreds, an hour on two
# cores) is `python bench/hf_sweep.py --check`, too long for CI's 20 minutes.
MORE = [("causal", m) for m in ("mistral", "phi3", "gpt_neox", "qwen3", "gpt2", "falcon",
                                "mixtral", "qwen2_moe", "olmoe")] + [
    ("seq2seq", "t5"), ("seq2seq", "t5gemma")]  # fmt: skip
# Every split of the sweep, each through one schedule: an architecture's own code decides how
# a split is planned, while the schedules run the same stages whatever the model (each is
# swept on the few above, and on every schedule in test_any_model.py). A pipe's planning
# (its forward twice on fake tensors) is most of a case's time.
ONE_SCHEDULE_A_SPLIT = [("2 stages", "1f1b"), ("4 stages", "zbv"), ("first block", "1f1b"),
                        ("head", "1f1b"), ("inside a block", "1f1b"),
                        ("encoder/decoder", "1f1b")]  # fmt: skip


@pytest.mark.parametrize(("family", "model_type"), MORE, ids=[m for _, m in MORE])
def test_more_architectures_meet_the_sweep_targets(family: str, model_type: str) -> None:
    row = hf_sweep.sweep_one(family, model_type, cases=ONE_SCHEDULE_A_SPLIT)
    assert not row.built, row.built
    assert {split for split, _ in row.outcomes} == {split for split, _ in hf_sweep.CASES}
    assert not hf_sweep.misses([row]), hf_sweep.table([row])


def test_misses_names_a_case_off_an_error_and_too_few_exact_decoders() -> None:
    exact = hf_sweep.Outcome("exact")
    rows = [hf_sweep.Row("causal", f"m{i}", outcomes={("head", "1f1b"): exact}) for i in range(9)]
    assert hf_sweep.misses(rows) == []
    refused = hf_sweep.Row("causal", "r", outcomes={("head", "1f1b"): hf_sweep.Outcome(
        "refused", "a split inside a shared module")})  # fmt: skip
    assert hf_sweep.misses([*rows, refused]) == []  # 9 of 10 exact: the target holds
    off = hf_sweep.Row("causal", "o", outcomes={("head", "1f1b"): hf_sweep.Outcome("off", "3e-2")})
    missed = hf_sweep.misses([*rows, refused, off])
    assert missed[0].startswith("o head/1f1b: off") and "9 of 11" in missed[-1]
    error = hf_sweep.Row("seq2seq", "e", outcomes={("head", "1f1b"): hf_sweep.Outcome(
        "error", "KeyError")})  # fmt: skip
    assert hf_sweep.misses([*rows, error]) == ["e head/1f1b: error: KeyError"]
