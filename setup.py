"""Builds gpipe_fast._C by driving CMake with the Ninja generator."""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        extdir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_type = "Debug" if os.environ.get("DEBUG") else "Release"
        args = [
            "-G", "Ninja",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
        ]
        args += os.environ.get("CMAKE_ARGS", "").split()
        build_dir = Path(self.build_temp) / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        source_dir = Path(__file__).parent.resolve()
        subprocess.run(["cmake", str(source_dir), *args], cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", ".", "--target", "_C"], cwd=build_dir, check=True)


setup(ext_modules=[CMakeExtension("gpipe_fast._C")], cmdclass={"build_ext": CMakeBuild})
