"""Builds the host-only C++ core with its unit tests (CMake + Ninja) and runs them via ctest."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_BINARY = "gpipe_fast_cpp_tests"
SUMMARY = re.compile(r"^(?:\d+: )?(\d+) passed, (\d+) failed$", re.MULTILINE)


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found on PATH (needed to build the C++ unit tests)")
    return path


def _run(command: list[str], timeout: float, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cmake = _tool("cmake")
    ninja = _tool("ninja")
    build = tmp_path_factory.mktemp("cpp-build")
    configure = _run(
        [
            cmake,
            "-S",
            str(REPO),
            "-B",
            str(build),
            "-G",
            "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja}",
            "-DGPIPE_FAST_TESTS=ON",
            "-DGPIPE_FAST_PYTHON=OFF",
            "-DGPIPE_FAST_CUDA=OFF",
        ],
        timeout=300,
    )
    assert configure.returncode == 0, (
        f"cmake configure failed:\n{configure.stdout}\n{configure.stderr}"
    )
    compiled = _run([cmake, "--build", str(build)], timeout=900)
    assert compiled.returncode == 0, f"cmake build failed:\n{compiled.stdout}\n{compiled.stderr}"
    return build


def test_cpp_unit_tests_pass(build_dir: Path) -> None:
    ctest = shutil.which("ctest")
    if ctest is not None:
        # -V shows the test binary's own output (its "N passed, M failed" line) on success too.
        result = _run(
            [ctest, "--output-on-failure", "-V", "--timeout", "120"],
            timeout=180,
            cwd=build_dir,
        )
    else:
        result = _run([str(build_dir / TEST_BINARY)], timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"C++ unit tests failed:\n{output}"
    assert " 0 failed" in output, output
    summary = SUMMARY.search(output)
    assert summary is not None, f"no 'N passed, M failed' line in:\n{output}"
    passed, failed = int(summary.group(1)), int(summary.group(2))
    assert failed == 0
    assert passed > 0
