"""The timeline's picture, as PNG and as SVG: waits drawn as idle, a label on every box wide
enough for it, a hover title per box, the legend grouped as compute, communication, idle."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree

import pytest

from gpipe_fast.pictures import content as picture
from gpipe_fast.runtime.timeline import TaskSpan, Timeline

_SVG = "{http://www.w3.org/2000/svg}"


def _two_ranks() -> Timeline:
    """Rank 0 computes and sends; rank 1 waits for the activation, then computes. Times in
    ms: a wide forward (4 ms of 10), a narrow one (1 us), a wide wait, short sends."""
    ms = 1e-3
    spans = [
        TaskSpan("step", "forward", 0, 0, 0.0, 4 * ms, task=0, worker=0),
        TaskSpan("step", "send_forward", 0, 0, 4 * ms, 4.2 * ms, task=1, worker=0),
        TaskSpan("step", "forward", 0, 1, 4.2 * ms, 4.201 * ms, task=2, worker=0),
        TaskSpan("step", "recv_forward", 1, 0, 0.0, 4.3 * ms, task=3, worker=1),
        TaskSpan("step", "forward", 1, 0, 4.3 * ms, 8 * ms, task=4, worker=1),
        TaskSpan("step", "loss", 1, 0, 8 * ms, 8.5 * ms, task=5, worker=1),
        TaskSpan("step", "recv_backward", 0, 0, 4.201 * ms, 10 * ms, task=6, worker=0),
    ]
    return Timeline(cells=2, microbatches=2, spans=spans, workers=2, schedule="1f1b",
                    row_names=("rank 0 compute", "rank 1 compute"))  # fmt: skip


def test_a_label_goes_across_else_up_else_its_letters_else_nowhere() -> None:
    font = 10.0  # a character is 6 wide, a line 12 high; 4 of margin
    assert picture.fit_label("F2.5", 40, 20, font) == picture.Placed("F2.5")
    assert picture.fit_label("F2.5", 14, 40, font) == picture.Placed("F2.5", vertical=True)
    assert picture.fit_label("sF2.5", 20, 20, font) == picture.Placed("sF")
    assert picture.fit_label("F2.5", 9, 20, font) is None


def test_the_legend_groups_compute_communication_and_idle_in_distinct_colours() -> None:
    groups = picture.legend(_two_ranks())
    assert list(groups) == ["compute", "communication", "idle"]
    assert [e.text for e in groups["compute"]] == ["F  forward", "L  loss"]
    assert [e.text for e in groups["communication"]] == ["sF  send activations"]
    # The waits for data share one line: they are idle time, whatever they wait for.
    assert [e.text for e in groups["idle"]] == [
        "idle (no task)", "wait for data: rF activations, rB gradients",
    ]  # fmt: skip
    filled = [e.style for entries in groups.values() for e in entries if e.style is not None]
    colours = [s.colour for s in filled if not s.hatched]
    assert len(set(colours)) == len(colours)
    assert [s.hatched for s in filled] == [False] * 4 + [True]


def test_every_kind_of_task_has_a_colour_of_its_own() -> None:
    # A step holds either backward or its two halves (input, weight), never both.
    colours = {kind: s.colour for kind, s in picture.STYLES.items() if not s.hatched}
    assert colours.pop("backward") == colours["backward_input"]
    assert len(set(colours.values())) == len(colours)
    assert all(s.group == "idle" for k, s in picture.STYLES.items() if k.startswith("recv"))


def test_the_title_names_the_schedule_run() -> None:
    title = picture.title(_two_ranks())
    assert title.startswith("gpipe_fast step, schedule 1f1b: 2 cells on 2 workers, M=2;")
    forward = TaskSpan("forward", "forward", 0, 0, 0.0, 1.0, task=0)
    of_pipe = Timeline(cells=1, microbatches=1, spans=[forward])
    assert picture.title(of_pipe).startswith("gpipe_fast pipe(x) and backward, schedule gpipe:")


def test_the_svg_draws_waits_as_idle_labels_wide_boxes_and_titles_every_box(
    tmp_path: Path,
) -> None:
    timeline = _two_ranks()
    timeline.to_svg(tmp_path / "step.svg")
    root = ElementTree.parse(tmp_path / "step.svg").getroot()
    heading = root.find(f"{_SVG}text")
    assert heading is not None and heading.text == picture.title(timeline)
    boxes = root.findall(f"{_SVG}g")
    assert len(boxes) == len(timeline.spans)
    for box, span in zip(boxes, timeline.spans, strict=True):
        hover = box.find(f"{_SVG}title")
        assert hover is not None and hover.text == picture.hover(timeline, span)
        rect = box.find(f"{_SVG}rect")
        assert rect is not None
        waits = span.kind.startswith("recv")
        assert (rect.get("fill") == "url(#wait)") == waits
        text = box.find(f"{_SVG}text")
        label = None if text is None else text.text
        if span.duration_s >= 0.5e-3:  # 5% of the axis, ~60 px: room for its label
            assert label == timeline.label(span)
        elif span.duration_s < 0.01e-3:
            assert label is None
    legend = [t.text for t in root.iter(f"{_SVG}text")]
    assert {"compute", "communication", "idle"} <= set(legend)


def test_the_hover_title_says_what_when_and_where() -> None:
    timeline = _two_ranks()
    assert picture.hover(timeline, timeline.spans[3]) == (
        "rF1.0: wait for activations of cell 1, micro-batch 0; 4.300 ms (0.000 to 4.300 ms) "
        "on rank 1 compute"
    )


def test_the_chrome_trace_describes_each_task(tmp_path: Path) -> None:
    timeline = _two_ranks()
    timeline.to_chrome_trace(tmp_path / "step.json")
    events = json.loads((tmp_path / "step.json").read_text())["traceEvents"]
    described = [e["args"]["description"] for e in events if e["ph"] == "X"]
    assert described == [picture.hover(timeline, span) for span in timeline.spans]


def test_the_png_labels_the_boxes_wide_enough_and_hatches_the_waits(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gpipe_fast.pictures.png import draw

    timeline = _two_ranks()
    figure = draw(timeline)
    axes = figure.axes[0]
    labels = {text.get_text() for text in axes.texts}
    assert {"F0.0", "rF1.0", "F1.0", "rB0.0"} <= labels
    assert "F0.1" not in labels and "F" not in labels  # 1 us of 10 ms: too narrow
    hatched = [c for c in axes.collections if c.get_hatch()]
    assert len(hatched) == 2  # the two receives
    assert axes.get_title() == picture.title(timeline)
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert legend[0] == "compute" and "communication" in legend and "idle" in legend
    timeline.plot(tmp_path / "step.png")
    assert (tmp_path / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
