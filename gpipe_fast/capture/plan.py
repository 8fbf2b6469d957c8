"""What a stage does at each module call of the model's forward, and where its values go."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

# Where a value is taken from, or put, in a run of the model's forward: the leaf `leaf` (in
# torch.utils._pytree's flattening) of the arguments of atom call `at` ("arg"), of what that
# call returned ("out"), of what glue op `at` returned ("op": the glue's torch calls counted
# in order), or of the model's output ("end").
Site = tuple[str, int, int]


@dataclass
class Call:
    """One call of an atom (a module whose call lies within one stage) in the forward."""

    index: int
    fqn: str  # the module's name in the model
    stage: int


@dataclass
class Route:
    """A value computed on one stage and needed by others: its producer takes it at
    `capture`; each consumer puts it at its `deliver` sites (none for the model's inputs,
    which a stage's forward is called with)."""

    key: str
    producer: int
    floating: bool  # a floating tensor: its gradient goes back to the producer
    capture: Site
    deliver: dict[int, list[Site]] = field(default_factory=dict)

    @property
    def consumers(self) -> set[int]:
        return set(self.deliver)


@dataclass
class StageSites:
    """One stage's sites by kind and index: leaf -> route key, to capture or to put."""

    capture: dict[str, dict[int, dict[int, str]]]
    put: dict[str, dict[int, dict[int, str]]]

    def any_ops(self) -> bool:
        return bool(self.capture.get("op") or self.put.get("op"))


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
    # Per glue op that a site names: how many atom calls come before it.
    calls_before_op: dict[int, int] = field(default_factory=dict)
    # Per stage, the index of the last call it must reach (its own, or a capture for
    # another stage); the last stage, and a producer of an output leaf, run to the end.
    last_needed: list[int] = field(default_factory=list)
    # The atoms of each stage by name (a module called by several stages is in each).
    atoms: list[list[str]] = field(default_factory=list)

    def input_key(self, name: str) -> str:
        return f"input:{name}"

    def consumed_by(self, stage: int) -> list[Route]:
        return [r for r in self.routes.values() if stage in r.deliver]

    def produced_by(self, stage: int) -> list[Route]:
        return [r for r in self.routes.values() if r.producer == stage]

    def sites(self, stage: int) -> StageSites:
        capture: dict[str, dict[int, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
        put: dict[str, dict[int, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
        for route in self.routes.values():
            kind, at, leaf = route.capture
            if route.producer == stage and kind != "input":
                capture[kind][at][leaf] = route.key
            for kind, at, leaf in route.deliver.get(stage, []):
                put[kind][at][leaf] = route.key
        return StageSites(capture, put)

    def reach(self, site: Site) -> int:
        """The last call a stage must finish to have passed `site` (len(calls): the end)."""
        kind, at, _ = site
        if kind in ("arg", "out"):
            return at
        if kind == "op":
            return self.calls_before_op[at]
        return len(self.calls)
