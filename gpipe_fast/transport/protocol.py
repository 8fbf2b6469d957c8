"""The Transport protocol every stage calls, whether its neighbours run here or elsewhere."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, Literal, Protocol

from torch import Tensor

# Activations flow from stage s to s + 1, their gradients from s to s - 1.
Flow = Literal["activation", "gradient"]
ACTIVATION: Flow = "activation"
GRADIENT: Flow = "gradient"

# What crosses: an activation is any pytree of tensors and other values (what a cell
# returned: a lone tensor, a tuple, a dict, a namedtuple, holding None, ints, ...); a
# gradient is a tuple of one entry per tensor leaf of the activation, None where there is
# none.
Payload = Any


class Transport(Protocol):
    """Moves what one stage produces to the stage that consumes it. Stages and steps call
    only these, so the same stage code runs in one process (LocalTransport) or across
    processes (gpipe_fast.transport.processes)."""

    def send(self, flow: Flow, stage: int, microbatch: int, payload: Payload) -> None:
        """`stage`'s result for its neighbour: activations for stage + 1, gradients for
        stage - 1 (None where a tensor has no gradient)."""

    def deliver(self, flow: Flow, stage: int, microbatch: int, payload: Payload) -> None:
        """Hands `stage` a value from outside the stages: the pipe's input (stage 0), the
        gradient of its output (last stage). Read in place where already on its device."""

    def recv(self, flow: Flow, stage: int, microbatch: int) -> Payload:
        """What `stage` receives for `microbatch`, in the structure it was sent, on its
        device and ready for its stream (detached: the stage decides what requires a
        gradient)."""

    def send_skip(
        self,
        flow: Flow,
        stage: int,
        receiver: int,
        microbatch: int,
        key: Hashable,
        tensor: Tensor | None,
    ) -> None:
        """A skip connection's value (flow ACTIVATION: from its stashing stage to its popping
        stage `receiver`) or its gradient (GRADIENT: back from the popping stage to the
        stashing one), for `microbatch`, named by `key` (the skip's (namespace, name)); it
        goes straight to `receiver`, past the stages in between."""

    def recv_skip(self, flow: Flow, stage: int, microbatch: int, key: Hashable) -> Tensor | None:
        """What send_skip sent `stage` for `microbatch` and `key`, on its device, detached."""

    def post(self, flow: Flow, stage: int, microbatch: int) -> None:
        """The send task: puts on its way what `stage` sent to a neighbour elsewhere."""

    def fetch(self, flow: Flow, stage: int, microbatch: int) -> None:
        """The receive task: brings in what `stage`'s neighbour elsewhere sent it, so that
        a later recv finds it."""

    def post_skips(self, flow: Flow, stage: int, microbatch: int) -> None:
        """The skip send task: puts on its way what send_skip left for stages elsewhere
        (flow ACTIVATION: `stage`'s stashes; GRADIENT: the gradients of its pops)."""

    def fetch_skips(self, flow: Flow, stage: int, microbatch: int) -> None:
        """The skip receive task: brings in what stages elsewhere sent `stage` with send_skip
        (its pops, or its stashes' gradients), so that a later recv_skip finds it."""

    def expect(self, receives: Iterable[tuple[Flow, int, int]]) -> None:
        """Told once per step, before it runs, every (flow, stage, micro-batch) its receive
        tasks will fetch (a transport may post those receives ahead)."""

    def finish(self) -> None:
        """At the step's end: waits until everything sent has left."""

    def discard(self) -> None:
        """After a failed step: forgets the values sent and not received, which nobody
        will take (sends already under way are left to finish)."""

    def pending(self) -> int:
        """Values sent and not yet received (0 after a complete step)."""
