"""The errors a step raises wherever it runs, in one process or across processes."""

from __future__ import annotations


class PeerFailure(RuntimeError):
    """Another rank's step failed, or a rank stopped answering: this rank's step stops too."""
