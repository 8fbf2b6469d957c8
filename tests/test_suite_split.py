"""The fast suite and the full one: `pytest` leaves out the tests marked slow, `pytest --full`
and GPIPE_FAST_FULL_TESTS=1 keep them, and CI (.ci/run) sets that variable for the README's
`pytest` line, which it replays as it is."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
from conftest import FULL_ENV

ROOT = Path(__file__).resolve().parent.parent
# One slow test and one fast one.
PROBE = "tests/test_readme_figures.py"


def _collected(*flags: str, env: dict[str, str]) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         PROBE, *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if "::" in line]


class _Config:
    """What the conftest's hooks read of pytest's config: the options, the hook to report."""

    def __init__(self, full: bool, markexpr: str = "") -> None:
        self.options = {"--full": full, "markexpr": markexpr}
        self.deselected: list[object] = []
        self.hook = self

    def getoption(self, name: str) -> object:
        return self.options[name]

    def pytest_deselected(self, items: list[object]) -> None:
        self.deselected += items


class _Item:
    def __init__(self, slow: bool) -> None:
        self.slow = slow

    def get_closest_marker(self, name: str) -> object:
        return object() if name == "slow" and self.slow else None


@pytest.mark.parametrize(
    ("full", "variable", "markexpr", "slow_kept"),
    [(False, None, "", False), (True, None, "", True), (False, "1", "", True),
     (False, "0", "", False), (False, None, "slow", True)],
)  # fmt: skip
def test_the_fast_suite_deselects_the_slow_tests(
    monkeypatch: pytest.MonkeyPatch, full: bool, variable: str | None, markexpr: str,
    slow_kept: bool,
) -> None:  # fmt: skip
    monkeypatch.delenv(FULL_ENV, raising=False)
    if variable is not None:
        monkeypatch.setenv(FULL_ENV, variable)
    config = _Config(full, markexpr)
    fast, slow = _Item(slow=False), _Item(slow=True)
    items = [fast, slow]
    conftest.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert items == ([fast, slow] if slow_kept else [fast])
    assert config.deselected == ([] if slow_kept else [slow])
    header = conftest.pytest_report_header(config)  # type: ignore[arg-type]
    assert ("the full suite" in header) == (slow_kept and not markexpr), header


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "variable", "slow_kept"),
    [((), None, False), (("--full",), None, True), ((), "1", True), ((), "0", False),
     (("-m", "slow"), None, True)],
)  # fmt: skip
def test_pytest_itself_leaves_out_the_slow_tests_of_the_fast_suite(
    flags: tuple[str, ...], variable: str | None, slow_kept: bool
) -> None:
    env = {k: v for k, v in os.environ.items() if k != FULL_ENV}
    if variable is not None:
        env[FULL_ENV] = variable
    tests = _collected(*flags, env=env)
    slow = [t for t in tests if "reports_every_figure" in t]
    assert bool(slow) == slow_kept, tests
    if flags != ("-m", "slow"):
        assert any("vocabulary" in t for t in tests), tests


def test_ci_runs_the_full_suite() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    export = re.search(rf"^export {FULL_ENV}=1$", ci, flags=re.MULTILINE)
    tests = ci.index('step "${install_and_test}"')
    assert export is not None and export.start() < tests, f".ci/run must export {FULL_ENV}=1"
