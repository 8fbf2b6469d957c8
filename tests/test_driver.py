"""A rank's share of a step across processes (rank_share): the batch agreed, split into
micro-batches, and a rank that cannot run refusing the step without leaving its peers waiting.

The process groups are a fake that records what the rank asks of them: rank_share's own
logic is under test, the groups' collectives are tested across processes elsewhere."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpipe_fast.distributed.driver import rank_share
from gpipe_fast.distributed.guard import PeerFailure
from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.errors import SignatureChanged
from gpipe_fast.nn.items import Counting, StepItems
from gpipe_fast.nn.signature import input_signature


class FakeGroups:
    """Agrees on `agreed` (or raises `fails`), recording each call of batch."""

    def __init__(
        self,
        agreed: tuple[int, int] = (10, 10),
        *,
        rings: bool = False,
        fails: BaseException | None = None,
        unusable: BaseException | None = None,
        first_signature: int | None = None,
    ) -> None:
        self.agreed, self.agrees_over_rings = agreed, rings
        self.fails, self.unusable = fails, unusable
        self.first_signature = first_signature  # cell 0's (None: the caller's own)
        self.calls: list[tuple[int | None, bool, int | None]] = []
        self.signatures: list[int | None] = []

    def check_usable(self) -> None:
        if self.unusable is not None:
            raise self.unusable

    def batch(
        self,
        local: int | None,
        refused: bool = False,
        chunks: int | None = None,
        signature: int | None = None,
    ) -> tuple[int, int, int | None]:
        self.calls.append((local, refused, chunks))
        self.signatures.append(signature)
        if self.fails is not None:
            raise self.fails
        first = self.first_signature if self.first_signature is not None else signature
        return (*self.agreed, None if signature is None else first)

    def items(
        self, counted: list[int] | None, count: int, *, from_first: bool
    ) -> tuple[list[int] | None, int]:
        """Agrees on the items as one replica of a pipe whose first rank counted [2, 5]."""
        self.counted = (counted, count, from_first)
        local = [2, 5] if from_first else counted
        return local, sum(local or [])


def _layout(index: int) -> ProcessLayout:
    """Rank `index` of a two-stage pipe over two processes."""
    return ProcessLayout(None, None, (0, 1), index, 2, (0, 1))


def _share(
    index: int, groups: Any, *args: Any, reported: list[BaseException] | None = None, **kwargs: Any
) -> tuple[Any, list[BaseException]]:
    """Rank `index`'s share, and the errors it reported to its peers (into `reported`)."""
    reported = [] if reported is None else reported
    return rank_share(_layout(index), groups, reported.append, *args, **kwargs), reported


def test_the_first_ranks_input_is_split_and_its_size_told() -> None:
    x = torch.randn(10, 3)
    groups = FakeGroups((10, 20))
    share, reported = _share(0, groups, x, None, 4, needs_target=True)
    assert groups.calls == [(10, False, None)]
    assert (share.batch, share.total, share.count) == (10, 20, 4)
    assert share.given[0] is x
    assert [m.shape[0] for m in share.microbatches] == [3, 3, 2, 2]
    assert torch.equal(torch.cat(share.microbatches), x)
    assert share.targets == [None] * 4  # the target is the last cell's rank's
    assert reported == []


def test_the_first_rank_tells_its_inputs_signature_with_the_batch_size() -> None:
    x = torch.randn(10, 3)
    expected = input_signature((x,))
    groups = FakeGroups((10, 10))
    share, _ = _share(0, groups, x, None, 2, needs_target=False, signature=expected)
    assert groups.signatures == [expected] and share.count == 2
    # Another input's: every rank raises at the agreement, before any task, and reports
    # nothing (not a failure: the pipe takes that signature's choice and runs again).
    wider = torch.randn(10, 4)
    groups = FakeGroups((10, 10))
    with pytest.raises(SignatureChanged) as changed:
        _share(0, groups, wider, None, 2, needs_target=False, signature=expected)
    assert changed.value.signature == input_signature((wider,)) != expected
    # A rank without the input sends 0 and learns cell 0's.
    groups = FakeGroups((10, 10), first_signature=input_signature((wider,)))
    with pytest.raises(SignatureChanged):
        _, reported = _share(1, groups, None, None, 2, needs_target=False, signature=expected)
    assert groups.signatures == [0]
    share, reported = _share(1, FakeGroups((10, 10), first_signature=expected), None, None, 2,
                             needs_target=False, signature=expected)  # fmt: skip
    assert share.count == 2 and reported == []
    # No signature asked: none sent, none checked.
    groups = FakeGroups((10, 10), first_signature=12345)
    _share(1, groups, None, None, 2, needs_target=False)
    assert groups.signatures == [None]


def test_the_last_ranks_target_is_split_as_the_agreed_batch() -> None:
    y = torch.randn(10, 2)
    groups = FakeGroups((10, 10), fails=None)
    share, _ = _share(1, groups, None, y, 3, needs_target=True, same_count=True)
    assert groups.calls == [(None, False, 3)]  # replicas must agree on the count
    assert share.given == () and share.microbatches == []
    assert torch.equal(torch.cat(share.targets), y)
    with pytest.raises(ValueError, match=r"target has batch size 10 \(dim 0\) but input has 7"):
        _share(1, FakeGroups((7, 7)), None, y, 3, needs_target=True)


@pytest.mark.parametrize(
    ("index", "input", "target", "message"),
    [
        (0, None, None, "input: rank 0 runs cell 0 and needs it"),
        (1, None, None, "target: rank 1 runs the last cell and needs it"),
    ],
)
def test_a_missing_argument_is_refused_after_telling_the_peers(
    index: int, input: Any, target: Any, message: str
) -> None:
    # Over the process group the refusing rank still takes part in the agreement (refused),
    # so that no peer starts the step; then it raises its own error, not its peers'.
    groups = FakeGroups(fails=PeerFailure("a peer refused"))
    with pytest.raises(ValueError, match=message):
        _share(index, groups, input, target, 2, needs_target=True)
    assert groups.calls == [(None, True, None)]
    reported: list[BaseException] = []
    with pytest.raises(ValueError, match=message):
        _share(index, groups, input, target, 2, needs_target=True, reported=reported)
    assert [str(e) for e in reported] == [message]


def test_a_refusing_rank_still_sends_a_signature_when_one_is_expected() -> None:
    # Over the process group its message must be as long as its peers' (a sum of tensors).
    groups = FakeGroups(fails=PeerFailure("a peer refused"))
    with pytest.raises(ValueError, match="input: rank 0 runs cell 0"):
        _share(0, groups, None, None, 2, needs_target=False, signature=7)
    assert groups.calls == [(None, True, None)] and groups.signatures == [0]


def test_over_the_rings_a_refusal_is_raised_at_once() -> None:
    # Its rings close instead: the peers' waits end without an agreement.
    groups = FakeGroups(rings=True)
    with pytest.raises(ValueError, match="input: rank 0"):
        _share(0, groups, None, None, 2, needs_target=False)
    assert groups.calls == []


def test_a_rank_that_is_not_ready_refuses_the_step() -> None:
    def not_ready() -> None:
        raise RuntimeError("pipe is closed")

    groups = FakeGroups()
    with pytest.raises(RuntimeError, match="pipe is closed"):
        _share(1, groups, None, None, 2, needs_target=False, ready=not_ready)
    assert groups.calls == [(None, True, None)]


def test_a_failed_agreement_is_reported_and_raised() -> None:
    groups = FakeGroups(fails=PeerFailure("rank 1 refused"))
    reported: list[BaseException] = []
    with pytest.raises(PeerFailure, match="rank 1 refused"):
        _share(0, groups, torch.randn(4, 3), None, 2, needs_target=False, reported=reported)
    assert reported == [groups.fails]


def test_a_step_after_a_failed_one_is_refused_before_anything() -> None:
    groups = FakeGroups(unusable=PeerFailure("an earlier step failed"))
    with pytest.raises(PeerFailure, match="an earlier step failed"):
        _share(0, groups, torch.randn(4, 3), None, 2, needs_target=False)
    assert groups.calls == []


def _labels(microbatch: Any) -> Any:
    return (microbatch[1] != -100).sum()


def test_the_items_are_counted_where_they_are_and_agreed() -> None:
    # A model's labels: counted in cell 0's input, told to the others by the groups.
    ids = torch.zeros(4, 3, dtype=torch.long)
    labels = torch.tensor([[1, 1, -100], [1, -100, -100], [1, 1, 1], [1, 1, -100]])
    counting = Counting("input", _labels)
    groups = FakeGroups((4, 4))
    share, _ = _share(0, groups, (ids, labels), None, 2, needs_target=False, counting=counting)
    assert groups.counted == ([3, 5], 2, True)
    assert share.items == StepItems([2, 5], 7)  # what the groups agreed
    groups = FakeGroups((4, 4))
    share, _ = _share(1, groups, None, None, 2, needs_target=False, counting=counting)
    assert groups.counted == (None, 2, True)
    # A target's items: counted on the last cell's rank; the others give zeros.
    counting = Counting("target", lambda y: (y != -100).sum(), given=20)
    groups = FakeGroups((4, 4))
    share, _ = _share(1, groups, None, labels, 2, needs_target=True, counting=counting)
    assert groups.counted == ([3, 5], 2, False)
    assert share.items == StepItems([3, 5], 20)
    groups = FakeGroups((4, 4))
    share, _ = _share(0, groups, ids, None, 2, needs_target=True, counting=counting)
    assert groups.counted == ([0, 0], 2, False)


def test_a_count_that_fails_refuses_the_step() -> None:
    def broken(microbatch: Any) -> Any:
        raise RuntimeError("cannot count")

    groups = FakeGroups(fails=PeerFailure("a peer refused"))
    reported: list[BaseException] = []
    with pytest.raises(RuntimeError, match="cannot count"):
        _share(0, groups, torch.zeros(4, 3), None, 2, needs_target=False,
               counting=Counting("input", broken), reported=reported)  # fmt: skip
    assert groups.calls == [(None, True, None)] and [str(e) for e in reported] == ["cannot count"]
