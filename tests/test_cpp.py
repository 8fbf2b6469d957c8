"""Builds the host-only C++ core with its unit tests (CMake + Ninja) and runs them via ctest."""

from __future__ import annotations

import os
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


def _configure(build: Path, *flags: str) -> str:
    """Configures the host-only core with its unit tests in `build`; returns cmake's path."""
    cmake = _tool("cmake")
    ninja = _tool("ninja")
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
            *flags,
        ],
        timeout=300,
    )
    assert configure.returncode == 0, (
        f"cmake configure failed:\n{configure.stdout}\n{configure.stderr}"
    )
    return cmake


def _build(cmake: str, build: Path) -> None:
    compiled = _run([cmake, "--build", str(build)], timeout=900)
    assert compiled.returncode == 0, f"cmake build failed:\n{compiled.stdout}\n{compiled.stderr}"


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("cpp-build")
    _build(_configure(build), build)
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


# What AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer print when they fire.
SANITIZER_REPORT = re.compile(
    r"ERROR: (Address|Leak)Sanitizer|runtime error:|SUMMARY: \w+Sanitizer"
)


def _sanitizers_link(build: Path) -> bool:
    """Whether the compiler CMake picked can build and run an ASan+UBSan program."""
    cache = (build / "CMakeCache.txt").read_text()
    compiler = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.+)$", cache, re.MULTILINE)
    if compiler is None:
        return False
    source, binary = build / "probe.cpp", build / "probe"
    source.write_text("int main() { return 0; }\n")
    probe = _run(
        [compiler.group(1), "-fsanitize=address,undefined", str(source), "-o", str(binary)],
        timeout=120,
    )
    return probe.returncode == 0 and _run([str(binary)], timeout=60).returncode == 0


def test_cpp_unit_tests_pass_under_asan_and_ubsan(tmp_path: Path) -> None:
    # The executor's threads, the schedule and the partitioner under AddressSanitizer (with
    # its leak checker) and UndefinedBehaviorSanitizer: any report fails the test.
    build = tmp_path / "cpp-sanitize"
    cmake = _configure(build, "-DGPIPE_FAST_SANITIZE=ON", "-DCMAKE_BUILD_TYPE=Debug")
    if not _sanitizers_link(build):
        pytest.skip("the C++ compiler cannot build with -fsanitize=address,undefined")
    _build(cmake, build)
    env = {
        **os.environ,
        "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:halt_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }
    result = subprocess.run(
        [str(build / TEST_BINARY)],
        cwd=build,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"C++ unit tests failed under sanitizers:\n{output}"
    assert SANITIZER_REPORT.search(output) is None, output
    summary = SUMMARY.search(output)
    assert summary is not None, f"no 'N passed, M failed' line in:\n{output}"
    assert int(summary.group(2)) == 0 and int(summary.group(1)) > 0, output
