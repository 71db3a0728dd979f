"""recsave.memhint: large table storage is backed by transparent huge pages where THP is madvise."""
from __future__ import annotations

import pytest
import torch

from recsave import knobs
from recsave.memhint import advise_hugepages


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


def _anon_huge_kb(ptr: int) -> int:
    """AnonHugePages of the mapping holding address ptr (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(_thp_mode() != "madvise", reason="transparent huge pages are not in madvise mode here")
@pytest.mark.parametrize("enabled", [True, False])
def test_large_fresh_tensors_get_huge_pages_unless_turned_off(enabled):
    with knobs.override(hugepages=enabled):
        t = torch.empty(64 << 20, dtype=torch.uint8)
        advise_hugepages(t)
        t.fill_(1)
        huge = _anon_huge_kb(t.data_ptr() + (32 << 20))
    assert (huge > 0) == enabled


def test_small_and_device_tensors_are_left_alone():
    advise_hugepages(torch.empty(1024))  # below the threshold: no call, no error
    advise_hugepages(torch.empty(0))
