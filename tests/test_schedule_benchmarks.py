"""The schedule benchmarks' own arithmetic (bench/simulate_scaling.py, bench/schedule_memory.py)
checked against closed forms, so the figures in bench/README.md rest on something tested."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The scripts import their siblings (reporting) from bench/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import schedule_memory
import simulate_scaling


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 8), (4, 16), (8, 32)])
def test_lowered_gpipe_without_transfers_has_the_papers_bubble(
    stages: int, microbatches: int
) -> None:
    forward = 1.5
    makespan, bubble = simulate_scaling.simulate("gpipe", stages, microbatches, forward, 0.0)
    # Fill-drain with a backward twice the forward: (M + K - 1) slots of 3 forwards each.
    assert makespan == pytest.approx(3 * forward * (microbatches + stages - 1))
    assert bubble == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_transfers_lengthen_the_step_but_not_the_work() -> None:
    plain, plain_bubble = simulate_scaling.simulate("1f1b", 4, 16, 1.0, 0.0)
    linked, linked_bubble = simulate_scaling.simulate("1f1b", 4, 16, 1.0, 0.25)
    assert linked > plain
    assert linked_bubble > plain_bubble


def test_every_schedule_holds_what_its_authors_say() -> None:
    workers = schedule_memory.WORKERS
    for schedule in ("gpipe", "1f1b", "zero_bubble", "interleaved"):
        stages = 2 * workers if schedule == "interleaved" else workers
        per_stage, per_worker = schedule_memory.peaks(schedule, stages)
        assert per_worker == schedule_memory.megatron_bound(schedule, stages), schedule
        assert max(per_stage) <= schedule_memory.CHUNKS, schedule


def test_zbv_holds_what_its_program_says_and_no_more_than_1f1b() -> None:
    workers = schedule_memory.WORKERS
    stages = 2 * workers
    per_stage, per_worker = schedule_memory.peaks("zbv", stages)
    assert per_worker == schedule_memory.megatron_bound("zbv", stages)
    assert max(per_stage) <= schedule_memory.CHUNKS
    # Held until the weight gradient: at most 2 W stages of half a 1F1B stage each, that is
    # 1F1B's first stage (W micro-batches of a whole stage).
    held = schedule_memory.program_peaks("zbv", stages, ("backward_weight",))
    one_f_one_b = schedule_memory.program_peaks("1f1b", workers, ("backward",))
    assert max(held) * workers / stages <= max(one_f_one_b)
