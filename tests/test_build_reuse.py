"""setup.py: a second install reuses the CMake build folder, and what it compiled, when the
build tools are the same, though each pip install brings them at a new temporary path."""

from __future__ import annotations

from pathlib import Path

import pytest
from build_harness import BuildEnv, FakeCMake, build, compiled_object, run_build


def test_a_second_install_with_the_same_tools_reuses_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source, cmake = tmp_path / "source", FakeCMake()
    run_build(monkeypatch, source, BuildEnv(tmp_path / "pip-build-env-1"), cmake)
    capsys.readouterr()
    # pip deletes each build environment once the wheel is built.
    run_build(monkeypatch, source, BuildEnv(tmp_path / "pip-build-env-2"), cmake)
    assert "configuring CMake afresh" not in capsys.readouterr().out
    assert compiled_object(source) == "compiled after configure 1"
    for name in ("CMAKE_MAKE_PROGRAM", "pybind11_DIR"):
        assert cmake.define(name, 0) == cmake.define(name, 1), name
        assert "pip-build-env" not in cmake.define(name), name


def test_other_pybind11_headers_configure_and_compile_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source, cmake = tmp_path / "source", FakeCMake()
    run_build(monkeypatch, source, BuildEnv(tmp_path / "env-1"), cmake)
    capsys.readouterr()
    run_build(monkeypatch, source, BuildEnv(tmp_path / "env-2", header="// pybind11 3.2"), cmake)
    assert "configuring CMake afresh" in capsys.readouterr().out
    assert compiled_object(source) == "compiled after configure 2"
    assert cmake.define("pybind11_DIR", 0) != cmake.define("pybind11_DIR", 1)
    assert cmake.define("CMAKE_MAKE_PROGRAM", 0) == cmake.define("CMAKE_MAKE_PROGRAM", 1)


def test_editable_installs_build_in_the_source_tree_not_their_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # setuptools gives each editable install a build_temp that it deletes afterwards.
    source, cmake = tmp_path / "source", FakeCMake()
    env = BuildEnv(tmp_path / "env")
    run_build(monkeypatch, source, env, cmake, build_temp=tmp_path / "editable-1.build-temp")
    run_build(monkeypatch, source, env, cmake, build_temp=tmp_path / "editable-2.build-temp")
    assert compiled_object(source) == "compiled after configure 1"
    assert not list(tmp_path.glob("editable-*/**/CMakeCache.txt"))


def test_stable_ninja_names_the_contents_not_the_environment(tmp_path: Path) -> None:
    first, second = BuildEnv(tmp_path / "env-1"), BuildEnv(tmp_path / "env-2")
    tools = tmp_path / "tools"
    copy = Path(build.stable_ninja(str(first.ninja), tools))
    assert Path(build.stable_ninja(str(second.ninja), tools)) == copy
    assert copy.read_bytes() == first.ninja.read_bytes()
    assert copy.stat().st_mode & 0o111  # still a program
    second.ninja.write_bytes(b"\x7fELF ninja 1.14")
    assert Path(build.stable_ninja(str(second.ninja), tools)) != copy
    assert build.stable_ninja("", tools) == ""  # no ninja found: CMake says so


def test_stable_pybind11_is_a_whole_package_at_a_path_naming_its_contents(tmp_path: Path) -> None:
    env = BuildEnv(tmp_path / "env")
    cmake_dir = Path(build.stable_pybind11(str(env.cmake_dir), tmp_path / "tools"))
    assert (cmake_dir / "pybind11Config.cmake").is_file()
    # pybind11Config.cmake finds the headers three folders up, as in the package.
    assert (cmake_dir.parents[2] / "include" / "pybind11" / "pybind11.h").read_text() == env.header
    assert not list(cmake_dir.parents[2].rglob("__pycache__"))


def test_a_pybind11_of_another_layout_is_used_where_it_is(tmp_path: Path) -> None:
    cmake_dir = tmp_path / "usr" / "lib" / "cmake" / "pybind11"
    cmake_dir.mkdir(parents=True)
    assert build.stable_pybind11(str(cmake_dir), tmp_path / "tools") == str(cmake_dir)
    assert not (tmp_path / "tools").exists()


def test_an_interrupted_copy_is_never_taken_for_a_complete_one(tmp_path: Path) -> None:
    def fails_midway(folder: Path) -> None:
        folder.mkdir()
        (folder / "half").write_text("")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build.stage(fails_midway, tmp_path / "tool")
    assert not list(tmp_path.iterdir())
    built = build.stage(lambda folder: folder.mkdir(), tmp_path / "tool")
    assert built == tmp_path / "tool" and built.is_dir()
