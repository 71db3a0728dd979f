"""recsave.tables.memhint: large table storage is backed by transparent huge pages where THP is madvise."""
from __future__ import annotations

import pytest
import torch

from recsave import knobs
from recsave.tables.memhint import advise_hugepages


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


def _smaps_field(ptr: int, field: str) -> list:
    """The values of `field` (e.g. "VmFlags:") for the mapping holding address ptr (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith(field):
                return line.split()[1:]
    return []


def _anon_huge_kb(ptr: int) -> int:
    """AnonHugePages of the mapping holding address ptr."""
    values = _smaps_field(ptr, "AnonHugePages:")
    return int(values[0]) if values else 0


@pytest.mark.skipif(_thp_mode() != "madvise", reason="transparent huge pages are not in madvise mode here")
@pytest.mark.parametrize("enabled", [True, False])
def test_large_fresh_tensors_get_huge_pages_unless_turned_off(enabled):
    with knobs.override(hugepages=enabled):
        t = torch.empty(64 << 20, dtype=torch.uint8)
        advise_hugepages(t)
        t.fill_(1)
        huge = _anon_huge_kb(t.data_ptr() + (32 << 20))
    assert (huge > 0) == enabled


def _vm_flags(ptr: int) -> list:
    return _smaps_field(ptr, "VmFlags:")


class _ReportsMetaDevice(torch.Tensor):
    """A CPU tensor that says it lives on another device: were advise_hugepages to use its pointer
    anyway, the advice would show on the host mapping behind it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the `device` property
            return torch.device("meta")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")
def test_small_and_device_tensors_are_left_alone():
    """Only CPU tensors of >= 32 MB are advised (VM_HUGEPAGE, "hg" in smaps' VmFlags): one just
    below the threshold and one reporting another device keep their mappings' flags."""
    import mmap

    # Fresh anonymous mappings: torch.empty of 30 MB may come from malloc's heap (its mmap threshold
    # rises to 32 MB once a large block is freed), whose memory an earlier test may have advised.
    maps = [mmap.mmap(-1, n) for n in ((32 << 20) - (2 << 20), 32 << 20, 64 << 20)]
    with knobs.override(hugepages=True):
        small, at_threshold, elsewhere = (torch.frombuffer(m, dtype=torch.uint8) for m in maps)
        on_device = elsewhere.as_subclass(_ReportsMetaDevice)
        assert on_device.device.type == "meta" and on_device.data_ptr() == elsewhere.data_ptr()
        middles = [t.data_ptr() + t.nbytes // 2 for t in (small, at_threshold, elsewhere)]
        assert ["hg" in _vm_flags(p) for p in middles] == [False, False, False]  # fresh mappings
        for t in (small, at_threshold, on_device, torch.empty(0), torch.empty(1024)):
            advise_hugepages(t)
        assert ["hg" in _vm_flags(p) for p in middles] == [False, True, False]
        advise_hugepages(elsewhere)  # the same memory as a CPU tensor is advised
        assert "hg" in _vm_flags(middles[2])


@pytest.mark.skipif(_thp_mode() != "madvise", reason="transparent huge pages are not in madvise mode here")
@pytest.mark.parametrize("enabled", [True, False])
def test_restored_table_storage_is_advised_after_the_fill(enabled):
    """A restore fills fresh storage on 4 KB pages (no huge page zeroed and then overwritten) and
    advises it for huge pages afterwards; a table growing in training advises before touching."""
    from recsave import HashTable

    with knobs.override(hugepages=enabled):
        table = HashTable(64, name="t")
        seen = {}

        def fill(views):
            seen["during"] = _vm_flags(views["embedding"].data_ptr() + (32 << 20))
            views["embedding"].fill_(1.0)

        views = table.prepare_load(torch.arange(300_000), ["embedding"], fill)
        after = _vm_flags(views["embedding"].data_ptr() + (32 << 20))
        grown = HashTable(64, name="g")
        grown.lookup(torch.arange(300_000), insert=True)
        in_training = _vm_flags(grown.weight.data_ptr() + (32 << 20))
    assert "hg" not in seen["during"]
    assert ("hg" in after) == enabled and ("hg" in in_training) == enabled
