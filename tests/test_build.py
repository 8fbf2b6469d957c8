"""setup.py: a CMake cache is reused only with its configure inputs; every build places _C in
the source package."""

from __future__ import annotations

import errno
import importlib.machinery
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from build_harness import build

ROOT = Path(__file__).resolve().parent.parent
C_NAME = "_C" + importlib.machinery.EXTENSION_SUFFIXES[0]


@pytest.fixture
def tools(tmp_path: Path) -> dict[str, Path]:
    """A ninja and a pybind11 CMake folder of a (pretend) build environment."""
    env = tmp_path / "build-env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "ninja").write_text("")
    (env / "pybind11").mkdir()
    return {"ninja": env / "bin" / "ninja", "pybind11": env / "pybind11"}


def _inputs(tools: dict[str, Path], build_type: str = "Release") -> dict[str, str]:
    return build.configure_inputs(str(tools["ninja"]), str(tools["pybind11"]), build_type)


def _configured(build_dir: Path, inputs: dict[str, str]) -> Path:
    """A build folder as a successful configure leaves it, with `inputs` recorded."""
    (build_dir / "CMakeFiles" / "3.25.1").mkdir(parents=True)
    (build_dir / "CMakeCache.txt").write_text("CMAKE_MAKE_PROGRAM:FILEPATH=...\n")
    (build_dir / "build.ninja").write_text("")
    (build_dir / build.FINGERPRINT).write_text(json.dumps(inputs))
    return build_dir


def test_a_fresh_build_folder_has_no_cache_to_discard(tmp_path: Path, tools) -> None:
    assert build.stale_cache_reason(tmp_path, _inputs(tools)) is None


def test_a_cache_configured_with_the_same_inputs_is_reused(tmp_path: Path, tools) -> None:
    inputs = _inputs(tools)
    build_dir = _configured(tmp_path, inputs)
    assert build.stale_cache_reason(build_dir, inputs) is None
    assert build.discard_stale_cache(build_dir, inputs) is None
    assert (build_dir / "CMakeCache.txt").exists() and (build_dir / "CMakeFiles").exists()


def test_the_ninja_of_a_deleted_build_environment_is_never_reused(tmp_path: Path, tools) -> None:
    # The failure: pip's first isolated build env configured the cache, then was deleted.
    first = _inputs(tools)
    build_dir = _configured(tmp_path / "build", first)
    os.remove(tools["ninja"])
    second_ninja = tmp_path / "second-env" / "ninja"
    second_ninja.parent.mkdir()
    second_ninja.write_text("")
    second = {**first, "make_program": str(second_ninja)}
    assert build.stale_cache_reason(build_dir, second) == "changed: make_program"
    assert build.discard_stale_cache(build_dir, second) == "changed: make_program"
    assert not (build_dir / "CMakeCache.txt").exists()
    assert not (build_dir / "CMakeFiles").exists()
    assert (build_dir / "build.ninja").exists()  # CMake regenerates it; nothing else is touched


CONFIGURE_INPUTS = ("source_dir", "generator", "cmake", "make_program", "python", "pybind11_dir")
CONFIGURE_INPUTS += ("build_type", "cuda", "cmake_args", "compilers")


def test_the_fingerprint_holds_every_configure_input(tools) -> None:
    assert sorted(_inputs(tools)) == sorted(CONFIGURE_INPUTS)


@pytest.mark.parametrize("key", CONFIGURE_INPUTS)
def test_any_changed_input_discards_the_cache(tmp_path: Path, tools, key: str) -> None:
    inputs = _inputs(tools)
    build_dir = _configured(tmp_path / "build", inputs)
    changed = {**inputs, key: inputs[key] + "-other"}
    assert build.stale_cache_reason(build_dir, changed) == f"changed: {key}"


def test_cmake_args_and_compilers_come_from_the_environment(tools, monkeypatch) -> None:
    monkeypatch.setenv("CMAKE_ARGS", "-DCMAKE_CUDA_ARCHITECTURES=90")
    monkeypatch.setenv("CXX", "clang++")
    inputs = _inputs(tools, build_type="Debug")
    assert inputs["cmake_args"] == "-DCMAKE_CUDA_ARCHITECTURES=90"
    assert "CXX=clang++" in inputs["compilers"]
    assert inputs["build_type"] == "Debug" and inputs["python"] == sys.executable


def test_a_recorded_path_that_is_gone_discards_the_cache(tmp_path: Path, tools) -> None:
    inputs = _inputs(tools)
    build_dir = _configured(tmp_path / "build", inputs)
    tools["pybind11"].rmdir()
    assert build.stale_cache_reason(build_dir, inputs) == f"gone: {tools['pybind11']}"


def test_a_cache_without_a_record_is_discarded(tmp_path: Path, tools) -> None:
    # A cache from an older setup.py, or from a configure that failed: its inputs are unknown.
    inputs = _inputs(tools)
    build_dir = _configured(tmp_path / "build", inputs)
    (build_dir / build.FINGERPRINT).unlink()
    assert build.stale_cache_reason(build_dir, inputs) == "no record of its configure inputs"
    (build_dir / build.FINGERPRINT).write_text("{not json")
    assert build.stale_cache_reason(build_dir, inputs) == "no record of its configure inputs"


def test_the_record_is_withdrawn_until_configure_succeeds(tmp_path: Path, tools) -> None:
    inputs = _inputs(tools)
    build_dir = _configured(tmp_path / "build", inputs)
    build.discard_stale_cache(build_dir, inputs)
    assert not (build_dir / build.FINGERPRINT).exists()
    # Had that configure failed, its cache would not be trusted by the next build.
    assert build.stale_cache_reason(build_dir, inputs) is not None


def test_ninja_program_is_an_existing_file_or_empty() -> None:
    program = build.ninja_program()
    assert program == "" or Path(program).is_file()


def test_place_in_source_replaces_the_file_instead_of_overwriting_it(tmp_path: Path) -> None:
    built = tmp_path / "built.so"
    built.write_bytes(b"new build")
    target = tmp_path / "source.so"
    target.write_bytes(b"old build")
    with open(target, "rb") as loaded:  # as a running process holds its loaded _C
        build.place_in_source(built, target)
        assert loaded.read() == b"old build"
    assert target.read_bytes() == b"new build"
    assert not list(tmp_path.glob(".*partial"))


def test_place_in_source_of_the_file_itself_is_a_no_op(tmp_path: Path) -> None:
    built = tmp_path / "built.so"
    built.write_bytes(b"build")
    build.place_in_source(built, built)
    assert built.read_bytes() == b"build"


def _build_command(tmp_path: Path, monkeypatch, *, inplace: bool) -> object:
    """setup.py's build_ext over a pretend source tree, with CMake replaced by a file write."""
    from setuptools import Distribution

    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path / "source")
    (tmp_path / "source" / "gpipe_fast").mkdir(parents=True)
    extension = build.CMakeExtension("gpipe_fast._C")
    command = build.CMakeBuild(Distribution({"name": "gpipe_fast", "ext_modules": [extension]}))
    command.build_lib = str(tmp_path / "lib")
    command.build_temp = str(tmp_path / "temp")
    command.inplace = inplace
    command.ensure_finalized()

    def compile_(ext: object) -> None:
        output = Path(command.get_ext_fullpath(ext.name))  # type: ignore[attr-defined]
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(b"compiled _C")

    monkeypatch.setattr(command, "build_extension", compile_)
    return command


@pytest.mark.parametrize("inplace", [False, True], ids=["install", "editable"])
def test_a_build_places_C_in_the_source_package(tmp_path: Path, monkeypatch, inplace) -> None:
    command = _build_command(tmp_path, monkeypatch, inplace=inplace)
    command.run()  # type: ignore[attr-defined]
    assert (tmp_path / "lib" / "gpipe_fast" / C_NAME).read_bytes() == b"compiled _C"
    assert (tmp_path / "source" / "gpipe_fast" / C_NAME).read_bytes() == b"compiled _C"


def _read_only(*args: object) -> None:
    raise OSError(errno.EROFS, "Read-only file system")


def test_a_read_only_source_tree_warns_and_the_install_goes_on(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    command = _build_command(tmp_path, monkeypatch, inplace=False)
    monkeypatch.setattr(build.shutil, "copy2", _read_only)
    with caplog.at_level(logging.WARNING):
        command.run()  # type: ignore[attr-defined]
    assert (tmp_path / "lib" / "gpipe_fast" / C_NAME).exists()  # what the wheel installs
    assert not (tmp_path / "source" / "gpipe_fast" / C_NAME).exists()
    assert "could not place _C in the source tree" in caplog.text


def test_an_editable_build_that_cannot_place_C_fails(tmp_path: Path, monkeypatch) -> None:
    command = _build_command(tmp_path, monkeypatch, inplace=True)
    monkeypatch.setattr(build.shutil, "copy2", _read_only)
    with pytest.raises(OSError, match="Read-only"):
        command.run()  # type: ignore[attr-defined]


def _install_of_this_checkout() -> importlib.metadata.Distribution | None:
    """The installed gpipe_fast when pip built it from this checkout, else None."""
    try:
        distribution = importlib.metadata.distribution("gpipe_fast")
    except importlib.metadata.PackageNotFoundError:
        return None
    origin = json.loads(distribution.read_text("direct_url.json") or "{}").get("url", "")
    if not origin.startswith("file://"):
        return None
    return distribution if Path(unquote(urlparse(origin).path)).resolve() == ROOT else None


installed_here = pytest.mark.skipif(
    _install_of_this_checkout() is None, reason="gpipe_fast is not installed from this checkout"
)


@installed_here
def test_the_source_package_holds_the_installed_build_of_C() -> None:
    distribution = _install_of_this_checkout()
    assert distribution is not None
    in_place = ROOT / "gpipe_fast" / C_NAME
    assert in_place.is_file(), "the build did not place _C in the source package"
    installed = [f for f in distribution.files or [] if f.as_posix() == f"gpipe_fast/{C_NAME}"]
    if installed:  # a regular install: the wheel's copy and the source tree's are one build
        wheel_copy = Path(str(distribution.locate_file(installed[0])))
        assert wheel_copy.read_bytes() == in_place.read_bytes()


@installed_here
def test_python_m_gpipe_fast_runs_from_the_repository_root() -> None:
    # The Quickstart's `python -m gpipe_fast demo` imports the source tree's package from here.
    command = [sys.executable, "-c", "import gpipe_fast._C as c; print(c.__file__)"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == ROOT / "gpipe_fast" / C_NAME
    command = [sys.executable, "-m", "gpipe_fast", "--help"]
    usage = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert usage.returncode == 0, usage.stderr
    assert "usage: python -m gpipe_fast demo" in usage.stdout
