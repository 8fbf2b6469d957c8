"""What each stage must hold as real tensors, and from which stage each value that crosses comes.

A stage needs real the arguments of its atoms (the last stage, the model's output too). A value
made from its own atoms' outputs and from what every stage has (the model's inputs, constants,
the glue's parameters and buffers, which it then holds) it computes itself; a value made by
another single stage comes from there by a route (taken where that stage makes it, put where
this one makes its placeholder of it); a value that mixes several stages' values it computes
itself, from its ingredients.
"""

from __future__ import annotations

from gpipe_fast.capture.plan import Route, Value


class Needs:
    """The values (by key) each stage must have real, and what each is for (for messages);
    `firsts`: the index of each stage's first atom call."""

    def __init__(self, firsts: list[int]) -> None:
        self.firsts = firsts
        self.roots: list[list[tuple[int, str]]] = [[] for _ in firsts]

    def add(self, stage: int, key: int, what: str) -> None:
        self.roots[stage].append((key, what))


def find_routes(
    values: dict[int, Value], needs: Needs, stale: set[int]
) -> tuple[dict[str, Route], list[list[str]]]:
    """The routes between stages (by wire key, in the order found) and, per stage, the names
    of the parameters and buffers its glue reads."""
    routes: dict[int, Route] = {}
    reads: list[list[str]] = [[] for _ in needs.roots]
    done: set[tuple[int, int]] = set()
    pending = [(stage, key, what) for stage, roots in enumerate(needs.roots)
               for key, what in roots]  # fmt: skip
    pending.reverse()
    while pending:
        stage, key, what = pending.pop()
        if (stage, key) in done:
            continue
        done.add((stage, key))
        value = values[key]
        if value.kind == "state":
            if value.name not in reads[stage]:
                reads[stage].append(value.name)
            continue
        others = value.stages - {stage}
        if value.kind in ("input", "untracked") or not others:
            # Every stage's, or made of this stage's own and every stage's values.
            pending.extend((stage, k, what) for k in reversed(value.inputs))
            continue
        if len(value.stages) > 1:  # several stages' values, combined here
            pending.extend((stage, k, what) for k in reversed(value.inputs))
            continue
        (producer,) = value.stages
        if (
            value.kind == "op"
            and producer + 1 < len(needs.firsts)
            and (value.call > needs.firsts[producer + 1])
        ):
            # Made by glue after later stages' modules ran: made here, from its ingredients,
            # rather than by a producer running through the later stages' placeholders.
            pending.extend((stage, k, what) for k in reversed(value.inputs))
            continue
        if producer > stage:
            raise ValueError(
                f"gpipe_fast.pipeline: {what} (stage {stage}) needs {value.what}, which a later "
                f"stage ({producer}) computes; move the split points"
            )
        _refuse_written(value, stale, producer, stage)
        route = routes.get(key)
        if route is None:
            route = routes[key] = Route(f"v{len(routes)}", producer, key,
                                        floating=_floating(value), what=value.what)  # fmt: skip
            pending.append((producer, key, what))  # its producer makes it for real
        if stage not in route.consumers:
            route.consumers.append(stage)
    return {r.key: r for r in routes.values()}, reads


def _floating(value: Value) -> bool:
    return bool(
        value.dtype is not None and (value.dtype.is_floating_point or value.dtype.is_complex)
    )


def _refuse_written(value: Value, stale: set[int], producer: int, consumer: int) -> None:
    """A value the glue writes in place cannot be put where another stage makes its own."""
    if value.key in stale or (value.kind == "op" and value.leaf < 0):
        raise ValueError(
            f"gpipe_fast.pipeline: {value.what} goes from stage {producer} to stage "
            f"{consumer}, and the model's forward writes it in place (an op ending in '_', "
            "x[...] = ...), so the value sent and the value read would differ; move the split "
            "points so that one stage computes and writes it"
        )
