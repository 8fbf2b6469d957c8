"""What the ranks agree on at each step: a step refused after a failed one, or ended by its own."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from gpipe_fast.distributed.guard import Guard, PeerFailure
from gpipe_fast.distributed.process_groups import ProcessGroups


def _groups(guard: Guard, over_rings: bool = True) -> ProcessGroups:
    """A ProcessGroups with only its guard, and rings that carry the step's agreed values or
    none (check_usable needs nothing else)."""
    groups = ProcessGroups.__new__(ProcessGroups)
    groups.guard = guard
    groups.links = object() if over_rings else None  # type: ignore[assignment]
    return groups


@pytest.mark.parametrize("over_rings", [True, False])
def test_a_step_after_a_failed_one_is_refused_and_one_already_failed_ends(
    over_rings: bool,
) -> None:
    store = dist.HashStore()
    failing = _groups(Guard(store, "pipe", 0, 1), over_rings)
    late = _groups(Guard(store, "pipe", 1, 1), over_rings)
    failing.check_usable()  # step 1 on rank 0, which fails in it before rank 1 starts it
    failing.guard.report("ValueError: planted")
    # Rank 1 starts step 1 after that: this very step failed, not an earlier one. Over the
    # rings the step ends now; over the process group it goes on to the step's first
    # all-reduce, in which the failing rank (which refused the step: none gets further
    # alone) takes part, and which raises it (ProcessGroups.batch).
    if over_rings:
        with pytest.raises(PeerFailure, match=r"^gpipe_fast: the step failed on rank 0: Value"):
            late.check_usable()
    else:
        late.check_usable()
    # Step 2 on either rank: refused, the failure was an earlier step's.
    for groups in (failing, late):
        with pytest.raises(PeerFailure, match="an earlier step failed on rank 0: ValueError"):
            groups.check_usable()


def test_a_step_with_no_failure_anywhere_goes_on() -> None:
    groups = _groups(Guard(dist.HashStore(), "pipe", 0, 1))
    groups.check_usable()
    groups.check_usable()
    assert groups.guard.step == 2
