"""The bar a tuning draws on stderr while it prices and measures its candidates."""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 24


class Progress:
    """A one-line bar: redrawn in place on a terminal, a line per update elsewhere (a log)."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()
        self.inline = self.enabled and self.stream.isatty()

    def show(self, done: int, what: str) -> None:
        if not self.enabled:
            return
        self.total = max(self.total, done)  # more ran than planned (small steps: see tune)
        filled = WIDTH * done // self.total
        bar = "#" * filled + "." * (WIDTH - filled)
        seconds = time.perf_counter() - self.started
        line = f"gpipe_fast tuning [{bar}] {done}/{self.total} {seconds:5.1f} s  {what}"
        if self.inline:
            self.stream.write("\r" + line + "\033[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self, what: str) -> None:
        """The last line: what was chosen."""
        if not self.enabled:
            return
        self.show(self.total, what)
        if self.inline:
            self.stream.write("\n")
            self.stream.flush()
