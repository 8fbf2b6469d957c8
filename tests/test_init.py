"""The package's public surface: __all__ names the API, and the native core stays private."""

import importlib
import subprocess
import sys
import types
from pathlib import Path

import gpipe_fast


def test_native_core_is_not_exported_but_stays_importable() -> None:
    assert "_C" not in gpipe_fast.__all__
    namespace: dict[str, object] = {}
    exec("from gpipe_fast import *", namespace)
    assert "_C" not in namespace
    # Still reachable by its full name, as the package's own modules and the benches use it.
    native = importlib.import_module("gpipe_fast._C")
    assert isinstance(native, types.ModuleType)
    assert hasattr(native, "cuda_compiled")


def test_every_exported_name_exists_and_is_public() -> None:
    assert len(set(gpipe_fast.__all__)) == len(gpipe_fast.__all__)
    for name in gpipe_fast.__all__:
        assert not name.startswith("_"), name
        assert hasattr(gpipe_fast, name), name


def test_importing_the_package_prints_no_warning(tmp_path: Path) -> None:
    # A newcomer's first command must not open with a warning: torch warns at import when
    # NumPy is missing, which is why the package depends on numpy.
    result = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", "import gpipe_fast"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
