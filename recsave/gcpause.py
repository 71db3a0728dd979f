"""Pausing Python's cyclic garbage collector while many small acyclic objects are built.

Parsing or merging an index builds a record per chunk and a tuple of ints per checksum list; with
the collector running, each generation-0 collection rescans the survivors, and at a thousand ranks'
index (tens of MB) that is most of the time (benchmarks/README.md, "Scale"). The records hold no
reference cycles, so nothing is left for the collector when the pause ends. Pauses nest and may
overlap across threads: the collector runs again once the last one ends, unless it was off before.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Runs the block with the cyclic garbage collector off (reference counting still frees)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
