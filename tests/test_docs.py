"""The README and the user guide (docs/) say what the code does: the README keeps the two
Quickstart lines that CI (.ci/run) replays, its training example runs and trains, its links
into the guide resolve, and neither cites files a user does not have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# The exact lines .ci/run greps out of README.md (its two regular expressions).
CI_LINES = (
    r"^pip install \. && python -m gpipe_fast demo$",
    r'^pip install "\.\[test\]" && pytest$',
)


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
