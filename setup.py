"""Builds gpipe_fast._C by driving CMake with the Ninja generator."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from sysconfig import get_paths

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE_DIR = Path(__file__).parent.resolve()
FINGERPRINT = "gpipe_fast-configure.json"  # in the CMake build folder, next to CMakeCache.txt
# The configure inputs that name files or folders: a cache that remembers one gone is unusable.
PATH_INPUTS = ("cmake", "make_program", "python", "pybind11_dir")
COMPILER_VARS = ("CC", "CXX", "CUDACXX")
CUDA_VAR = "GPIPE_FAST_CUDA"  # ON, OFF, or unset (AUTO): see cuda_choice
CMAKE_TRUE = ("ON", "1", "TRUE", "YES", "Y")
CMAKE_FALSE = ("OFF", "0", "FALSE", "NO", "N")


def ninja_program() -> str:
    """The ninja of the `ninja` Python package when present (as pybind11's cmake_example), else
    the one on PATH, else "" (CMake then says that it found none)."""
    try:
        import ninja

        bundled = Path(getattr(ninja, "BIN_DIR", "") or "/nonexistent") / "ninja"
        if bundled.is_file():  # BIN_DIR is "" when ninja cannot locate its own binary
            return str(bundled)
    except ImportError:
        pass
    return shutil.which("ninja") or ""


def content_digest(root: Path, parts: tuple[str, ...]) -> str:
    """A digest of the files root/part, or under it, for each part: their names and bytes
    (__pycache__ left out: its files differ between two installs of the same package)."""
    digest = hashlib.sha256()
    for part in parts:
        top = root / part
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(path.relative_to(root).as_posix().encode() + b"\0")
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def stage(fill: Callable[[Path], None], target: Path) -> Path:
    """target, filled by fill(folder) in a new folder renamed to target, unless it is there
    already: an interrupted copy never stands as a complete one."""
    if target.exists():
        return target
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        fill(partial)
        os.replace(partial, target)
    except OSError:
        if not target.exists():  # else another build renamed its copy first: the same contents
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def stable_ninja(ninja: str, tools: Path) -> str:
    """A copy of `ninja` at a path that names its contents, under tools/.

    pip builds each install in a fresh isolated environment, so the ninja (and pybind11) it
    provides live at a new temporary path every time; a CMake cache and Ninja's command lines
    that named those paths made every reinstall configure and compile afresh. A copy keyed by
    contents keeps the same path across installs of the same tool, and a new one for another."""
    if not ninja:
        return ""
    program = Path(ninja)

    def copy(folder: Path) -> None:
        folder.mkdir(parents=True)
        shutil.copy2(program, folder / program.name)

    digest = content_digest(program.parent, (program.name,))
    return str(stage(copy, tools / f"ninja-{digest}") / program.name)


def stable_pybind11(cmake_dir: str, tools: Path) -> str:
    """pybind11's CMake folder and headers copied under tools/, at a path naming their contents
    (see stable_ninja); cmake_dir itself when it is not pybind11's package layout."""
    root = Path(cmake_dir).parents[2]  # <root>/share/cmake/pybind11, headers in <root>/include
    relative = Path(cmake_dir).relative_to(root)
    if relative != Path("share/cmake/pybind11") or not (root / "include" / "pybind11").is_dir():
        return cmake_dir
    parts = ("include", "share/cmake")

    def copy(folder: Path) -> None:
        for part in parts:
            ignore = shutil.ignore_patterns("__pycache__")
            shutil.copytree(root / part, folder / part, ignore=ignore)

    digest = content_digest(root, parts)
    return str(stage(copy, tools / f"pybind11-{digest}") / relative)


@dataclass(frozen=True)
class TorchBuild:
    """What torch/version.py says of a torch build, read without importing torch."""

    version: str
    cuda: str | None
    hip: str | None


def torch_version_file() -> Path | None:
    """torch/version.py of the torch this build is for: the one the build can import (without
    build isolation), else the one in the target environment's site-packages (pip's isolated
    build hides that from sys.path, but the interpreter, hence sys.prefix, is the target's)."""
    spec = find_spec("torch")  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        folders = [Path(folder) for folder in spec.submodule_search_locations]
    else:
        paths = get_paths()
        folders = [Path(paths[key]) / "torch" for key in ("purelib", "platlib")]
    return next((f / "version.py" for f in folders if (f / "version.py").is_file()), None)


def read_torch_build(version_file: Path) -> TorchBuild | None:
    """The version and CUDA/HIP versions that torch/version.py assigns, or None when unreadable."""
    try:
        tree = ast.parse(version_file.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    values: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            try:
                values[target.id] = ast.literal_eval(value)
            except ValueError:
                pass
    strings = {name: value for name, value in values.items() if isinstance(value, str)}
    if "__version__" not in strings:
        return None
    return TorchBuild(strings["__version__"], strings.get("cuda"), strings.get("hip"))


@dataclass(frozen=True)
class CudaChoice:
    """Whether CMake builds the CUDA backend: "off", "auto" (when nvcc is found) or "required"
    (nvcc must be found), and the line that tells the user why."""

    mode: str
    why: str

    def cmake_args(self) -> list[str]:
        on = "OFF" if self.mode == "off" else "ON"
        required = "ON" if self.mode == "required" else "OFF"
        return [f"-DGPIPE_FAST_CUDA={on}", f"-DGPIPE_FAST_CUDA_REQUIRED={required}"]


def cuda_choice(requested: str | None, torch: TorchBuild | None) -> CudaChoice:
    """The rule: GPIPE_FAST_CUDA=ON builds the CUDA backend (an error without nvcc), OFF never
    does; unset, it is built when nvcc is found unless the torch found at build time has no
    CUDA (a CPU or ROCm wheel), whose users could not run it. No torch found (pip installs it
    with this package into a fresh environment) builds it when nvcc is found, as the default
    torch wheel on Linux is a CUDA one."""
    value = (requested or "AUTO").strip().upper()
    if value in CMAKE_TRUE:
        return CudaChoice("required", f"CUDA backend required ({CUDA_VAR}={requested})")
    if value in CMAKE_FALSE:
        return CudaChoice("off", f"CUDA backend skipped ({CUDA_VAR}={requested})")
    if value != "AUTO":
        raise ValueError(f"{CUDA_VAR} must be ON, OFF or AUTO (or unset), not {requested!r}")
    if torch is None:
        return CudaChoice(
            "auto",
            f"no torch found at build time: CUDA backend built if nvcc is found "
            f"({CUDA_VAR}=OFF skips it)",
        )
    if torch.cuda is None:
        kind = "a ROCm build" if torch.hip else "a CPU build"
        return CudaChoice(
            "off",
            f"CUDA backend skipped: torch {torch.version} is {kind} "
            f"(set {CUDA_VAR}=ON to build it)",
        )
    return CudaChoice(
        "auto", f"CUDA backend built if nvcc is found (torch {torch.version}, CUDA {torch.cuda})"
    )


def configure_inputs(
    make_program: str, pybind11_dir: str, build_type: str, cuda: str = "auto"
) -> dict[str, str]:
    """What a CMake cache remembers from its configure step, as a comparable fingerprint."""
    return {
        "source_dir": str(SOURCE_DIR),
        "generator": "Ninja",
        "cmake": shutil.which("cmake") or "",
        "make_program": make_program,
        "python": sys.executable,
        "pybind11_dir": pybind11_dir,
        "build_type": build_type,
        "cuda": cuda,
        "cmake_args": os.environ.get("CMAKE_ARGS", ""),
        # CMake reads these only on a first configure, then ignores them silently.
        "compilers": " ".join(f"{name}={os.environ.get(name, '')}" for name in COMPILER_VARS),
    }


def stale_cache_reason(build_dir: Path, inputs: dict[str, str]) -> str | None:
    """Why build_dir's CMake cache must not be reused with `inputs`, or None when it may be.

    build/temp.*/ outlives the environment that configured it (pip's isolated build
    environments, a venv, a compiler): a cache from an earlier build can point at programs
    that are gone or differ, and CMake would reuse it as is. Ninja and pybind11 are named by
    their stable copies (stable_ninja), so an install with the same tools reuses the cache."""
    if not (build_dir / "CMakeCache.txt").exists():
        return None
    try:
        recorded = json.loads((build_dir / FINGERPRINT).read_text())
    except (OSError, ValueError):
        return "no record of its configure inputs"
    keys = inputs.keys() | recorded.keys()
    changed = sorted(key for key in keys if recorded.get(key) != inputs.get(key))
    if changed:
        return "changed: " + ", ".join(changed)
    gone = [recorded[k] for k in PATH_INPUTS if recorded.get(k) and not Path(recorded[k]).exists()]
    if gone:
        return "gone: " + ", ".join(gone)
    return None


def discard_stale_cache(build_dir: Path, inputs: dict[str, str]) -> str | None:
    """Removes the CMake cache when stale, with CMakeFiles/ (which holds the object files too,
    so everything compiles again)."""
    reason = stale_cache_reason(build_dir, inputs)
    if reason is not None:
        (build_dir / "CMakeCache.txt").unlink()
        shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
    # Recorded again only after a successful configure, so a failed one is never trusted.
    (build_dir / FINGERPRINT).unlink(missing_ok=True)
    return reason


def place_in_source(built: Path, target: Path) -> None:
    """Copies built to target by writing a new file and renaming it over the old one: a process
    that has the old _C loaded keeps a valid mapping (overwriting in place would crash it)."""
    if target.exists() and target.samefile(built):
        return
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        shutil.copy2(built, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Builds into build/ as cmake_example does, then also places _C in the source package.

    Why in place: `python -m gpipe_fast` (or any script) run from the repository root imports
    the source tree's gpipe_fast/, ahead of the installed one, and must find a _C built from
    those sources. pybind11's cmake_example builds only into the wheel; scikit-build-core
    builds in the source tree only for its "inplace" editable mode; setuptools' own
    `build_ext --inplace` (what editable installs run) builds in build/ and copies into the
    source package. We take that last design and do it on every build, through the same
    hook, copy_extensions_to_source, so that regular and editable installs share one path.
    The copy is atomic (see place_in_source). For a regular install it is a convenience:
    a read-only source tree warns and the install goes on; for --inplace/editable installs
    the copy is the install, so a failure there is an error."""

    def run(self) -> None:
        super().run()  # with --inplace (editable installs) this calls copy_extensions_to_source
        if not self.inplace:
            try:
                self.copy_extensions_to_source()
            except OSError as error:
                self.warn(
                    f"could not place _C in the source tree ({error}); the install is fine, "
                    "but run Python from outside the repository root to use it"
                )

    def copy_extensions_to_source(self) -> None:
        for ext in self.extensions:
            filename = self.get_ext_filename(self.get_ext_fullname(ext.name))
            place_in_source(Path(self.build_lib) / filename, SOURCE_DIR / filename)

    def cmake_build_dir(self, ext: Extension) -> Path:
        """The CMake build folder: build/temp.<platform>-<python>/<ext> in the source tree, the
        build_temp of a regular install, for editable installs too (whose build_temp is a
        temporary folder deleted afterwards, so that each compiled everything afresh)."""
        name = f"temp.{self.plat_name}-{sys.implementation.cache_tag}"
        build_dir = SOURCE_DIR / "build" / name / ext.name
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only source tree: build where setuptools says
            build_dir = Path(self.build_temp).resolve() / ext.name
            build_dir.mkdir(parents=True, exist_ok=True)
        return build_dir

    def build_extension(self, ext: Extension) -> None:
        import pybind11

        extdir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_type = "Debug" if os.environ.get("DEBUG") else "Release"
        version_file = torch_version_file()
        torch = read_torch_build(version_file) if version_file else None
        cuda = cuda_choice(os.environ.get(CUDA_VAR), torch)
        print(f"gpipe_fast: {cuda.why}")
        build_dir = self.cmake_build_dir(ext)
        tools = build_dir.parent / "gpipe_fast-tools"
        inputs = configure_inputs(
            stable_ninja(ninja_program(), tools),
            stable_pybind11(pybind11.get_cmake_dir(), tools),
            build_type,
            cuda.mode,
        )
        args = [
            "-G", inputs["generator"],
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}",
            f"-DPython_EXECUTABLE={inputs['python']}",
            f"-Dpybind11_DIR={inputs['pybind11_dir']}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            *cuda.cmake_args(),
        ]  # fmt: skip
        if inputs["make_program"]:
            args.append(f"-DCMAKE_MAKE_PROGRAM={inputs['make_program']}")
        args += inputs["cmake_args"].split()  # last, so that the user's CMake flags win
        reason = discard_stale_cache(build_dir, inputs)
        if reason is not None:
            print(f"gpipe_fast: configuring CMake afresh in {build_dir} ({reason})")
        cmake = inputs["cmake"] or "cmake"
        subprocess.run([cmake, str(SOURCE_DIR), *args], cwd=build_dir, check=True)
        (build_dir / FINGERPRINT).write_text(json.dumps(inputs, indent=1, sort_keys=True))
        subprocess.run([cmake, "--build", ".", "--target", "_C"], cwd=build_dir, check=True)


# Guarded so that tests can import the helpers above without building (pip and setuptools run
# this file as __main__).
if __name__ == "__main__":
    setup(ext_modules=[CMakeExtension("gpipe_fast._C")], cmdclass={"build_ext": CMakeBuild})
