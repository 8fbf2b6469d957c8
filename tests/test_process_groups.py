"""What the ranks agree on at each step: a step refused after a failed one, or ended by its own."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from gpipe_fast.distributed.guard import Guard, PeerFailure
from gpipe_fast.distributed.process_groups import ProcessGroups


def _groups(guard: Guard) -> ProcessGroups:
    """A ProcessGroups with only its guard (check_usable needs nothing else)."""
    groups = ProcessGroups.__new__(ProcessGroups)
    groups.guard = guard
    return groups


def test_a_step_after_a_failed_one_is_refused_and_one_already_failed_ends() -> None:
    store = dist.HashStore()
    failing, late = _groups(Guard(store, "pipe", 0, 1)), _groups(Guard(store, "pipe", 1, 1))
    failing.check_usable()  # step 1 on rank 0, which fails in it before rank 1 starts it
    failing.guard.report("ValueError: planted")
    # Rank 1 starts step 1 after that: this very step failed, not an earlier one.
    with pytest.raises(PeerFailure, match=r"^gpipe_fast: the step failed on rank 0: ValueError"):
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
