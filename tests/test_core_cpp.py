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
}


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("test_src", TESTS, ids=[os.path.basename(t) for t in TESTS])
def test_cpp_core(tmp_path, test_src, flavour):
    exe = tmp_path / "t"
    cmd = ["g++", "-std=c++17", "-Wall", "-pthread", *FLAVOURS[flavour], f"-I{ROOT}/csrc", test_src,
           *CORE, "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1", TMPDIR=str(tmp_path))
    if flavour == "sanitized":
        env["RECSAVE_IDMAP_TEST_SMALL"] = "1"  # keep the sanitized run short
    proc = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
