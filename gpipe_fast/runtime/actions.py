"""The built-in actions' handlers: each native action runs the Stage method of its name."""

from __future__ import annotations

from gpipe_fast.runtime.stage import Stage
from gpipe_fast.schedule.registry import set_handler

# The native core's built-in actions (csrc/schedule/action.cpp), each Stage's method of that
# name; an action registered later brings its own handler (registry.register_action).
BUILTIN = (
    "forward", "recompute", "backward", "backward_input", "backward_weight", "loss",
    "send_forward", "recv_forward", "send_backward", "recv_backward", "reduce_grad",
    "send_skips", "recv_skips", "send_skip_grads", "recv_skip_grads",
)  # fmt: skip

for _name in BUILTIN:
    set_handler(_name, getattr(Stage, _name))
