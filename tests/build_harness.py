"""setup.py loaded as a module (its setup() call is guarded by __main__, so loading it builds
nothing), and its build_extension run with pretend tools and a pretend CMake."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_setup() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpipe_fast_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


build = load_setup()


@dataclass
class BuildEnv:
    """What one pip build environment provides: a ninja and pybind11's package (headers and
    CMake folder), at a path of its own as pip's temporary environments have."""

    root: Path
    header: str = "// pybind11 3.1.0"

    def __post_init__(self) -> None:
        (self.root / "bin").mkdir(parents=True)
        self.ninja.write_bytes(b"\x7fELF ninja 1.13")
        self.ninja.chmod(0o755)
        package = self.root / "site-packages" / "pybind11"
        (package / "include" / "pybind11").mkdir(parents=True)
        (package / "include" / "pybind11" / "pybind11.h").write_text(self.header)
        self.cmake_dir.mkdir(parents=True)
        (self.cmake_dir / "pybind11Config.cmake").write_text("# pybind11's CMake config")
        # Compiled when pip imports the package: different bytes in every environment.
        (package / "share" / "__pycache__").mkdir()
        (package / "share" / "__pycache__" / "__init__.pyc").write_bytes(str(self.root).encode())

    @property
    def ninja(self) -> Path:
        return self.root / "bin" / "ninja"

    @property
    def cmake_dir(self) -> Path:
        return self.root / "site-packages" / "pybind11" / "share" / "cmake" / "pybind11"


@dataclass
class FakeCMake:
    """Stands for cmake: a configure of a folder without CMakeCache.txt writes one, and the
    build writes an object file under CMakeFiles/ (as Ninja does) unless one is there, naming
    the configure it was compiled after; records every configure's command line."""

    configures: list[list[str]] = field(default_factory=list)

    def __call__(self, command: list[str], cwd: Path, check: bool) -> None:
        assert check
        if command[1] == "--build":
            compiled = Path(cwd) / "CMakeFiles" / "_C.dir" / "module.cpp.o"
            if not compiled.exists():
                compiled.parent.mkdir(parents=True, exist_ok=True)
                compiled.write_text(f"compiled after configure {len(self.configures)}")
            return
        self.configures.append(command)
        (Path(cwd) / "CMakeCache.txt").touch()

    def define(self, name: str, configure: int = -1) -> str:
        """The value of -D<name>= in a configure's command line (the last one wins, as in CMake)."""
        prefix = f"-D{name}="
        command = self.configures[configure]
        values = [
            argument.removeprefix(prefix) for argument in command if argument.startswith(prefix)
        ]
        assert values, f"-D{name} not passed"
        return values[-1]


def compiled_object(source: Path) -> str:
    """What FakeCMake's build left in the source tree's CMake build folder."""
    (compiled,) = (source / "build").glob("temp.*/gpipe_fast._C/CMakeFiles/_C.dir/module.cpp.o")
    return compiled.read_text()


def run_build(
    monkeypatch: pytest.MonkeyPatch,
    source: Path,
    env: BuildEnv,
    cmake: FakeCMake,
    *,
    build_temp: Path | None = None,
    torch_version_file: Path | None = None,
) -> None:
    """setup.py's build_extension over a pretend source tree, as one `pip install` runs it:
    with env's tools, cmake replaced by `cmake`, and the torch whose version.py is given (None:
    no torch). build_temp: setuptools' build_temp (an editable install's is temporary)."""
    import pybind11
    from setuptools import Distribution

    monkeypatch.setattr(build, "SOURCE_DIR", source)
    monkeypatch.setattr(build, "ninja_program", lambda: str(env.ninja))
    monkeypatch.setattr(pybind11, "get_cmake_dir", lambda: str(env.cmake_dir))
    monkeypatch.setattr(build, "torch_version_file", lambda: torch_version_file, raising=False)
    monkeypatch.setattr(build.subprocess, "run", cmake)
    (source / "gpipe_fast").mkdir(parents=True, exist_ok=True)
    extension = build.CMakeExtension("gpipe_fast._C")
    command = build.CMakeBuild(Distribution({"name": "gpipe_fast", "ext_modules": [extension]}))
    command.build_lib = str(source / "build" / "lib")
    if build_temp is not None:
        command.build_temp = str(build_temp)
    command.ensure_finalized()
    command.build_extension(extension)
