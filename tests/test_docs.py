"""The README and the user guide (docs/) say what the code does: the README keeps the two
Quickstart lines that CI (.ci/run) replays, its training example runs and trains, every
Python block of the guide runs as written (a page's blocks in order, as one session; a
torchrun script under torchrun) unless marked a fragment, its links into the guide resolve,
and neither cites files a user does not have."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import gpipe_fast as gf

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# The exact lines .ci/run greps out of README.md (its two regular expressions).
CI_LINES = (
    r"^pip install \. && python -m gpipe_fast demo$",
    r'^pip install "\.\[test\]" && pytest$',
)
# The line before a block that is shown but not run (an HTML comment: mkdocs drops it).
FRAGMENT = re.compile(r"^<!-- fragment: .+ -->$")
# A block whose first line says how to launch it is a script for torchrun.
TORCHRUN = re.compile(r"^# torchrun --nproc-per-node (\d+) ")


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


def _blocks(path: Path) -> list[Block]:
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


def _guide_python_blocks() -> list[Block]:
    pages = sorted(DOCS.glob("*.md"))
    return [b for page in pages for b in _blocks(page) if b.language == "python"]


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("pattern", CI_LINES)
def test_readme_keeps_the_quickstart_lines_ci_replays(pattern: str) -> None:
    lines = re.findall(pattern, _readme(), flags=re.MULTILINE)
    assert len(lines) == 1, f"README.md must hold exactly one line matching {pattern!r}"
    # Each in a bash block of its own, as a newcomer copies it.
    assert f"```bash\n{lines[0]}\n```" in _readme()


def test_readme_training_example_trains() -> None:
    (example,) = _python_blocks(_readme())
    assert "train_step" in example and "loss.backward()" in example
    torch.manual_seed(0)
    names: dict[str, object] = {}
    exec(compile(example, "README.md", "exec"), names)
    pipe, model = names["pipe"], names["model"]
    assert [len(cell) for cell in pipe.partitions] == [4, 4]
    # The example ends with a pipe(x) + backward step: every parameter got a gradient.
    assert all(p.grad is not None for p in model.parameters())
    assert torch.isfinite(names["loss"])


GUIDE_PAGES = sorted({b.page for b in _guide_python_blocks() if not (b.fragment or b.processes)})


@pytest.mark.parametrize("page", GUIDE_PAGES)
def test_guide_page_code_runs_as_written(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's Python blocks, in order, in one namespace, as a reader runs them one after
    another; the files they write land in a scratch folder."""
    blocks = [b for b in _blocks(ROOT / page) if b.language == "python"]
    runs = [b for b in blocks if not b.fragment and not b.processes]
    if any(".plot(" in b.code for b in runs):
        pytest.importorskip("matplotlib")  # the `plot` extra: pictures of timelines
    monkeypatch.chdir(tmp_path)
    names: dict[str, object] = {"__name__": "__main__"}
    try:
        for block in runs:
            exec(compile(block.code, block.name, "exec"), names)
    finally:
        for value in names.values():
            if isinstance(value, gf.GPipe):
                value.close()


TORCHRUN_BLOCKS = [b for b in _guide_python_blocks() if b.processes and not b.fragment]


@pytest.mark.slow
@pytest.mark.parametrize("block", TORCHRUN_BLOCKS, ids=lambda b: b.name)
def test_guide_torchrun_scripts_run(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(block.code, encoding="utf-8")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={block.processes}", str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_every_guide_block_is_run_or_a_marked_fragment() -> None:
    """What test_guide_page_code_runs_as_written and the torchrun test pick up is every
    Python block there is (the README's is run by its own test above); a fragment says why
    it is one, and a marker never stands before a block it would not apply to."""
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        markers = len(re.findall(r"^<!-- fragment", text, flags=re.MULTILINE))
        marked = [b for b in _blocks(path) if b.fragment]
        assert markers == len(marked), f"{path.name}: a fragment marker not right before a block"
        assert all(b.language == "python" for b in marked), f"{path.name}: mark Python only"
    assert GUIDE_PAGES and TORCHRUN_BLOCKS


def test_readme_links_into_the_guide_resolve() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _readme())
    local = [link for link in links if "://" not in link]
    assert local, "the README links into the guide"
    for link in local:
        assert (ROOT / link).is_file(), f"README.md links to a missing file: {link}"


def test_every_guide_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in sorted(DOCS.glob("*.md")):
        assert f": {page.name}\n" in nav, f"docs/{page.name} is not in mkdocs.yml's nav"


def test_api_reference_covers_every_public_name() -> None:
    import gpipe_fast

    reference = (DOCS / "reference.md").read_text(encoding="utf-8")
    missing = [name for name in gpipe_fast.__all__ if f"::: gpipe_fast.{name}\n" not in reference]
    assert not missing, f"docs/reference.md lacks {missing}"


# Spelled in two parts, so that this file is not itself a citation of them.
@pytest.mark.parametrize("cited", ["DESIGN" + ".md", ".." + "/shared"])
def test_nothing_cites_files_users_do_not_have(cited: str) -> None:
    files = [README, *DOCS.glob("*.md"), *(ROOT / "gpipe_fast").rglob("*.py")]
    offending = [str(f.relative_to(ROOT)) for f in files if cited in f.read_text("utf-8")]
    assert not offending, f"{cited} is cited in {offending}"
