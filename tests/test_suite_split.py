"""The fast suite and the full one: `pytest` leaves out the tests marked slow, `pytest --full`
and GPIPE_FAST_FULL_TESTS=1 keep them, and CI (.ci/run) sets that variable for the README's
`pytest` line, which it replays as it is."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest
import slow_cases
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
    """What the hooks read of a collected test: its file, name, case and markers."""

    path = Path("tests/test_probe.py")

    def __init__(self, name: str, slow: bool = False, **case: object) -> None:
        self.name = self.originalname = name
        self.markers = {"slow"} if slow else set()
        if case:
            self.callspec = SimpleNamespace(params=case)

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.markers.add(marker.name)

    def get_closest_marker(self, name: str) -> object:
        return object() if name in self.markers else None


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
    fast, slow = _Item("test_fast"), _Item("test_marked", slow=True)
    items = [fast, slow]
    conftest.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert items == ([fast, slow] if slow_kept else [fast])
    assert config.deselected == ([] if slow_kept else [slow])
    header = conftest.pytest_report_header(config)  # type: ignore[arg-type]
    assert ("the full suite" in header) == (slow_kept and not markexpr), header


def test_the_list_of_slow_cases_marks_tests_and_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FULL_ENV, raising=False)
    listed = {"test_probe.py::test_listed": True, "test_probe.py::test_swept": lambda case:
              case["mode"] != "plain"}  # fmt: skip
    monkeypatch.setattr(slow_cases, "SLOW", listed)
    kept = [_Item("test_other"), _Item("test_swept", mode="plain")]
    items = [kept[0], _Item("test_listed"), kept[1], _Item("test_swept", mode="other")]
    config = _Config(full=False)
    conftest.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert items == kept
    assert [item.name for item in config.deselected] == ["test_listed", "test_swept"]
    monkeypatch.setattr(slow_cases, "SLOW", {"test_probe.py": True})  # a whole module
    assert slow_cases.is_slow(_Item("test_any"))  # type: ignore[arg-type]


def test_every_slow_case_names_a_test_there_is() -> None:
    for key in slow_cases.SLOW:
        module, _, name = key.partition("::")
        path = ROOT / "tests" / module
        assert path.is_file(), f"slow_cases.SLOW names a missing module: {key}"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert not name or name in functions, f"slow_cases.SLOW names a missing test: {key}"


# pytest itself, started as a user starts it (seconds each): the hooks and the --full option
# are wired. What the other settings select (GPIPE_FAST_FULL_TESTS=0, `-m slow`) is the hooks'
# logic, tested in this process above.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "variable", "slow_kept"),
    [((), None, False), (("--full",), None, True), ((), "1", True)],
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
    assert any("vocabulary" in t for t in tests), tests  # the fast ones stay


def test_ci_runs_the_full_suite() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    export = re.search(rf"^export {FULL_ENV}=1$", ci, flags=re.MULTILINE)
    tests = ci.index('step "${install_and_test}"')
    assert export is not None and export.start() < tests, f".ci/run must export {FULL_ENV}=1"
