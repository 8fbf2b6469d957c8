"""The pipes a tuning runs its candidates on, and the tuned pipe rebuilt with its choice."""

from __future__ import annotations

from typing import Any

from gpipe_fast.api.auto import Builder, Cut, current_cut
from gpipe_fast.api.relayout import layer_ranks, move_layers
from gpipe_fast.schedule.registry import placement


class Built:
    """The pipes the candidates run on: the tuned pipe for its own cut, one built per
    other cut (kept until the end; on several GPUs one at a time, since building one
    places the shared layers on its devices)."""

    def __init__(self, builder: Builder, pipe: Any) -> None:
        self.builder = builder
        self.pipe = pipe
        self.cut = current_cut(pipe)
        cuda = {d for d in pipe.devices if d.type == "cuda"}
        self.exclusive = len(cuda) > 1
        self.moved_layers = False  # another cut placed the layers (several GPUs)
        self.pipes: dict[Cut, Any] = {}

    def get(self, cut: Cut) -> Any:
        if cut == self.cut and not self.moved_layers:
            return self.pipe
        if cut not in self.pipes:
            if self.exclusive:
                self.close()
                self.moved_layers = True
            self.pipes[cut] = self.builder.build(cut)
        return self.pipes[cut]

    def close(self) -> None:
        for pipe in self.pipes.values():
            pipe.close()
        self.pipes.clear()


def adopt(pipe: Any, builder: Builder, chosen: Cut, before: Cut, moves: bool,
           rebuild: bool) -> None:  # fmt: skip
    """The pipe rebuilt with the chosen cut when it is another (or when the layers were
    placed elsewhere meanwhile); across processes, moved layers handed to their new ranks
    first."""
    if chosen == before and not rebuild:
        return
    processes = pipe.layout
    if moves and (chosen.balance != before.balance or chosen.schedule != before.schedule):
        ranks = processes.pp_ranks
        cells = range(processes.stages)
        old = layer_ranks(before.balance, [processes.global_rank(k) for k in cells])
        places = placement(chosen.schedule, len(chosen.balance), processes.pp_size)
        new = layer_ranks(chosen.balance, [ranks[p] for p in places])
        move_layers(builder.model, old, new, processes.pp_group)
    builder.rebuild(pipe, chosen)
