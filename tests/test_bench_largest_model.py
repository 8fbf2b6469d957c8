"""bench/largest_model.py's building blocks at toy size: the search, the peak and the cap, and
fit / no-fit trials in fresh processes (no time is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import largest_model as lm  # noqa: E402

MIB = 2**20


def run_python(code: str) -> dict[str, int]:
    """`code` in a fresh interpreter started as the bench starts its ranks (glibc's
    MALLOC_* settings are read at start); the JSON it prints."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, env=lm.worker_env(), cwd=BENCH, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("resolution", sorted(set(lm.RESOLUTION.values())))
@pytest.mark.parametrize("largest", [0, 1, 37, 1000])
def test_the_search_finds_the_largest_fit_to_its_resolution(largest: int, resolution: int) -> None:
    asked: list[int] = []

    def fits(n: int) -> bool:
        asked.append(n)
        return n <= largest

    found = lm.search_largest(fits, resolution=resolution)
    assert len(asked) == len(set(asked))  # no trial twice
    assert found <= largest
    failed = min(n for n in asked if n > largest)
    assert lm.settled(found, failed, resolution)  # within 1 block or 1/resolution of it
    assert largest - found <= max(1, found // resolution)


def test_a_resumed_search_goes_on_from_its_bounds() -> None:
    asked: list[int] = []

    def fits(n: int) -> bool:
        asked.append(n)
        return n <= 21

    assert lm.search_largest(fits, lo=16, hi=32) == 21
    assert all(16 < n < 32 for n in asked)
    trials = [{"per_stage": 16, "outcome": "fit"},
              {"per_stage": 32, "outcome": "rank died or hung"},
              {"per_stage": 24, "outcome": "out of memory"}]  # fmt: skip
    assert lm.next_bounds(trials, 0, None) == (16, 24)


def test_the_peak_reads_a_known_allocation() -> None:
    measured = run_python("""
        import json, torch, largest_model as lm
        lm.reset_peak_rss()
        before = lm.status_bytes("VmRSS")
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page written
        del block
        print(json.dumps({"peak": lm.status_bytes("VmHWM") - before,
                          "after": lm.status_bytes("VmRSS") - before}))
    """)
    assert measured["peak"] == pytest.approx(64 * MIB, rel=0.05)
    assert measured["after"] < 4 * MIB  # freed tensors leave the resident set


def test_the_cap_makes_an_over_budget_allocation_a_catchable_error() -> None:
    outcome = run_python("""
        import json, torch, largest_model as lm
        lm.cap_address_space(lm.status_bytes("VmSize") + 32 * 2**20)
        try:
            torch.ones(256 * 2**20 // 4)
            refused = "no error"
        except Exception as error:
            refused = lm.is_out_of_memory(error)
        small = torch.ones(2**20 // 4).sum().item()  # memory under the cap still works
        print(json.dumps({"refused": refused, "small": small}))
    """)
    assert outcome == {"refused": True, "small": 2**20 // 4}


def test_one_process_fits_a_small_model_and_refuses_a_huge_one() -> None:
    config = lm.Config(1, False, "never")
    small = lm.run_world(config, budget_mib=48, trial=1, timeout_s=300)
    assert small.codes == [0]
    assert [e["per_stage"] for e in small.of("done")] == [1]
    (trial,) = small.of("trial")
    assert trial["outcome"] == "fit" and len(trial["ranks"][0]["step_s"]) == lm.STEPS
    assert trial["ranks"][0]["local_parameters"] == lm.parameters_of(1)
    # 2000 blocks' weights alone are 252 MiB: the allocations past 48 MiB fail.
    huge = lm.run_world(config, budget_mib=48, trial=2000, timeout_s=300)
    assert huge.codes == [0] and not huge.of("done")
    (trial,) = huge.of("trial")
    assert trial["outcome"] == "out of memory", trial


@pytest.mark.slow
def test_two_stages_agree_that_a_huge_model_does_not_fit() -> None:
    # Refused while building (the weights alone exceed the cap), whatever the checkpoint
    # mode; the quick table below has both modes refused inside a step.
    config = lm.Config(2, False, "never")
    world = lm.run_world(config, budget_mib=48, trial=1, timeout_s=300)
    assert world.codes == [0, 0] and [e["per_stage"] for e in world.of("done")] == [1]
    # Each rank's 1000 blocks are 126 MiB of weights: every rank fails (or is told of
    # the other's failure), and both agree, rather than one waiting on the other.
    world = lm.run_world(config, budget_mib=48, trial=1000, timeout_s=300)
    assert world.codes == [0, 0], world.errors
    (trial,) = world.of("trial")
    assert trial["outcome"] == "out of memory"
    assert [r["rank"] for r in trial["ranks"]] == [0, 1]
    assert all(r["outcome"] != lm.FIT for r in trial["ranks"])


def test_sharded_rows_wait_for_dp_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lm, "dp_shard_available", lambda: False)
    (result,) = lm.run_table([lm.Config(2, True, "always")], budget_mib=48)
    assert result.status == "n/a (dp_shard not available)"
    assert "| pp=2, dp=2 sharded, checkpoint=always | 4 | n/a" in lm.table([lm.row(result, None)])


@pytest.mark.slow
def test_the_quick_table_writes_its_record(tmp_path: Path) -> None:
    out = tmp_path / "largest.json"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    done = subprocess.run(
        [sys.executable, str(BENCH / "largest_model.py"), "--quick", "--only", "pp=2, dp off",
         "--json", str(out)],
        capture_output=True, text=True, timeout=900, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["budget_mib"] == lm.BUDGET_MIB["quick"]
    rows = {row["checkpoint"]: row for row in record["rows"]}
    assert set(rows) == {"never", "always"}
    for row in rows.values():
        assert row["status"] == "measured" and row["ranks"] == 2
        assert row["parameters"] == lm.parameters_of(row["depth"]) > 0
        assert 0 < row["step_peak_mib"] < row["peak_rss_mib"]
    # Re-materialisation frees activations for blocks (not a timing: a count).
    assert rows["always"]["depth"] >= rows["never"]["depth"]
    # The searches went past what fits: a step ran out of memory, and both stages said so
    # (neither waited on the other).
    for result in record["results"]:
        refused = [t for t in result["trials"] if t["outcome"] == "out of memory"]
        assert refused, result["config"]
        for trial in refused:
            assert [r["rank"] for r in trial["ranks"]] == [0, 1]
            assert all(r["outcome"] != lm.FIT for r in trial["ranks"])
