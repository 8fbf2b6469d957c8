"""Builds the host-only C++ core with its unit tests (CMake + Ninja) and runs them, plainly and
under the sanitizers. A build is cached by the digest of what it is built from (the C++
sources, CMakeLists.txt, the flags and the compiler's version) in ~/.cache/gpipe_fast/cpp-tests
(or $XDG_CACHE_HOME's): a fresh clone of unchanged sources runs the cached binary instead of
compiling the core twice (a minute of CI)."""

from __future__ import annotations

import hashlib
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


def _digest(*flags: str) -> str:
    """What a build's binary depends on: every file it is built from, the flags, the tools."""
    digest = hashlib.sha256()
    sources = [
        REPO / "CMakeLists.txt",
        *(REPO / "csrc").rglob("*"),
        *(REPO / "tests/cpp").rglob("*"),
    ]
    for path in sorted(p for p in sources if p.is_file()):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    compiler = os.environ.get("CXX") or shutil.which("c++") or "c++"
    for tool in (_tool("cmake"), compiler):
        digest.update(_run([tool, "--version"], timeout=60).stdout.encode())
    digest.update("\0".join(flags).encode())
    return digest.hexdigest()[:24]


def _cached_binary(scratch: Path, *flags: str) -> Path:
    """The unit tests' binary built with `flags`: from the cache, or built in `scratch` and
    cached (skips when a sanitizer build's compiler cannot link the sanitizers)."""
    cache = (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpipe_fast/cpp-tests"
    )
    binary = cache / _digest(*flags) / TEST_BINARY
    if binary.is_file():
        return binary
    cmake = _configure(scratch, *flags)
    if "-DGPIPE_FAST_SANITIZE=ON" in flags and not _sanitizers_link(scratch):
        pytest.skip("the C++ compiler cannot build with -fsanitize=address,undefined")
    _build(cmake, scratch)
    # Copied under a name of its own and renamed: a concurrent run never sees half a binary.
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{TEST_BINARY}.{os.getpid()}")
    shutil.copy2(scratch / TEST_BINARY, partial)
    partial.replace(binary)
    return binary


def test_cpp_unit_tests_pass(tmp_path: Path) -> None:
    binary = _cached_binary(tmp_path / "cpp-build")
    result = _run([str(binary)], timeout=180, cwd=tmp_path)
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
    binary = _cached_binary(
        tmp_path / "cpp-sanitize", "-DGPIPE_FAST_SANITIZE=ON", "-DCMAKE_BUILD_TYPE=Debug"
    )
    env = {
        **os.environ,
        "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:halt_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        # A quarter of the long sweeps' cases: instrumented, they took 21 of the run's 29 s,
        # and the plain run above covers every case.
        "GPIPE_FAST_CPP_SWEEP_STRIDE": "4",
    }
    result = subprocess.run(
        [str(binary)],
        cwd=tmp_path,
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
