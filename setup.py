"""Builds the C++ extension ``recsave._C``; all metadata lives in setup.cfg.

The core (csrc/core) is plain C++17; the binding (csrc/bindings) needs only pybind11, so no torch is
needed at build time. CRC32C's SSE4.2 path is compiled with a function-level target attribute and
picked at run time, so the wheel runs on any x86-64 and on other architectures.

Where nvcc is on the PATH and the installed torch is a CUDA build, the kernels of csrc/cuda/ are
also built, with nvcc alone, into ``recsave/_cuda_kernels.so`` (a plain C ABI that
recsave/tables/cudakernels.py loads through ctypes). Anywhere else that step is skipped and
recsave runs as before; ``RECSAVE_CUDA_KERNELS_BUILD=0`` skips it, ``=1`` makes a failure fatal.
"""
import glob
import os
import shutil
import subprocess

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


def _cuda_archs():
    """The GPU architectures to build for: RECSAVE_CUDA_ARCHS ("80;90"), else the visible GPU's,
    else a spread of current ones (the newest also as PTX, for later GPUs)."""
    given = os.environ.get("RECSAVE_CUDA_ARCHS")
    if given:
        return [a.strip() for a in given.replace(",", ";").split(";") if a.strip()]
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return [f"{major}{minor}"]
    except Exception:  # noqa: BLE001 - any failure: fall back to the default list
        pass
    return ["75", "80", "86", "89", "90"]


def _cuda_wanted():
    """(build?, why not) for the optional CUDA kernels."""
    switch = os.environ.get("RECSAVE_CUDA_KERNELS_BUILD", "auto")
    if switch == "0":
        return False, "RECSAVE_CUDA_KERNELS_BUILD=0"
    if shutil.which("nvcc") is None:
        return False, "no nvcc on the PATH"
    try:
        import torch
    except ImportError:
        return False, "torch is not importable at build time"
    if not torch.version.cuda:
        return False, "torch is a CPU build"
    return True, ""


class BuildExt(build_ext):
    """pybind11's build_ext, then the optional nvcc build of csrc/cuda/."""

    def run(self):
        super().run()
        wanted, why = _cuda_wanted()
        if not wanted:
            print(f"recsave: CUDA kernels not built ({why}); CUDA tables use torch ops")
            return
        target = os.path.join(os.path.dirname(self.get_ext_fullpath("recsave._C")), "_cuda_kernels.so")
        archs = _cuda_archs()
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        cmd = ["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden", *gencode,
               "-o", target, *sorted(glob.glob("csrc/cuda/*.cu"))]
        print("recsave: " + " ".join(cmd))
        try:
            subprocess.run(cmd, check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            if os.environ.get("RECSAVE_CUDA_KERNELS_BUILD") == "1":
                raise
            print(f"recsave: CUDA kernels not built ({exc}); CUDA tables use torch ops")


setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
