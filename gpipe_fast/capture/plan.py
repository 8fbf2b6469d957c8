"""What a stage does at each module call of the model's forward, and where its values go."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A leaf of a call's arguments: its position in torch.utils._pytree's flattening of
# (args, kwargs).
LeafIndex = int


@dataclass
class Call:
    """One call of an atom (a module whose call lies within one stage) in the forward."""

    index: int
    fqn: str  # the module's name in the model
    stage: int
    # The argument leaves this call's stage takes from another stage: leaf -> route key.
    receives: dict[LeafIndex, str] = field(default_factory=dict)
    # The argument leaves captured at this call for other stages: leaf -> route key (the
    # route's producer captures it here: its first appearance as an argument).
    sends: dict[LeafIndex, str] = field(default_factory=dict)


@dataclass
class Route:
    """A value computed on one stage and needed by others."""

    key: str
    producer: int
    consumers: set[int]
    floating: bool  # a floating tensor: its gradient goes back to its producer
    # Captured from the producer's own output at the end of its forward (a leaf of the
    # model's output that no later module takes), not at a call.
    at_end: bool = False


@dataclass
class Plan:
    """The forward's atom calls in order, the routes between stages, and the inputs."""

    stages: int
    calls: list[Call]
    routes: dict[str, Route]
    # The model's inputs: the names of its tensor arguments (split into micro-batches and
    # sent from stage 0 to every other), and its other arguments (the same for every
    # micro-batch and stage). Positional arguments are named "0", "1", ...
    tensor_inputs: list[str]
    constant_inputs: dict[str, Any]
    positional: int  # how many of the inputs are positional
    # The last stage's output leaves that another stage computes: leaf -> route key; and
    # where their producers capture them in their own output (the same leaves).
    output_receives: dict[LeafIndex, str] = field(default_factory=dict)
    output_sends: dict[LeafIndex, str] = field(default_factory=dict)
    # Per stage, the index of the last call it must reach (its own, or a capture for
    # another stage); the last stage runs the forward to its end.
    last_needed: list[int] = field(default_factory=list)
    # The atoms of each stage by name (a module called by several stages is in each).
    atoms: list[list[str]] = field(default_factory=list)

    def input_key(self, name: str) -> str:
        return f"input:{name}"

    def consumed_by(self, stage: int) -> list[Route]:
        return [r for r in self.routes.values() if stage in r.consumers]

    def produced_by(self, stage: int) -> list[Route]:
        return [r for r in self.routes.values() if r.producer == stage]
