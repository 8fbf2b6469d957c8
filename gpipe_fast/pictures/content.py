"""What a timeline picture shows, whoever draws it (PNG, SVG or Chrome trace).

Each box's style, label and hover text, the legend's groups and the title."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from gpipe_fast.schedule.registry import one_way_actions

Group = Literal["compute", "communication", "idle"]
GROUPS: tuple[Group, ...] = ("compute", "communication", "idle")


class PictureSpan(Protocol):
    """What a picture reads of a span (a timeline's TaskSpan): the pictures sit below the
    timeline, which draws itself through them, so they name no class of it."""

    @property
    def phase(self) -> str: ...
    @property
    def kind(self) -> str: ...  # the span's action (TaskSpan's public name for it)
    @property
    def cell(self) -> int: ...
    @property
    def microbatch(self) -> int: ...
    @property
    def row(self) -> int: ...
    @property
    def start_s(self) -> float: ...
    @property
    def end_s(self) -> float: ...
    @property
    def duration_s(self) -> float: ...
    @property
    def task(self) -> int: ...


class PictureTimeline(Protocol):
    """What a picture reads of a timeline (a Timeline)."""

    @property
    def spans(self) -> Sequence[PictureSpan]: ...
    @property
    def schedule(self) -> str: ...
    @property
    def cells(self) -> int: ...
    @property
    def microbatches(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def gap_s(self) -> float: ...
    @property
    def ideal_bubble(self) -> float: ...
    @property
    def whole_backward(self) -> tuple[int, ...]: ...
    @property
    def clocks(self) -> Sequence[str]: ...
    def phase_window(self, phase: Literal["forward"]) -> tuple[float, float]: ...
    def row_name(self, worker: int) -> str: ...
    def compute_rows(self) -> list[int]: ...
    def bubble(self) -> float: ...


@dataclass(frozen=True)
class Style:
    """How the spans of one action are drawn: a filled box, or (a wait) a hatched empty one."""

    letter: str  # the label's prefix: "F" in "F2.5"
    words: str  # the legend's name for it
    group: Group
    colour: str  # the fill; for a wait, its hatch
    hatched: bool = False

    @property
    def text_colour(self) -> str:
        """Black on light fills and on hatching, white on dark fills."""
        if self.hatched:
            return "#333333"
        red, green, blue = (int(self.colour[i : i + 2], 16) for i in (1, 3, 5))
        return "#222222" if 0.299 * red + 0.587 * green + 0.114 * blue > 150 else "#ffffff"


# Compute in strong hues; sends (work a worker does) in hues of their own; a receive mostly
# waits for its data, so it is drawn as idle: hatched, with no fill.
_WAIT = "#8c8c8c"
STYLES: dict[str, Style] = {
    "forward": Style("F", "forward", "compute", "#4c72b0"),
    "recompute": Style("R", "recompute", "compute", "#dd8452"),
    "backward": Style("B", "backward", "compute", "#55a868"),
    "backward_input": Style("I", "backward, input gradient", "compute", "#55a868"),
    "backward_weight": Style("W", "backward, weight gradient", "compute", "#a6d96a"),
    "loss": Style("L", "loss", "compute", "#c44e52"),
    "copy": Style("C", "copy", "compute", "#9d7660"),
    "send_forward": Style("sF", "send activations", "communication", "#64b5cd"),
    "send_backward": Style("sB", "send gradients", "communication", "#da8bc3"),
    "send_skips": Style("sS", "send skips", "communication", "#ccb974"),
    "send_skip_grads": Style("sG", "send skip gradients", "communication", "#7f6d5f"),
    "reduce_grad": Style("AR", "all-reduce gradients", "communication", "#8172b3"),
    "recv_forward": Style("rF", "activations", "idle", _WAIT, hatched=True),
    "recv_backward": Style("rB", "gradients", "idle", _WAIT, hatched=True),
    "recv_skips": Style("rS", "skips", "idle", _WAIT, hatched=True),
    "recv_skip_grads": Style("rG", "skip gradients", "idle", _WAIT, hatched=True),
}
IDLE_FILL = "#f4f4f4"  # a row's background: the time its worker ran no task
CALLER_HATCH = "#c0c0c0"  # between pipe(x) and its backward: the caller's loss
MONOSPACE_EM = 0.6  # a monospace character's width, in ems (the labels' font)


def style(action: str) -> Style:
    """The action's style; an action registered later is drawn as compute in grey."""
    found = STYLES.get(action)
    if found is not None:
        return found
    if action in one_way_actions("receive"):
        return Style(action[:2], action.replace("_", " "), "idle", _WAIT, hatched=True)
    return Style(action[:1].upper(), action.replace("_", " "), "compute", "#937860")


def label(span: PictureSpan) -> str:
    """Action letter, stage.micro-batch: "F2.5" is the forward of cell 2 on micro-batch 5."""
    return f"{style(span.kind).letter}{span.cell}.{span.microbatch}"


def hover(timeline: PictureTimeline, span: PictureSpan) -> str:
    """The span in words, with its times in ms: a hover title, a trace event's description."""
    drawn = style(span.kind)
    what = f"wait for {drawn.words}" if drawn.hatched else drawn.words
    return (
        f"{label(span)}: {what} of cell {span.cell}, micro-batch {span.microbatch}; "
        f"{span.duration_s * 1e3:.3f} ms ({span.start_s * 1e3:.3f} to {span.end_s * 1e3:.3f} ms) "
        f"on {timeline.row_name(span.row)}{_split_note(timeline, span)}"
    )


def _split_note(timeline: PictureTimeline, span: PictureSpan) -> str:
    """Where a split backward's weight gradients of compiled layers went."""
    if span.cell not in timeline.whole_backward:
        return ""
    if span.kind == "backward_input":
        return "; the compiled layers' weight gradients too (one compiled backward each)"
    if span.kind == "backward_weight":
        return "; the other layers' only (the compiled ones' came with backward_input)"
    return ""


@dataclass(frozen=True)
class Placed:
    """A label that fits its box: the text, and whether it runs upwards."""

    text: str
    vertical: bool = False


def fit_label(text: str, box_width: float, box_height: float, font: float) -> Placed | None:
    """The label to write in a box (sizes in one unit, `font` the font size in it): the whole
    label across, else up the box, else its action letters across, else none."""

    def width(chars: str) -> float:
        return len(chars) * MONOSPACE_EM * font + 0.4 * font  # a margin either side

    line = 1.2 * font
    if width(text) <= box_width and line <= box_height:
        return Placed(text)
    if width(text) <= box_height and line <= box_width:
        return Placed(text, vertical=True)
    letters = text.rstrip("0123456789.")
    if letters and width(letters) <= box_width and line <= box_height:
        return Placed(letters)
    return None


@dataclass(frozen=True)
class Entry:
    """One line of the legend."""

    text: str
    style: Style | None  # None: the caller's band between pipe(x) and its backward


def legend(timeline: PictureTimeline) -> dict[Group, list[Entry]]:
    """The legend's lines of each group, for the actions on the timeline (groups without any
    are left out): compute and communication by action; idle, the waits for data together."""
    order = list(STYLES)  # known actions in the table's order, others after them

    def place(action: str) -> tuple[int, str]:
        return (order.index(action) if action in order else len(order), action)

    actions = sorted({s.kind for s in timeline.spans}, key=place)
    groups: dict[Group, list[Entry]] = {group: [] for group in GROUPS}
    waits = [style(action) for action in actions if style(action).hatched]
    for action in actions:
        found = style(action)
        if not found.hatched:
            groups[found.group].append(Entry(f"{found.letter}  {found.words}", found))
    groups["idle"].append(Entry("idle (no task)", Style("", "idle", "idle", IDLE_FILL)))
    if waits:
        names = ", ".join(f"{w.letter} {w.words}" for w in waits)
        groups["idle"].append(Entry(f"wait for data: {names}", waits[0]))
    if timeline.gap_s > 0:
        groups["idle"].append(Entry("caller (the loss)", None))
    return {group: entries for group, entries in groups.items() if entries}


def title(timeline: PictureTimeline) -> str:
    """Names the schedule that ran, its cells, workers and micro-batches, and the bubble."""
    if any(s.phase == "step" for s in timeline.spans):
        run = f"step, schedule {timeline.schedule}"
    else:
        run = f"pipe(x) and backward, schedule {timeline.schedule}"
    workers = len(timeline.compute_rows())
    return (
        f"gpipe_fast {run}: {timeline.cells} cells on {workers} workers, "
        f"M={timeline.microbatches}; bubble {timeline.bubble():.1%} measured, "
        f"{timeline.ideal_bubble:.1%} ideal"
    )


AXIS_LABEL = "time since the step's first task (ms); boxes: action cell.micro-batch"
