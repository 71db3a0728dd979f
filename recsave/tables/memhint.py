"""Memory hints to the OS for large host buffers."""
from __future__ import annotations

import ctypes
import sys

import torch

from recsave import knobs

_MADV_HUGEPAGE = 14  # Linux
_HUGE = 2 << 20
_MIN_BYTES = 32 << 20
_libc = None


def advise_hugepages(t: torch.Tensor) -> None:
    """Asks Linux to back a CPU tensor of >= 32 MB with transparent huge pages: random row access
    (lookups, a save gathering rows in bucket order) then misses the TLB far less. Pages not yet
    touched fault in 2 MB at a time; pages already touched are collapsed by khugepaged in the
    background. Only where THP is in "madvise" mode does this change anything; knob ``hugepages``
    turns it off (huge-page allocation may compact memory first on a fragmented machine)."""
    global _libc
    if t.device.type != "cpu" or t.nbytes < _MIN_BYTES or not sys.platform.startswith("linux") \
            or not knobs.get("hugepages"):
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    begin = (t.data_ptr() + _HUGE - 1) & ~(_HUGE - 1)
    end = (t.data_ptr() + t.nbytes) & ~(_HUGE - 1)
    if end > begin:
        _libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), _MADV_HUGEPAGE)  # a hint
