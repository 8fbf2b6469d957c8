"""The one-process side of a pipe's steps: every cell runs here, so nothing is agreed."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from gpipe_fast.device.streams import CellStreams
from gpipe_fast.errors import SignatureChanged
from gpipe_fast.nn.items import Counting
from gpipe_fast.nn.microbatch import BatchShare, Value, whole_batch
from gpipe_fast.nn.signature import input_signature
from gpipe_fast.nn.tied import TiedGradients
from gpipe_fast.transport.choice import InProcessMedia
from gpipe_fast.transport.local import LocalTransport
from gpipe_fast.transport.protocol import Transport


class OneProcess:
    """The step path's side when every cell of the pipe runs in this process and no replica
    runs elsewhere (distributed/driver.py's CrossProcess is the other side): the whole batch
    is the share, the loss is this process's, and only the ties' device replicas are summed."""

    def __init__(self, tied: TiedGradients | None) -> None:
        self.tied = tied
        self.media = InProcessMedia()

    def report(self, error: BaseException) -> None:
        """Nobody else to tell: the step's error reaches its caller."""

    def make_transport(self, streams: CellStreams, devices: Sequence[torch.device]) -> Transport:
        return LocalTransport(streams, devices)

    def share(
        self,
        input: Value | None,
        target: Any,
        chunks: int,
        *,
        needs_target: bool,
        counting: Counting | None = None,
        signature: int | None = None,
    ) -> BatchShare:
        share = whole_batch(input, target, chunks, needs_target=needs_target, counting=counting)
        if signature is not None and (found := input_signature(share.given)) != signature:
            raise SignatureChanged(found)
        return share

    @contextmanager
    def running(self, *, backward: bool) -> Iterator[None]:
        """Nothing around a step here: its failure reaches its caller."""
        yield

    def before_step(self) -> None:
        """Each tie's replicas on other devices made equal to its tensor."""
        if self.tied:
            self.tied.before_step()

    def after_backward(self) -> None:
        """Each tie's gradient summed from its replicas on other devices into its tensor."""
        if self.tied:
            self.tied.after_backward()

    def loss(self, local: Tensor | None) -> Tensor:
        assert local is not None, "the last cell runs here"
        return local

    def close(self) -> None:
        pass
