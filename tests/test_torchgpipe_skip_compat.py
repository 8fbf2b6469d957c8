"""torchgpipe 0.0.7's own tests/skip/ run against gpipe_fast.skip, imports rewritten.

Set TORCHGPIPE_SRC to a torchgpipe 0.0.7 checkout (the folder holding ``tests/skip/``),
e.g. ``git -C <torchgpipe.git> archive v0.0.7 | tar -x -C /tmp/torchgpipe-src``; without
it this file is skipped (no network in CI, and this project commits no other project's
code). The files are copied into pytest's tmp_path with ``torchgpipe.skip`` imports
pointed at ``gpipe_fast.skip`` and ``from torchgpipe import GPipe, is_checkpointing,
is_recomputing`` at gpipe_fast's, then run by pytest in a subprocess. Every test must
pass except those listed below, each with its reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

import pytest

import gpipe_fast

SRC = os.environ.get("TORCHGPIPE_SRC")
pytestmark = pytest.mark.skipif(not SRC, reason="TORCHGPIPE_SRC is not set")

PASS, OUT = "pass", "out of scope"


class Expect(NamedTuple):
    kind: str  # PASS, or OUT (tests torchgpipe's internals)
    reason: str = ""


# Each torchgpipe test, by file and function (all its parametrizations alike).
EXPECTED: dict[str, Expect] = {
    "test_api.py::test_namespace_difference": Expect(PASS),
    "test_api.py::test_namespace_copy": Expect(PASS),
    "test_api.py::test_skippable_repr": Expect(PASS),
    "test_stash_pop.py::test_stash": Expect(PASS),
    "test_stash_pop.py::test_pop": Expect(PASS),
    "test_stash_pop.py::test_declare_but_not_use": Expect(PASS),
    "test_stash_pop.py::test_stash_not_declared": Expect(PASS),
    "test_stash_pop.py::test_pop_not_declared": Expect(PASS),
    "test_stash_pop.py::test_pop_not_stashed": Expect(PASS),
    "test_stash_pop.py::test_stash_none": Expect(PASS),
    "test_verify_skippables.py::test_matching": Expect(PASS),
    "test_verify_skippables.py::test_stash_not_pop": Expect(PASS),
    "test_verify_skippables.py::test_pop_unknown": Expect(PASS),
    "test_verify_skippables.py::test_stash_again": Expect(PASS),
    "test_verify_skippables.py::test_pop_again": Expect(PASS),
    "test_verify_skippables.py::test_stash_pop_together_different_names": Expect(PASS),
    "test_verify_skippables.py::test_stash_pop_together_same_name": Expect(PASS),
    "test_verify_skippables.py::test_double_stash_pop": Expect(PASS),
    "test_verify_skippables.py::test_double_stash_pop_but_isolated": Expect(PASS),
    "test_inspect_skip_layout.py::test_no_skippables": Expect(PASS),
    "test_inspect_skip_layout.py::test_inner_partition": Expect(PASS),
    "test_inspect_skip_layout.py::test_adjoining_partitions": Expect(PASS),
    "test_inspect_skip_layout.py::test_far_partitions": Expect(PASS),
    "test_inspect_skip_layout.py::test_pop_2_from_different_partitions": Expect(PASS),
    "test_inspect_skip_layout.py::test_namespace": Expect(PASS),
    # Cells on CUDA devices (skipped where there are fewer than its balance needs).
    "test_gpipe.py::test_1to3": Expect(PASS),
    "test_gpipe.py::test_none_skip": Expect(PASS),
    "test_leak.py::test_delete_portal_tensor": Expect(
        OUT,
        "reads torchgpipe's portals (tracker.portals, portal.tensor_life), its autograd "
        "plumbing for skips between cells, which gpipe_fast has no counterpart of",
    ),
    "test_leak.py::test_no_portal_without_gpipe": Expect(
        OUT,
        "monkeypatches torchgpipe.skip.portal.Portal.__init__; gpipe_fast has no portals "
        "(without a pipe, skips are plain tensors: tests/test_skip_skippable.py)",
    ),
}

# Files that cannot be imported against gpipe_fast: all their tests are out of scope.
OUT_FILES: dict[str, str] = {
    "test_portal.py": "tests torchgpipe.skip.portal, torchgpipe.dependency and "
    "torchgpipe.stream, torchgpipe's internals (no counterpart)",
    "test_tracker.py": "imports torchgpipe.checkpoint and torchgpipe.microbatch and tests "
    "SkipTrackerThroughPotals (portal trackers' internals); its one API check, the "
    "default tracker per thread, is tests/test_skip_tracker.py::test_default_tracker_per_thread",
}

# test_gpipe.py imports torchgpipe's portal classes only to assert that no autograd node
# of the output is a portal's. gpipe_fast has no portals, so that holds by construction:
# the import becomes classes whose backward nodes nothing is an instance of.
PORTAL_SHIM = """\
class _NoPortal:
    class _backward_cls:  # no autograd node is an instance of it
        pass


PortalBlue = PortalCopy = PortalOrange = _NoPortal
"""

# The one-device parametrization of test_1to3 keeps the skip inside one cell.


def _rewrite(name: str, text: str) -> str:
    text = re.sub(r"^from torchgpipe\.skip", "from gpipe_fast.skip", text, flags=re.M)
    text = re.sub(r"^import torchgpipe\.skip", "import gpipe_fast.skip", text, flags=re.M)
    text = re.sub(
        r"^from torchgpipe import ((?:GPipe|is_checkpointing|is_recomputing)(?:, )?)+$",
        lambda m: m.group(0).replace("torchgpipe", "gpipe_fast"),
        text,
        flags=re.M,
    )
    if name == "test_gpipe.py":
        text = text.replace(
            "from gpipe_fast.skip.portal import PortalBlue, PortalCopy, PortalOrange\n",
            PORTAL_SHIM,
        )
    return text


class Results(NamedTuple):
    outcomes: dict[str, tuple[str, str]]  # test id -> (outcome, message)
    broken_files: dict[str, str]  # files that failed to import -> message
    log: str


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    assert SRC is not None
    source = Path(SRC) / "tests"
    files = sorted((source / "skip").glob("test_*.py"))
    assert files, f"no tests/skip/test_*.py under {SRC}"
    work = tmp_path_factory.mktemp("torchgpipe_skip")
    (work / "pytest.ini").write_text("[pytest]\n")
    (work / "conftest.py").write_text((source / "conftest.py").read_text())  # seeds 0
    for path in files:
        (work / path.name).write_text(_rewrite(path.name, path.read_text()))
    root = Path(gpipe_fast.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(work)])}
    junit = work / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(work), "-p", "no:cacheprovider", "-q",
         "--continue-on-collection-errors", f"--junitxml={junit}",
         "-o", "junit_family=xunit1", "--rootdir", str(work)],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    outcomes: dict[str, tuple[str, str]] = {}
    broken: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        child = next(iter(case), None)
        outcome, message = "passed", ""
        if child is not None and child.tag in ("failure", "error", "skipped"):
            outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
            message = (child.get("message") or "").strip().split("\n")[0]
        if not classname:  # a file that failed to import: "name" is the module
            errors = re.findall(
                r"^E\s+(\S.*)$", (child.text or "") if child is not None else "", re.M
            )
            broken[f"{name}.py"] = errors[-1] if errors else message
            continue
        outcomes[f"{classname}.py::{name}"] = (outcome, message)
    return Results(outcomes, broken, proc.stdout + proc.stderr)


def _function(test_id: str) -> str:
    return test_id.split("[", 1)[0]


def test_every_torchgpipe_test_is_accounted_for(results: Results) -> None:
    unknown = sorted(t for t in results.outcomes if _function(t) not in EXPECTED)
    assert unknown == [], "new tests: list them in EXPECTED"
    ran = {_function(t) for t in results.outcomes}
    missing = sorted(f for f in EXPECTED if f not in ran)
    assert missing == [], f"expected tests did not run:\n{results.log[-3000:]}"
    assert sorted(results.broken_files) == sorted(OUT_FILES), results.log[-3000:]


@pytest.mark.parametrize("function", sorted(f for f, e in EXPECTED.items() if e.kind == PASS))
def test_passes(results: Results, function: str) -> None:
    ids = [t for t in results.outcomes if _function(t) == function]
    assert ids
    ran = [t for t in ids if results.outcomes[t][0] != "skipped"]  # test_1to3 needs CUDA
    if not ran:
        pytest.skip(f"every case of {function} was skipped here (needs CUDA devices)")
    for test_id in ran:
        outcome, message = results.outcomes[test_id]
        assert outcome == "passed", f"{test_id}: {outcome}: {message}"


@pytest.mark.parametrize("function", sorted(f for f, e in EXPECTED.items() if e.kind == OUT))
def test_out_of_scope_still_fails(results: Results, function: str) -> None:
    # An out-of-scope test that passes here is in scope after all: list it as PASS.
    outcomes = {t: results.outcomes[t] for t in results.outcomes if _function(t) == function}
    assert outcomes, f"{function} did not run"
    passed = sorted(t for t, (outcome, _) in outcomes.items() if outcome == "passed")
    assert not passed, f"{passed} pass now (listed out of scope: {EXPECTED[function].reason})"


@pytest.mark.parametrize("name", sorted(OUT_FILES))
def test_out_of_scope_files_still_fail_to_import(results: Results, name: str) -> None:
    assert name in results.broken_files, f"{name} imports now (listed: {OUT_FILES[name]})"
