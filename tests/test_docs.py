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
from pathlib import Path

import pytest
import torch
from doc_blocks import DOCS, README, ROOT, RUN_BY_OWN_TEST, Block, blocks, guide_pages, run_page

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


GUIDE_PAGES = sorted(
    {b.page for page in guide_pages() for b in blocks(page) if b.runs_here} - set(RUN_BY_OWN_TEST)
)


@pytest.mark.parametrize("page", GUIDE_PAGES)
def test_guide_page_code_runs_as_written(page: str, tmp_path: Path, monkeypatch) -> None:
    """The page's Python blocks, in order, in one namespace (doc_blocks.run_page); the files
    they write land in a scratch folder."""
    if any(".plot(" in b.code for b in blocks(ROOT / page) if b.runs_here):
        pytest.importorskip("matplotlib")  # the `plot` extra: pictures of timelines
    monkeypatch.chdir(tmp_path)
    run_page(page)


TORCHRUN_BLOCKS = [
    b for page in guide_pages() for b in blocks(page) if b.processes and not b.fragment
]


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
    Python block there is (the README's is run by its own test above, any_model.md's by
    test_any_model.py through the same doc_blocks.run_page); a fragment says why it is one,
    and a marker never stands before a block it would not apply to."""
    for path in [README, *guide_pages()]:
        text = path.read_text(encoding="utf-8")
        markers = len(re.findall(r"^<!-- fragment", text, flags=re.MULTILINE))
        marked = [b for b in blocks(path) if b.fragment]
        assert markers == len(marked), f"{path.name}: a fragment marker not right before a block"
        assert all(b.language == "python" for b in marked), f"{path.name}: mark Python only"
    for page, test in RUN_BY_OWN_TEST.items():
        module, _, name = test.partition("::")
        source = (ROOT / "tests" / module).read_text(encoding="utf-8")
        assert f"def {name}(" in source and f'run_page("{page}")' in source, test
    assert GUIDE_PAGES and TORCHRUN_BLOCKS


# `python examples/x.py --flag` or `torchrun ... examples/x.py --flag` in a shell block.
EXAMPLE_COMMAND = re.compile(r"(examples/\w+\.py)((?: +--?[\w-]+(?: +[^-\s#][^\s#]*)?)*)")


def test_shell_blocks_name_examples_and_options_there_are() -> None:
    """The shell commands of the README and the guide run examples too long for the suite
    (bench/readme_figures.py runs train_lm.py and unet.py as shown): each names a script
    there is, with options its argparse declares."""
    commands = []
    for path in [README, *guide_pages()]:
        for block in blocks(path):
            if block.language == "bash":
                commands += EXAMPLE_COMMAND.findall(block.code.replace("\\\n", " "))
    assert commands, "the README shows how to run examples/train_lm.py"
    for script, arguments in commands:
        source = (ROOT / script).read_text(encoding="utf-8")
        for option in re.findall(r"(?<!\S)(--?[\w-]+)", arguments):
            assert f'"{option}"' in source, f"{script} declares no option {option}"


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
