"""Timeline.to_chrome_trace: the timeline as Chrome trace JSON (chrome://tracing, Perfetto)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpipe_fast.pictures import content


def to_chrome_trace(timeline: content.PictureTimeline, path: str | Path) -> None:
    """Writes `timeline` at `path`: one track per worker, one complete ("X") event per span,
    times in microseconds."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "gpipe_fast step"}}
    ]
    for worker in range(timeline.rows):
        track = {"ph": "M", "pid": 0, "tid": worker}
        events.append({**track, "name": "thread_name", "args": {"name": timeline.row_name(worker)}})
        events.append({**track, "name": "thread_sort_index", "args": {"sort_index": worker}})
    for span in timeline.spans:
        events.append(
            {
                "name": content.label(span),
                "cat": span.kind,
                "ph": "X",
                "pid": 0,
                "tid": span.row,
                "ts": round(span.start_s * 1e6, 3),
                "dur": round(span.duration_s * 1e6, 3),
                "args": {
                    "cell": span.cell,
                    "microbatch": span.microbatch,
                    "kind": span.kind,
                    "phase": span.phase,
                    "task": span.task,
                    "description": content.hover(timeline, span),
                    **({"clock": timeline.clocks[span.row]} if timeline.clocks else {}),
                },
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    Path(path).write_text(json.dumps(trace, indent=None) + "\n")
