"""A model's capture plan: its atom calls, the values that cross stages, what each stage holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpipe_fast.capture.identity import Identities


@dataclass
class Call:
    """One call of an atom (a module whose call lies within one stage) in the forward."""

    index: int
    fqn: str  # the module's name in the model
    stage: int


@dataclass
class Value:
    """A tensor of the forward as the plan knows it: its identity (see capture/identity.py),
    how it is made ("input", "state", "out": an atom's output, "sub": an output of a module
    inside an atom, "op": a glue op's output), and where."""

    key: int
    kind: str
    what: str  # for messages: "output 0 of 'model.layers.1' (call 3)", ...
    stages: frozenset[int]  # the stages whose atoms it derives from
    inputs: tuple[int, ...] = ()  # a glue op's input values (their keys)
    dtype: Any = None
    call: int = -1  # "out"/"sub": the atom call that makes it; "op": the calls before it
    name: str = ""  # "state": the tensor's name in the model; "sub": the module's name
    nth: int = 0  # "sub": which call of that module inside the atom call
    leaf: int = 0  # "out"/"sub": which tensor leaf of the output


@dataclass
class Route:
    """A value one stage computes and later stages need: taken where its producer makes it,
    put where each consumer makes its placeholder of it (the same identity on every stage)."""

    key: str  # its name on the wire ("v0", ...; "input:<name>" for the model's inputs)
    producer: int
    value: int  # the Value's key (-1 for the model's inputs)
    consumers: list[int] = field(default_factory=list)
    floating: bool = True  # a floating tensor: its gradient goes back to the producer
    what: str = ""


@dataclass
class CapturePlan:
    """The forward's atom calls in order, the routes between stages, the model's inputs, and
    the identities of the values the stages take and put."""

    stages: int
    calls: list[Call]
    routes: dict[str, Route]
    # The model's inputs: the names of its tensor arguments (split into micro-batches and
    # sent from stage 0 to every other), and its other arguments (the same for every
    # micro-batch and stage). Positional arguments are named "0", "1", ...
    tensor_inputs: list[str]
    constant_inputs: dict[str, Any]
    positional: int  # how many of the inputs are positional
    training: bool = True  # the model's mode the plan was made in
    identities: Identities = field(default_factory=Identities)
    values: dict[int, Value] = field(default_factory=dict)  # those routes and reads name
    # Per stage: the model's parameters and buffers its glue reads (by name), which the
    # stage holds as its own (several stages: replicas, their gradients summed as ties').
    reads: list[list[str]] = field(default_factory=list)
    # The atoms of each stage by name (a module called by several stages is in each).
    atoms: list[list[str]] = field(default_factory=list)
    # The names of the parameters and buffers the glue reads at all: keyed on every stage.
    state_names: list[str] = field(default_factory=list)
    # The atom calls whose inner modules' outputs the glue reads (transformers' recorded
    # router logits, say): every stage runs their placeholders each time, so that the hooks
    # recording them run alike on every stage.
    side_calls: list[int] = field(default_factory=list)
    # The modules whose calls span several stages (the model itself, ...), by name.
    glue: list[str] = field(default_factory=list)
    # The class of a KV cache the model returns (transformers' use_cache=True), or "".
    cache: str = ""

    def input_key(self, name: str) -> str:
        return f"input:{name}"

    def consumed_by(self, stage: int) -> list[Route]:
        return [r for r in self.routes.values() if stage in r.consumers]

    def produced_by(self, stage: int) -> list[Route]:
        return [r for r in self.routes.values() if r.producer == stage]

    def takes(self, stage: int) -> dict[int, str]:
        """What `stage` takes for others: value key -> route key."""
        return {r.value: r.key for r in self.produced_by(stage) if r.value >= 0}

    def puts(self, stage: int) -> dict[int, str]:
        """What `stage` puts in place of its placeholders: value key -> route key."""
        return {r.value: r.key for r in self.consumed_by(stage) if r.value >= 0}

    def own_calls(self, stage: int) -> int:
        return sum(call.stage == stage for call in self.calls)
