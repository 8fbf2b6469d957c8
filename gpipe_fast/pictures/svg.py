"""Timeline.to_svg: the timeline as an SVG picture, with nothing to install.

A browser shows each box's task in words when the pointer rests on it."""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

from gpipe_fast.pictures import content

_WIDTH = 1400  # px
_FONT = 12  # px: row names, axis, legend
_LABEL_FONT = 10  # px: the boxes' labels
_ROW, _BOX = 34, 26  # px: a row's height, a box's
_TOP = 40  # px above the first row: the title
_FAMILY = "DejaVu Sans Mono, Menlo, Consolas, monospace"  # known widths: labels fit as planned


def _ticks(end_ms: float) -> list[float]:
    """Round times from 0 to `end_ms`, 5 to 10 of them (steps of 1, 2 or 5 times 10^k)."""
    if end_ms <= 0:
        return [0.0]
    power = 10 ** math.floor(math.log10(end_ms / 5))
    step = next(power * m for m in (1, 2, 5, 10) if end_ms / (power * m) <= 10)
    return [i * step for i in range(int(end_ms / step + 1e-9) + 1)]


def _fill(style: content.Style | None) -> str:
    if style is None:
        return 'fill="url(#caller)" stroke="none"'
    if style.hatched:
        return f'fill="url(#wait)" stroke="{style.colour}" stroke-width="0.5"'
    return f'fill="{style.colour}" stroke="#ffffff" stroke-width="0.5"'


def _defs() -> list[str]:
    hatch = (
        '<pattern id="{id}" patternUnits="userSpaceOnUse" width="5" height="5" '
        'patternTransform="rotate({angle})"><rect width="5" height="5" fill="{back}"/>'
        '<line x1="0" y1="0" x2="0" y2="5" stroke="{colour}" stroke-width="1.2"/></pattern>'
    )
    return [
        "<defs>",
        hatch.format(id="wait", angle=45, back=content.IDLE_FILL, colour="#8c8c8c"),
        hatch.format(id="caller", angle=-45, back="none", colour=content.CALLER_HATCH),
        "</defs>",
        "<style>.span:hover rect { stroke: #000000; stroke-width: 1.5; }</style>",
    ]


def _text(x: float, y: float, text: str, size: int, **attributes: str) -> str:
    extra = "".join(f' {name.replace("_", "-")}="{value}"' for name, value in attributes.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" font-family="{_FAMILY}"{extra}>'
        f"{escape(text)}</text>"
    )


def _legend(timeline: content.PictureTimeline, top: float, left: float) -> tuple[list[str], float]:
    """A column per group, headed by its name; returns the elements and their height."""
    groups = content.legend(timeline)
    out, column_x, line = [], left, _FONT + 6
    for group, entries in groups.items():
        out.append(_text(column_x, top + _FONT, group, _FONT, font_weight="bold"))
        for i, entry in enumerate(entries, start=1):
            y = top + i * line
            out.append(f'<rect x="{column_x:.1f}" y="{y + 2:.1f}" width="18" height="{_FONT}" '
                       f"{_fill(entry.style)}/>")  # fmt: skip
            out.append(_text(column_x + 24, y + _FONT, entry.text, _FONT))
        longest = max(len(e.text) for e in entries)
        column_x += 24 + max(longest, len(group)) * content.MONOSPACE_EM * _FONT + 36
    return out, (1 + max(len(entries) for entries in groups.values())) * line


def _span(
    timeline: content.PictureTimeline, index: int, x: float, y: float, width: float
) -> list[str]:
    span = timeline.spans[index]
    style = content.style(span.kind)
    out = [
        '<g class="span">',
        f"<title>{escape(content.hover(timeline, span))}</title>",
        f'<rect x="{x:.2f}" y="{y:.1f}" width="{max(width, 0.5):.2f}" height="{_BOX}" '
        f"{_fill(style)}/>",
    ]
    placed = content.fit_label(content.label(span), width, _BOX, _LABEL_FONT)
    if placed is not None:
        centre_x, centre_y = x + width / 2, y + _BOX / 2
        rotate = f"rotate(-90 {centre_x:.1f} {centre_y:.1f})" if placed.vertical else ""
        out.append(_text(centre_x, centre_y, placed.text, _LABEL_FONT, text_anchor="middle",
                         dominant_baseline="central", fill=style.text_colour,
                         transform=rotate))  # fmt: skip
    out.append("</g>")
    return out


def to_svg(timeline: content.PictureTimeline, path: str | Path) -> None:
    """Writes `timeline` as an SVG picture at `path` (see Timeline.to_svg)."""
    rows = timeline.rows
    names = [timeline.row_name(worker) for worker in range(rows)]
    left = 16 + max(map(len, names)) * content.MONOSPACE_EM * _FONT
    right = _WIDTH - 20
    end = max((s.end_s for s in timeline.spans), default=0.0)
    per_second = (right - left) / end if end > 0 else 0.0
    bottom = _TOP + rows * _ROW
    out = _defs()
    out.append(_text(_WIDTH / 2, 24, content.title(timeline), 14, text_anchor="middle",
                     font_weight="bold"))  # fmt: skip
    for tick in _ticks(end * 1e3):
        x = left + tick / 1e3 * per_second
        out.append(f'<line x1="{x:.1f}" y1="{_TOP - 4}" x2="{x:.1f}" y2="{bottom + 4}" '
                   'stroke="#dddddd"/>')  # fmt: skip
        out.append(_text(x, bottom + 20, f"{tick:g}", _FONT, text_anchor="middle"))
    out.append(_text((left + right) / 2, bottom + 40, content.AXIS_LABEL, _FONT,
                     text_anchor="middle"))  # fmt: skip
    for worker, name in enumerate(names):
        y = _TOP + worker * _ROW + (_ROW - _BOX) / 2
        out.append(_text(left - 8, y + _BOX / 2, name, _FONT, text_anchor="end",
                         dominant_baseline="central"))  # fmt: skip
        out.append(f'<rect x="{left:.1f}" y="{y:.1f}" width="{right - left:.1f}" '
                   f'height="{_BOX}" fill="{content.IDLE_FILL}"/>')  # fmt: skip
    if timeline.gap_s > 0:
        gap_x = left + timeline.phase_window("forward")[1] * per_second
        out.append(f'<rect x="{gap_x:.1f}" y="{_TOP}" width="{timeline.gap_s * per_second:.1f}" '
                   f'height="{rows * _ROW}" {_fill(None)}/>')  # fmt: skip
    for index, span in enumerate(timeline.spans):
        y = _TOP + span.row * _ROW + (_ROW - _BOX) / 2
        out += _span(timeline, index, left + span.start_s * per_second, y,
                     span.duration_s * per_second)  # fmt: skip
    legend, legend_height = _legend(timeline, bottom + 56, left)
    out += legend
    height = bottom + 56 + legend_height + 10
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height:.0f}" '
        f'viewBox="0 0 {_WIDTH} {height:.0f}">'
        f'<rect width="100%" height="100%" fill="#ffffff"/>'
    )
    Path(path).write_text("\n".join([head, *out, "</svg>"]) + "\n")
