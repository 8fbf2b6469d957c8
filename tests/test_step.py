"""A step: its stages, the dispatch of tasks by action id, and failures named by cell."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gpipe_fast.device.streams import CellStreams
from gpipe_fast.runtime.cell import Cell
from gpipe_fast.runtime.context import StageServices
from gpipe_fast.runtime.step import Step, annotate
from gpipe_fast.schedule.registry import actions
from gpipe_fast.transport.local import LocalTransport
from gpipe_fast.transport.protocol import Transport


class Owner:
    """A StepOwner of two CPU cells, without a Pipeline or an executor."""

    def __init__(self, modules: list[nn.Sequential]) -> None:
        self.devices = [torch.device("cpu")] * len(modules)
        streams = CellStreams(self.devices, list(range(len(modules))))
        self.cells: list[Cell | None] = [
            Cell(k, m, d, streams, None)
            for k, (m, d) in enumerate(zip(modules, self.devices, strict=True))
        ]
        self.learns = [True] * len(modules)
        self.services = StageServices(self.devices, streams)
        self.failures: list[BaseException] = []

    @property
    def recording(self) -> bool:
        return False

    def may_draw_random(self) -> bool:
        return False

    def transport(self) -> Transport:
        """A step's transport between the two cells (Pipeline.make_transport's part)."""
        return LocalTransport(self.services.streams, self.devices)

    def task_failed(self, error: BaseException) -> None:
        self.failures.append(error)


def _owner() -> Owner:
    torch.manual_seed(0)
    return Owner([nn.Sequential(nn.Linear(3, 4)).double(), nn.Sequential(nn.Linear(4, 2)).double()])


def test_forward_tasks_dispatched_by_action_id_match_the_unpartitioned_module() -> None:
    owner = _owner()
    x = torch.randn(4, 3, dtype=torch.float64)
    step = Step(owner, [x[:2], x[2:]], [False], [[False, False]] * 2, False,
                transport=owner.transport())  # fmt: skip
    forward = actions().index("forward")
    for m in range(2):
        for k in range(2):
            step.run_task(forward, k, m)
    whole = nn.Sequential(*[c.module for c in owner.cells if c is not None])
    got = torch.cat([o for o in step.last_stage().outputs if o is not None])  # type: ignore[misc]
    torch.testing.assert_close(got, whole(x))


def test_a_failing_task_is_named_by_cell_and_reported_to_the_owner() -> None:
    owner = _owner()
    step = Step(owner, [torch.randn(2, 5, dtype=torch.float64)], [False], [[False]] * 2, False,
                transport=owner.transport())  # fmt: skip
    with pytest.raises(RuntimeError, match=r"in cell 0, micro-batch 0, forward pass"):
        step.run_task(actions().index("forward"), 0, 0)
    assert len(owner.failures) == 1


def test_annotate_keeps_the_type_and_prefixes_the_message_once() -> None:
    error = ValueError("bad")
    annotate(error, 2, 3, "backward", copying=True)
    annotate(error, 2, 3, "backward", copying=True)
    assert error.args[0] == "gpipe_fast: in cell 2, micro-batch 3, boundary copy (backward): bad"


def test_backward_runs_once() -> None:
    owner = _owner()
    step: Any = Step(owner, [torch.randn(2, 3, dtype=torch.float64)], [False],
                     [[False]] * 2, True, transport=owner.transport())  # fmt: skip
    step.check_backward_once()
    step.backward_done = True
    with pytest.raises(RuntimeError, match="twice"):
        step.check_backward_once()
