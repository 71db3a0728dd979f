"""CRC32C of the engine against published vectors and an independent implementation."""
import os

import google_crc32c
import numpy as np
import pytest

from recsave import _C

# RFC 3720 appendix B.4, plus the standard check value.
VECTORS = [
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"123456789", 0xE3069283),
    (b"", 0),
]

PATHS = ["crc32c", "crc32c_portable"] + (["crc32c_hardware"] if _C.crc32c_hardware_available() else [])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("data,expected", VECTORS)
def test_published_vectors(path, data, expected):
    assert getattr(_C, path)(data) == expected


@pytest.mark.parametrize("path", PATHS)
def test_matches_google_crc32c_on_all_lengths_and_alignments(path):
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    fn = getattr(_C, path)
    for offset in range(8):
        for length in (1, 7, 255, 256, 767, 768, 769, 8191, 24575, 24576, 24577, 60_000, 99_990):
            piece = buf[offset:offset + length]
            assert fn(piece) == google_crc32c.value(piece), (offset, length)


def test_extending_equals_concatenation():
    data = os.urandom(50_000)
    assert _C.crc32c(data[30_000:], _C.crc32c(data[:30_000])) == _C.crc32c(data)


def test_address_variant_and_dispatch_name():
    arr = np.frombuffer(os.urandom(4096), dtype=np.uint8)
    assert _C.crc32c_address(arr.ctypes.data, arr.nbytes) == google_crc32c.value(arr.tobytes())
    assert _C.crc32c_kernel() in KERNELS


KERNELS = ("vpclmul", "pclmul", "sse4.2", "portable")


@pytest.mark.parametrize("portable", [False, True])
def test_one_name_for_the_kernel(portable):
    """crc32c_kernel() and crc32c_implementation() (its alias) name the same kernel; forcing the
    portable one with RECSAVE_CRC32C_PORTABLE=1 names it "portable" in both."""
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("RECSAVE_CRC32C_PORTABLE", None)
    if portable:
        env["RECSAVE_CRC32C_PORTABLE"] = "1"
    code = "from recsave import _C; print(_C.crc32c_kernel(), _C.crc32c_implementation())"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    kernel, implementation = out.stdout.split()
    assert kernel == implementation
    if portable:
        assert kernel == "portable"
    else:
        assert kernel in KERNELS and (kernel == "portable") == (not _C.crc32c_hardware_available())
