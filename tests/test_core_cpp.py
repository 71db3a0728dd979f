"""Builds and runs the C++ core's own tests (no Python in them), normally and under ASan/UBSan."""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = sorted(glob.glob(os.path.join(ROOT, "csrc", "core", "*.cc")))
TESTS = sorted(glob.glob(os.path.join(ROOT, "csrc", "tests", "*_test.cc")))

FLAVOURS = {
    "optimized": ["-O2"],
    "sanitized": ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                  "-fno-omit-frame-pointer"],
    # Data races between the engine's and the id map's worker threads.
    "threads": ["-O1", "-g", "-fsanitize=thread"],
}

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _compile(args, cwd):
    proc = subprocess.run(["g++", "-std=c++17", "-Wall", "-pthread", f"-I{ROOT}/csrc", *args],
                          capture_output=True, text=True, cwd=cwd)
    assert proc.returncode == 0, proc.stderr


# The sanitizer builds take most of this module's ~1 minute: not in `make test-quick`.
@pytest.fixture(scope="module", params=[pytest.param(f, marks=() if f == "optimized" else pytest.mark.slow)
                                        for f in sorted(FLAVOURS)])
def core_objects(request, tmp_path_factory):
    """The core compiled once per flavour (the tests link against these objects)."""
    flavour = request.param
    out = tmp_path_factory.mktemp(f"core-{flavour}")
    _compile([*FLAVOURS[flavour], "-c", *CORE], cwd=out)
    return flavour, sorted(str(p) for p in out.glob("*.o"))


@pytest.mark.parametrize("test_src", TESTS, ids=[os.path.basename(t) for t in TESTS])
def test_cpp_core(tmp_path, test_src, core_objects):
    flavour, objects = core_objects
    exe = tmp_path / "t"
    _compile([*FLAVOURS[flavour], test_src, *objects, "-o", str(exe)], cwd=tmp_path)
    # Small sizes and no throughput measurement: the suite checks behaviour, benchmarks measure speed.
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1", TSAN_OPTIONS="halt_on_error=1", TMPDIR=str(tmp_path),
               RECSAVE_IDMAP_TEST_SMALL="1")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
