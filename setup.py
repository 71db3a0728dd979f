"""Builds the C++ extension ``recsave._C``; all metadata lives in setup.cfg.

The core (csrc/core) is plain C++17; the binding (csrc/bindings) needs only pybind11, so no torch is
needed at build time. CRC32C's SSE4.2 path is compiled with a function-level target attribute and
picked at run time, so the wheel runs on any x86-64 and on other architectures.
"""
import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Compile translation units in parallel (pybind11 helper; honours RECSAVE_BUILD_JOBS).
ParallelCompile("RECSAVE_BUILD_JOBS", default=0).install()

sources = sorted(glob.glob("csrc/core/*.cc")) + sorted(glob.glob("csrc/bindings/*.cc"))

ext = Pybind11Extension(
    "recsave._C",
    sources,
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
