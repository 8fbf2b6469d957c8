"""The errors a step raises wherever it runs, in one process or across processes."""

from __future__ import annotations


class PeerFailure(RuntimeError):
    """Another rank's step failed, or a rank stopped answering: this rank's step stops too."""


class SignatureChanged(Exception):
    """Every rank's step stops before its first task: cell 0's input has another signature
    than the one the step expected (an "auto" pipe's current choice's), agreed with the batch
    size. Not a failure: the pipe takes the choice for `signature` and runs the step again."""

    def __init__(self, signature: int) -> None:
        super().__init__(f"the input's signature changed to {signature}")
        self.signature = signature
