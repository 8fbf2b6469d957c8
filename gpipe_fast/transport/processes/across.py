"""The Transport across a pipeline group's processes: routes each value, over the media."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from torch import Tensor

from gpipe_fast.distributed.layout import ProcessLayout
from gpipe_fast.skip.layout import SkipLayout
from gpipe_fast.transport.local import LocalTransport
from gpipe_fast.transport.processes.medium import Medium
from gpipe_fast.transport.protocol import ACTIVATION, Flow, Payload


class ProcessTransport:
    """A Transport across the processes of a pipeline group. A value for a stage of this
    process goes through the local mailbox; one for another process waits in the outbox
    until the send task posts it (send_forward / send_backward on the communication worker),
    and the receive task (recv_forward / recv_backward) fetches one into the mailbox. Each
    message, tagged with its flow, boundary and micro-batch, goes over the first of `media`
    that carries its route (medium.py: shared-memory rings between ranks of one host, the
    process group's send/recv for the rest); every wait is bounded by the pipe's guard.

    Skip connections (`skips`) whose stash and pop stages sit on two processes travel the
    same way, one message per (stash stage, pop stage) pair and micro-batch holding that
    pair's skips in the layout's order, straight between the two processes: send_skips
    posts what a stash left, recv_skips fetches it before the popping forward, and their
    gradients go back with send_skip_grads / recv_skip_grads."""

    def __init__(
        self,
        local: LocalTransport,
        layout: ProcessLayout,
        media: Sequence[Medium],
        skips: dict[tuple[int, int], list[Hashable]] | None = None,
    ) -> None:
        self.local = local
        self.layout = layout
        self.media = media
        # Each route's medium, found at its first message (looked up per message, so keyed
        # by what the caller has at hand): (sending cell, receiving cell, flow) -> medium.
        self.routes: dict[tuple[int, int, Flow], Medium] = {}
        self.outbox: dict[tuple[Flow, int, int], Payload] = {}
        # Receives posted ahead (see expect): (flow, stage, m) -> what the medium posted.
        self.headers: dict[tuple[Flow, int, int], Any] = {}
        # The skip pairs between processes (skips_between_ranks: the same on every rank),
        # numbered for their tags; the values send_skip left for another process:
        # (flow, sending stage, receiving stage, m, key) -> value.
        self.skip_pairs = skips or {}
        self.skip_tags = {pair: i for i, pair in enumerate(sorted(self.skip_pairs))}
        self.skip_outbox: dict[tuple[Flow, int, int, int, Hashable], Tensor | None] = {}

    # -- the Transport the stages call -------------------------------------------------------

    def send(self, flow: Flow, stage: int, microbatch: int, payload: Payload) -> None:
        receiver = stage + 1 if flow == ACTIVATION else stage - 1
        if self.layout.is_local(receiver):
            self.local.send(flow, stage, microbatch, payload)
        else:
            self.outbox[(flow, stage, microbatch)] = payload

    def deliver(self, flow: Flow, stage: int, microbatch: int, payload: Payload) -> None:
        self.local.deliver(flow, stage, microbatch, payload)

    def recv(self, flow: Flow, stage: int, microbatch: int) -> Payload:
        return self.local.recv(flow, stage, microbatch)

    def send_skip(
        self,
        flow: Flow,
        stage: int,
        receiver: int,
        microbatch: int,
        key: Hashable,
        tensor: Tensor | None,
    ) -> None:
        if self.layout.is_local(receiver):
            self.local.send_skip(flow, stage, receiver, microbatch, key, tensor)
        else:
            self.skip_outbox[(flow, stage, receiver, microbatch, key)] = tensor

    def recv_skip(self, flow: Flow, stage: int, microbatch: int, key: Hashable) -> Tensor | None:
        return self.local.recv_skip(flow, stage, microbatch, key)

    # -- the communication actions -----------------------------------------------------------

    def _tag(self, flow: Flow, boundary: int, microbatch: int) -> int:
        return (
            (0 if flow == ACTIVATION else 1) * self.layout.stages + boundary
        ) * 65536 + microbatch

    def _skip_tag(self, flow: Flow, pair: tuple[int, int], microbatch: int) -> int:
        # After the boundaries' tags: two per skip pair (its skips, their gradients).
        index = 2 * self.skip_tags[pair] + (0 if flow == ACTIVATION else 1)
        return (2 * self.layout.stages + index) * 65536 + microbatch

    def _what(self, flow: Flow, stage: int, microbatch: int) -> str:
        noun = "activation" if flow == ACTIVATION else "gradient"
        return f"the {noun} of cell {stage}, micro-batch {microbatch}"

    def _skip_what(self, flow: Flow, pair: tuple[int, int], microbatch: int) -> str:
        names = ", ".join(repr(key[1]) for key in self.skip_pairs[pair])  # type: ignore[index]
        noun = "skips" if flow == ACTIVATION else "skips' gradients"
        return (
            f"the {noun} {names} of cell {pair[0]} popped in cell {pair[1]}, "
            f"micro-batch {microbatch}"
        )

    def _medium(self, sender: int, receiver: int, flow: Flow) -> Medium:
        """The medium of a message of `flow` from cell `sender` to cell `receiver`: the first
        of the step's media that carries its route (the last carries any)."""
        medium = self.routes.get((sender, receiver, flow))
        if medium is None:
            route = (self.layout.stage_rank(sender), self.layout.stage_rank(receiver), flow)
            medium = next(m for m in self.media if m.carries(*route))
            self.routes[(sender, receiver, flow)] = medium
        return medium

    def _sender(self, flow: Flow, stage: int, microbatch: int) -> tuple[int, int, Medium]:
        """(rank, tag, medium) of the message `stage` receives for `microbatch` in `flow`."""
        sender = stage - 1 if flow == ACTIVATION else stage + 1
        tag = self._tag(flow, min(stage, sender), microbatch)
        return self.layout.global_rank(sender), tag, self._medium(sender, stage, flow)

    def post(self, flow: Flow, stage: int, microbatch: int) -> None:
        """Sends what `stage` left in the outbox to the process of its neighbour."""
        payload = self.outbox.pop((flow, stage, microbatch))
        receiver = stage + 1 if flow == ACTIVATION else stage - 1
        peer = self.layout.global_rank(receiver)
        tag = self._tag(flow, min(stage, receiver), microbatch)
        medium = self._medium(stage, receiver, flow)
        medium.send(payload, peer, tag, self._what(flow, stage, microbatch), flow)

    def expect(self, receives: Iterable[tuple[Flow, int, int]]) -> None:
        """Posts the header receive of each of the step's messages at once: a sender then
        delivers a header as soon as it posts it, and each receive waits only for its
        tensors (gloo moves a message once its receive is posted). Not over a medium that
        has nothing to post (shared memory: a message waits in its ring until asked for)."""
        for key in receives:
            peer, tag, medium = self._sender(*key)
            posted = medium.post_ahead(peer, tag)
            if posted is not None:
                self.headers[key] = posted

    def fetch(self, flow: Flow, stage: int, microbatch: int) -> None:
        """Receives `stage`'s next value from its neighbour's process into the mailbox."""
        peer, tag, medium = self._sender(flow, stage, microbatch)
        sender = stage - 1 if flow == ACTIVATION else stage + 1
        what = self._what(flow, sender, microbatch)
        posted = self.headers.pop((flow, stage, microbatch), None)
        payload = medium.receive(peer, tag, what, flow, posted)
        self.local.deliver(flow, stage, microbatch, payload)

    def _skip_peers(self, flow: Flow, stage: int, *, sending: bool) -> list[tuple[int, int]]:
        """The skip pairs between processes that `stage` sends (or receives) in `flow`:
        forward, a stash sends to its pops; backward, a pop sends to its stashes."""
        end = 0 if (flow == ACTIVATION) == sending else 1
        return [pair for pair in sorted(self.skip_pairs) if pair[end] == stage]

    def post_skips(self, flow: Flow, stage: int, microbatch: int) -> None:
        """Sends what `stage` left for stages of other processes: one message per pair."""
        for pair in self._skip_peers(flow, stage, sending=True):
            receiver = pair[1] if flow == ACTIVATION else pair[0]
            payload = tuple(
                self.skip_outbox.pop((flow, stage, receiver, microbatch, key))
                for key in self.skip_pairs[pair]
            )
            peer = self.layout.global_rank(receiver)
            tag = self._skip_tag(flow, pair, microbatch)
            what = self._skip_what(flow, pair, microbatch)
            self._medium(stage, receiver, flow).send(payload, peer, tag, what, flow)

    def fetch_skips(self, flow: Flow, stage: int, microbatch: int) -> None:
        """Receives what stages of other processes sent `stage` into the local mailbox:
        every pair's header posted at once, so that they may come in any order."""
        pairs = self._skip_peers(flow, stage, sending=False)
        senders = [pair[0] if flow == ACTIVATION else pair[1] for pair in pairs]
        tags = [self._skip_tag(flow, pair, microbatch) for pair in pairs]
        peers = [self.layout.global_rank(sender) for sender in senders]
        media = [self._medium(sender, stage, flow) for sender in senders]
        posted = [
            medium.post_ahead(peer, tag)
            for medium, peer, tag in zip(media, peers, tags, strict=True)
        ]
        for i, pair in enumerate(pairs):
            what = self._skip_what(flow, pair, microbatch)
            payload = media[i].receive(peers[i], tags[i], what, flow, posted[i])
            sender = senders[i]
            assert isinstance(payload, tuple), "skips travel as a tuple"
            for key, tensor in zip(self.skip_pairs[pair], payload, strict=True):
                self.local.send_skip(flow, sender, stage, microbatch, key, tensor)

    def finish(self) -> None:
        """Waits until everything the step sent has left (at its end), medium by medium."""
        for medium in self.media:
            medium.finish()

    def discard(self) -> None:
        # The outboxes hold what was never sent; the media keep what is in flight.
        self.local.discard()
        self.outbox.clear()
        self.skip_outbox.clear()

    def pending(self) -> int:
        return self.local.pending() + len(self.outbox) + len(self.skip_outbox)


def skips_between_ranks(
    layout: ProcessLayout, skips: SkipLayout | None
) -> dict[tuple[int, int], list[Hashable]]:
    """The skip pairs whose stash and pop cells run on two ranks, (stash, pop) -> their keys
    in the layout's order: what a ProcessTransport sends as messages (found once per pipe)."""
    pairs = skips.pairs() if skips is not None else {}
    return {
        pair: list(keys)
        for pair, keys in pairs.items()
        if layout.stage_rank(pair[0]) != layout.stage_rank(pair[1])
    }
