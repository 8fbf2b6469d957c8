"""planning/progress.py: the tuning's bar, in place on a terminal, a line per update in a log."""

from __future__ import annotations

import io

from gpipe_fast.planning.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_per_update() -> None:
    out = io.StringIO()
    bar = Progress(4, True, out)
    bar.show(1, "running a")
    bar.close("chose a")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("gpipe_fast tuning [######..................] 1/4")
    assert lines[0].endswith("running a")
    assert "[########################] 4/4" in lines[1] and lines[1].endswith("chose a")


def test_a_terminal_redraws_one_line() -> None:
    out = Terminal()
    bar = Progress(2, True, out)
    bar.show(1, "one")
    bar.close("done")
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1


def test_disabled_writes_nothing() -> None:
    out = io.StringIO()
    bar = Progress(2, False, out)
    bar.show(1, "one")
    bar.close("done")
    assert out.getvalue() == ""
