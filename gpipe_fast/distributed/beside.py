"""A broken connection in torch's collectives beside a pipe, raised as PeerFailure naming the dead.

Those collectives (a DCP save, say) are torch's own: where a rank died in them, gloo says only
"Connection reset by peer"; under `naming_dead_ranks` the rank that died is named, as the
pipe's own waits do."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from gpipe_fast.distributed.guard import LOST_CONNECTION, Guard
from gpipe_fast.errors import PeerFailure


def is_lost_connection(error: BaseException) -> bool:
    """Whether `error` is a connection to another process that broke: an OSError of that
    kind, torch's network error, or gloo's RuntimeError saying so. DCP gathers every rank's
    error into one CheckpointException (its `failures`): one of them broken is enough."""
    if isinstance(error, (ConnectionError, dist.DistNetworkError)):
        return True
    if isinstance(error, RuntimeError) and any(text in str(error) for text in LOST_CONNECTION):
        return True
    failures = getattr(error, "failures", None)
    return isinstance(failures, dict) and any(
        isinstance(failure, BaseException) and is_lost_connection(failure)
        for failure in failures.values()
    )


@contextmanager
def naming_dead_ranks(guard: Guard | None, what: str) -> Iterator[None]:
    """Runs the block; a broken connection raised in it becomes PeerFailure naming the rank
    that died (reported to the pipe's other ranks, like a failed step). Every other error,
    and any error of a pipe without processes (`guard` None), passes as it is."""
    try:
        yield
    except BaseException as error:
        if guard is None or isinstance(error, PeerFailure) or not is_lost_connection(error):
            raise
        everyone = tuple(range(dist.get_world_size()))
        raise guard.lost(what, None, error, everyone) from error
