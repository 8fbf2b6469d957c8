"""Timeline.plot: the timeline as a PNG drawn with matplotlib (gpipe_fast[plot])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpipe_fast.pictures import content

_HEIGHT = 0.8  # of a row
_HATCH = "////"


def _import_matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError(
            "Timeline.plot needs matplotlib: pip install matplotlib "
            "(or pip install 'gpipe_fast[plot]'); Timeline.to_svg needs nothing"
        ) from error
    return Figure, Patch


def _patch_style(style: content.Style | None) -> dict[str, Any]:
    """Face, edge and hatch of a box or legend patch of `style` (None: the caller's band)."""
    if style is None:
        return {"facecolor": "none", "edgecolor": content.CALLER_HATCH, "hatch": "\\\\"}
    if style.hatched:
        return {"facecolor": content.IDLE_FILL, "edgecolor": style.colour, "hatch": _HATCH}
    return {"facecolor": style.colour, "edgecolor": "white"}


def _legend_handles(
    timeline: content.PictureTimeline, patch: Any
) -> tuple[list[Any], list[str], int]:
    """A column per group, headed by its name: (handles, labels, columns). The columns are
    padded to one length, as the legend fills each column before the next."""
    groups = content.legend(timeline)
    rows = 1 + max(len(entries) for entries in groups.values())
    handles: list[Any] = []
    labels: list[str] = []
    for group, entries in groups.items():
        column: list[tuple[Any, str]] = [(patch(visible=False), group)]
        column += [(patch(linewidth=0.5, **_patch_style(e.style)), e.text) for e in entries]
        column += [(patch(visible=False), "")] * (rows - len(column))
        handles += [handle for handle, _ in column]
        labels += [text for _, text in column]
    return handles, labels, len(groups)


def plot(timeline: content.PictureTimeline, path: str | Path) -> None:
    """Draws `timeline` as a PNG at `path` (see Timeline.plot)."""
    draw(timeline).savefig(path)


def draw(timeline: content.PictureTimeline) -> Any:
    """The matplotlib Figure of `timeline`'s picture."""
    figure_class, patch = _import_matplotlib()
    end = max((s.end_s for s in timeline.spans), default=0.0)
    scale = 1e3  # milliseconds on the axis
    rows = timeline.rows
    handles, labels, columns = _legend_handles(timeline, patch)
    legend_rows = len(handles) // columns
    figure = figure_class(
        figsize=(12, 1.3 + 0.55 * rows + 0.2 * legend_rows), layout="constrained", dpi=120
    )
    axes = figure.add_subplot()
    for worker in range(rows):
        y = rows - 1 - worker  # worker 0 on top
        axes.broken_barh([(0, end * scale)], (y - _HEIGHT / 2, _HEIGHT),
                         facecolors=content.IDLE_FILL, zorder=0)  # fmt: skip
        for span in (s for s in timeline.spans if s.row == worker):
            style = _patch_style(content.style(span.kind))
            axes.broken_barh(
                [(span.start_s * scale, span.duration_s * scale)], (y - _HEIGHT / 2, _HEIGHT),
                facecolors=style["facecolor"], edgecolors=style["edgecolor"],
                hatch=style.get("hatch"), linewidth=0.5, zorder=2,
            )  # fmt: skip
    if timeline.gap_s > 0:
        gap_start = timeline.phase_window("forward")[1]
        axes.axvspan(gap_start * scale, (gap_start + timeline.gap_s) * scale, zorder=1,
                     **_patch_style(None))  # fmt: skip
    axes.set_yticks(range(rows))
    axes.set_yticklabels([timeline.row_name(rows - 1 - y) for y in range(rows)])
    axes.set_ylim(-0.6, rows - 0.4)
    axes.set_xlim(0, end * scale if end > 0 else 1)
    axes.set_xlabel(content.AXIS_LABEL)
    axes.set_title(content.title(timeline))
    legend = figure.legend(handles, labels, loc="outside lower left", ncols=columns,
                           frameon=False, fontsize=8, columnspacing=3.0)  # fmt: skip
    for text in legend.get_texts()[::legend_rows]:
        text.set_fontweight("bold")  # each column's first line: its group's name
    _label_boxes(timeline, figure, axes, end, scale)
    return figure


def _label_boxes(
    timeline: content.PictureTimeline, figure: Any, axes: Any, end: float, scale: float
) -> None:
    """Writes each box's label where it fits (see content.fit_label), once the layout has
    fixed the axes' size in points."""
    figure.draw_without_rendering()
    box = axes.get_window_extent()
    points = 72 / figure.dpi
    per_second = box.width * points / end if end > 0 else 0.0
    row_height = _HEIGHT * box.height * points / (timeline.rows + 0.2)
    fontsize = 7.0 if timeline.microbatches < 10 else 6.0
    for span in timeline.spans:
        placed = content.fit_label(
            content.label(span), span.duration_s * per_second, row_height, fontsize
        )
        if placed is None:
            continue
        text = axes.text((span.start_s + span.duration_s / 2) * scale,
                         timeline.rows - 1 - span.row, placed.text, ha="center", va="center",
                         rotation=90 if placed.vertical else 0, family="monospace",
                         color=content.style(span.kind).text_colour, fontsize=fontsize,
                         zorder=3, clip_on=True)  # fmt: skip
        text.set_in_layout(False)
