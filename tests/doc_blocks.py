"""The fenced code blocks of the README and the guide (docs/*.md), and how a test runs a
page's Python blocks: in order, in one namespace, as a reader runs them one after another.

A block shown but not run is marked by the line before it, `<!-- fragment: why -->` (an
HTML comment: mkdocs drops it). A block whose first line is `# torchrun --nproc-per-node N
...` is a script that torchrun runs on N processes. A page whose blocks a test of its own
runs (checking more than that they run) is listed in RUN_BY_OWN_TEST, so that tests/
test_docs.py leaves it to that test: every page's code runs once, by one mechanism."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import gpipe_fast as gf

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FRAGMENT = re.compile(r"^<!-- fragment: .+ -->$")
TORCHRUN = re.compile(r"^# torchrun --nproc-per-node (\d+) ")
# page -> the test that runs its blocks through run_page and checks what they made.
RUN_BY_OWN_TEST = {"docs/any_model.md": "test_any_model.py::test_the_guide_page_example_runs"}


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page: where it starts, its language and code."""

    page: str
    line: int
    language: str
    code: str
    fragment: bool

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def processes(self) -> int:
        """How many processes torchrun runs it with (0: it runs in this process)."""
        launch = TORCHRUN.match(self.code)
        return int(launch.group(1)) if launch else 0

    @property
    def runs_here(self) -> bool:
        """Whether run_page runs it: a Python block, not a fragment, not a torchrun script."""
        return self.language == "python" and not self.fragment and not self.processes


def blocks(path: Path) -> list[Block]:
    """Every fenced block of the page at `path`, indented ones (in a list item) included."""
    text = path.read_text(encoding="utf-8")
    found = []
    pattern = r"^( *)```(\w*)[^\n]*\n(.*?)^\1```"
    for match in re.finditer(pattern, text, flags=re.MULTILINE | re.DOTALL):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        indent = len(match.group(1))
        code = "".join(line[indent:] + "\n" for line in match.group(3).splitlines())
        found.append(
            Block(
                page=str(path.relative_to(ROOT)),
                line=text.count("\n", 0, match.start()) + 1,
                language=match.group(2),
                code=code,
                fragment=bool(FRAGMENT.match(before.strip())),
            )
        )
    return found


def guide_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def run_page(page: str) -> dict[str, object]:
    """Runs the page's blocks that run here, in order, in one namespace, and returns it;
    every pipe they built is closed (its attributes stay readable)."""
    names: dict[str, object] = {"__name__": "__main__"}
    try:
        for block in blocks(ROOT / page):
            if block.runs_here:
                exec(compile(block.code, block.name, "exec"), names)
    finally:
        for value in names.values():
            if isinstance(value, gf.GPipe):
                value.close()
    return names
