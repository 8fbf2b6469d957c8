"""setup.py builds the CUDA backend for a torch with CUDA, not for a CPU-only torch unless
GPIPE_FAST_CUDA=ON asks for it, and says which in the build output."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from build_harness import ROOT, BuildEnv, FakeCMake, build, run_build

# The form of torch/version.py (2.x wheels), read by setup.py without importing torch.
VERSION_PY = """from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = {version!r}
debug = False
cuda: Optional[str] = {cuda!r}
git_version = 'cf30153c4c131c8164ee7798e5022d810682e2cb'
hip: Optional[str] = {hip!r}
"""
CPU_TORCH = build.TorchBuild("2.13.0+cpu", None, None)
CUDA_TORCH = build.TorchBuild("2.13.0+cu128", "12.8", None)
ROCM_TORCH = build.TorchBuild("2.13.0+rocm6.4", None, "6.4.43482")


def _version_file(folder: Path, torch_build: object) -> Path:
    version_file = folder / "torch" / "version.py"
    version_file.parent.mkdir(parents=True)
    version_file.write_text(VERSION_PY.format(**vars(torch_build)))
    return version_file


@pytest.mark.parametrize("torch_build", [CPU_TORCH, CUDA_TORCH, ROCM_TORCH], ids=str)
def test_read_torch_build_reads_version_py(tmp_path: Path, torch_build) -> None:
    assert build.read_torch_build(_version_file(tmp_path, torch_build)) == torch_build


def test_read_torch_build_of_an_unreadable_file_is_none(tmp_path: Path) -> None:
    assert build.read_torch_build(tmp_path / "missing.py") is None
    (tmp_path / "version.py").write_text("__version__ = (")
    assert build.read_torch_build(tmp_path / "version.py") is None
    (tmp_path / "version.py").write_text("cuda = '12.8'\n")  # no __version__
    assert build.read_torch_build(tmp_path / "version.py") is None


def test_the_torch_that_the_build_can_import_is_read_as_torch_sees_itself() -> None:
    version_file = build.torch_version_file()
    assert version_file == Path(torch.__file__).parent / "version.py"
    found = build.read_torch_build(version_file)
    assert found == build.TorchBuild(torch.__version__, torch.version.cuda, torch.version.hip)


def test_under_build_isolation_the_target_environments_torch_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pip's isolated build cannot import the target's torch, but sys.prefix is the target's.
    site_packages = tmp_path / "venv" / "site-packages"
    version_file = _version_file(site_packages, CPU_TORCH)
    paths = {"purelib": str(site_packages), "platlib": str(tmp_path / "platlib")}
    monkeypatch.setattr(build, "find_spec", lambda name: None)
    monkeypatch.setattr(build, "get_paths", lambda: paths)
    assert build.torch_version_file() == version_file
    version_file.unlink()
    assert build.torch_version_file() is None


CHOICES = [
    # (GPIPE_FAST_CUDA, torch found at build time, mode, what the build output says)
    (None, CPU_TORCH, "off", "CUDA backend skipped: torch 2.13.0+cpu is a CPU build "
     "(set GPIPE_FAST_CUDA=ON to build it)"),
    (None, ROCM_TORCH, "off", "CUDA backend skipped: torch 2.13.0+rocm6.4 is a ROCm build"),
    (None, CUDA_TORCH, "auto", "CUDA backend built if nvcc is found (torch 2.13.0+cu128, "
     "CUDA 12.8)"),
    (None, None, "auto", "no torch found at build time: CUDA backend built if nvcc is found"),
    ("", CPU_TORCH, "off", "is a CPU build"),
    ("auto", CPU_TORCH, "off", "is a CPU build"),
    ("ON", CPU_TORCH, "required", "CUDA backend required (GPIPE_FAST_CUDA=ON)"),
    ("1", None, "required", "CUDA backend required (GPIPE_FAST_CUDA=1)"),
    ("off", CUDA_TORCH, "off", "CUDA backend skipped (GPIPE_FAST_CUDA=off)"),
]  # fmt: skip


@pytest.mark.parametrize(("requested", "torch_build", "mode", "says"), CHOICES)
def test_cuda_choice(requested, torch_build, mode: str, says: str) -> None:
    choice = build.cuda_choice(requested, torch_build)
    assert choice.mode == mode
    assert says in choice.why


def test_a_bad_gpipe_fast_cuda_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"GPIPE_FAST_CUDA must be ON, OFF or AUTO.*'maybe'"):
        build.cuda_choice("maybe", CUDA_TORCH)


@pytest.mark.parametrize(
    ("requested", "torch_build", "cuda", "required"),
    [
        (None, CPU_TORCH, "OFF", "OFF"),
        (None, CUDA_TORCH, "ON", "OFF"),
        ("ON", CPU_TORCH, "ON", "ON"),
    ],
)
def test_the_build_passes_the_choice_to_cmake_and_says_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    requested,
    torch_build,
    cuda: str,
    required: str,
) -> None:
    if requested is None:
        monkeypatch.delenv("GPIPE_FAST_CUDA", raising=False)
    else:
        monkeypatch.setenv("GPIPE_FAST_CUDA", requested)
    cmake, version_file = FakeCMake(), _version_file(tmp_path / "site-packages", torch_build)
    env = BuildEnv(tmp_path / "env")
    run_build(monkeypatch, tmp_path / "source", env, cmake, torch_version_file=version_file)
    assert cmake.define("GPIPE_FAST_CUDA") == cuda
    assert cmake.define("GPIPE_FAST_CUDA_REQUIRED") == required
    expected = build.cuda_choice(requested, torch_build).why
    assert f"gpipe_fast: {expected}\n" in capsys.readouterr().out


def test_cmake_args_from_the_user_come_last_and_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CMAKE_ARGS", "-DGPIPE_FAST_CUDA=ON")
    cmake, version_file = FakeCMake(), _version_file(tmp_path / "site-packages", CPU_TORCH)
    env = BuildEnv(tmp_path / "env")
    run_build(monkeypatch, tmp_path / "source", env, cmake, torch_version_file=version_file)
    assert cmake.define("GPIPE_FAST_CUDA") == "ON"


def test_cmake_fails_when_the_cuda_backend_is_required_and_no_nvcc_is_found(
    tmp_path: Path,
) -> None:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not found on PATH")
    command = [cmake, "-S", str(ROOT), "-B", str(tmp_path), "-DGPIPE_FAST_PYTHON=OFF"]
    command.append("-DGPIPE_FAST_CUDA_REQUIRED=ON")
    environment = {**os.environ, "CUDACXX": str(tmp_path / "no-nvcc")}  # where none is
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=environment, check=False
    )
    assert result.returncode != 0
    assert "the CUDA backend was asked for (GPIPE_FAST_CUDA=ON)" in result.stderr
