"""Tuning knobs in one place: a default, overridable by an environment variable, overridable in turn
by the :func:`override` context manager (what tests use).

    with recsave.knobs.override(segment_bytes=1 << 20):
        ...
"""
from __future__ import annotations

import contextlib
import difflib
import math
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, TypeVar

from recsave.errors import ArgumentTypeError, UsageError

T = TypeVar("T")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


_MAX_INT = 1 << 62


@dataclass(frozen=True)
class Knob:
    """A knob: its environment variable, default, kind (int, float or bool), smallest and largest
    value."""
    env: str
    default: Any
    kind: type
    lo: Optional[float] = None
    hi: Optional[float] = None

    def check(self, name: str, value: Any) -> Any:
        """`value` if it is of this knob's kind and range, else TypeError / UsageError naming it."""
        ok_type = (isinstance(value, bool) if self.kind is bool else
                   isinstance(value, int) and not isinstance(value, bool) if self.kind is int else
                   isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok_type:
            raise ArgumentTypeError(f"knob {name!r} takes a {self.kind.__name__}, got {value!r} "
                                    f"({type(value).__name__})", key=name)
        if self.lo is not None and not value >= self.lo:  # (NaN is never >= anything)
            raise UsageError(f"knob {name!r} must be >= {self.lo}, got {value!r}", key=name)
        if self.hi is not None and not value <= self.hi:
            raise UsageError(f"knob {name!r} must be <= {self.hi}, got {value!r}", key=name)
        # Sizes and counts go into the index (its validator takes integers up to 2**62) and into the
        # engine's 64-bit arguments; a float must be finite.
        if self.kind is int and value > _MAX_INT:
            raise UsageError(f"knob {name!r} must be <= 2**62, got {value!r}", key=name)
        if self.kind is float and not math.isfinite(value):
            raise UsageError(f"knob {name!r} must be a finite number, got {value!r}", key=name)
        return float(value) if self.kind is float else value

    def parse(self, name: str, raw: str) -> Any:
        """The value of environment variable text `raw` (only documented spellings for booleans)."""
        if self.kind is bool:
            text = raw.strip().lower()
            if text not in _TRUE + _FALSE:
                raise UsageError(f"environment variable {self.env}={raw!r} is not a boolean: use one of "
                                 f"{', '.join(_TRUE)} or {', '.join(repr(v) for v in _FALSE)}", key=name)
            return text in _TRUE
        try:
            value = self.kind(raw)
        except ValueError:
            raise UsageError(f"environment variable {self.env}={raw!r} is not a valid "
                             f"{self.kind.__name__}", key=name) from None
        try:
            return self.check(name, value)
        except UsageError as exc:
            raise UsageError(f"environment variable {self.env}={raw!r}: {exc}", key=name) from None


# name -> Knob(environment variable, default, kind, smallest value[, largest value])
_KNOBS: Dict[str, Knob] = {
    # Bytes covered by one CRC32C in a shard chunk; also the unit of parallel writes.
    "segment_bytes": Knob("RECSAVE_SEGMENT_BYTES", 4 << 20, int, lo=1),
    # Smallest checksum segment cut at a bucket boundary: a reader needing a bucket range reads at
    # most one partial segment at each end, so this bounds the extra bytes of a reshard read.
    "min_segment_bytes": Knob("RECSAVE_MIN_SEGMENT_BYTES", 64 << 10, int, lo=0),
    # A rank starts a new shard file part once the current one holds this many bytes.
    "max_shard_bytes": Knob("RECSAVE_MAX_SHARD_BYTES", 4 << 30, int, lo=1),
    # Threads of the C++ engine per file operation when the caller does not say.
    "concurrency": Knob("RECSAVE_CONCURRENCY", 4, int, lo=1),
    # fsync files and directories on commit (turn off only for throwaway runs / benchmarks).
    "fsync": Knob("RECSAVE_FSYNC", True, bool),
    # Reader limits, enforced before allocating (docs/FORMAT.md).
    "max_header_bytes": Knob("RECSAVE_MAX_HEADER_BYTES", 100 << 20, int, lo=1),
    "max_index_bytes": Knob("RECSAVE_MAX_INDEX_BYTES", 256 << 20, int, lo=1),
    # Durable shard files of a save queued for their fsync + rename before the queue is committed
    # early (each holds an open descriptor), and how many of those commits run at once.
    "max_queued_commits": Knob("RECSAVE_MAX_QUEUED_COMMITS", 64, int, lo=1),
    "commit_threads": Knob("RECSAVE_COMMIT_THREADS", 16, int, lo=1),
    # Seconds a collective of a save / load waits for the other ranks before raising.
    "collective_timeout_s": Knob("RECSAVE_COLLECTIVE_TIMEOUT_S", 300.0, float, lo=0.001),
    # Rows of a GPU table, or of any table saved to remote storage, are gathered and written in
    # blocks of about this many bytes (two in flight); a GPU table's restore reads and copies its
    # columns in blocks of this size too. CPU tables saved to local disk are gathered by the
    # engine's writer threads through 1 MiB buffers of their own.
    "write_block_bytes": Knob("RECSAVE_WRITE_BLOCK_BYTES", 64 << 20, int, lo=1),
    # Size of one in-memory chunk streamed to / from remote (fsspec) storage.
    "io_chunk_bytes": Knob("RECSAVE_IO_CHUNK_BYTES", 64 << 20, int, lo=1),
    # Remote (fsspec) storage: retries of an operation after a transient failure (connection error,
    # timeout, HTTP 5xx / throttling), the first backoff and the longest single backoff (seconds).
    "io_retries": Knob("RECSAVE_IO_RETRIES", 5, int, lo=0),
    "io_retry_base_s": Knob("RECSAVE_IO_RETRY_BASE_S", 0.2, float, lo=0),
    "io_retry_max_s": Knob("RECSAVE_IO_RETRY_MAX_S", 10.0, float, lo=0),
    # Seconds after its last renewal that a writer lock of an output dir counts as abandoned (its
    # holder renews it every quarter of this on a thread): how long a crashed writer on another
    # host blocks the next one.
    "writer_lease_s": Knob("RECSAVE_WRITER_LEASE_S", 300.0, float, lo=0.001),
    # Seconds interpreter exit (or a new acquire of the same lock) waits for a remote writer lock's
    # release by a collected Saver (one attempt, no retries) before leaving it to be taken over
    # as stale.
    "lock_release_timeout_s": Knob("RECSAVE_LOCK_RELEASE_TIMEOUT_S", 10.0, float, lo=0),
    # Back large table storage with transparent huge pages (madvise): fewer TLB misses on random
    # row access (lookups, the bucket-order gather of a save).
    "hugepages": Knob("RECSAVE_HUGEPAGES", True, bool),
    # Tables created while this is on track changed rows and removed ids (incremental checkpoints);
    # off, every save of them is full.
    "track_changes": Knob("RECSAVE_TRACK_CHANGES", True, bool),
    # CUDA tables' id maps probe with the kernels of csrc/cuda/ where those are built (off: with
    # torch ops, the same rows, slower).
    "cuda_kernels": Knob("RECSAVE_CUDA_KERNELS", True, bool),
    # An async full save copies only the rows changed since the previous async save of the same
    # Saver into the host copy it keeps (change tracking decides which: rows written through
    # `weight` / `slot()` directly must be marked with mark_changed, as for incremental
    # checkpoints). Off: every async save copies every row.
    "stage_changed_rows": Knob("RECSAVE_STAGE_CHANGED_ROWS", False, bool),
    # Exit status of a process whose async save's background write failed with nobody hearing of
    # it (no later save, wait(), close() or read of its write future before the interpreter
    # exits); 0 keeps the interpreter's own status. Read at the async_save call.
    "async_failure_exit_code": Knob("RECSAVE_ASYNC_FAILURE_EXIT_CODE", 1, int, lo=0, hi=255),
    # Take the writer lock of output_dir when saving (one writing Saver per output dir).
    "writer_lock": Knob("RECSAVE_WRITER_LOCK", True, bool),
}

# RECSAVE_* variables that are read elsewhere, not knobs: setup.py's build switches and the C++
# engine's own (docs/API.md). Any other RECSAVE_* name is most likely a misspelt knob.
OTHER_VARIABLES = frozenset({"RECSAVE_CUDA_KERNELS_BUILD", "RECSAVE_CUDA_ARCHS", "RECSAVE_BUILD_JOBS",
                             "RECSAVE_CRC32C_PORTABLE", "RECSAVE_POPULATE", "RECSAVE_IDMAP_TEST_SMALL"})

_local = threading.local()
_environment_checked = False


def _overrides() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def get(name: str) -> Any:
    """Current value of knob `name`."""
    if not isinstance(name, str) or name not in _KNOBS:
        raise UsageError(f"unknown knob {name!r}; known knobs: {sorted(_KNOBS)}")
    for layer in reversed(_overrides()):
        if name in layer:
            return layer[name]
    if not _environment_checked:
        warn_unknown_variables()
    knob = _KNOBS[name]
    raw = os.environ.get(knob.env)
    return knob.default if raw is None else knob.parse(name, raw)


def unknown_variables(environ: Optional[Dict[str, str]] = None) -> Dict[str, Optional[str]]:
    """RECSAVE_* variables of `environ` (default os.environ) that name no knob and nothing else
    recsave reads, each with the knob variable it is closest to (None when none is close)."""
    known = _env_names()
    out: Dict[str, Optional[str]] = {}
    for var in sorted(os.environ if environ is None else environ):
        if var.startswith("RECSAVE_") and var not in known and var not in OTHER_VARIABLES:
            close = difflib.get_close_matches(var, known, n=1, cutoff=0.75)
            out[var] = close[0] if close else None
    return out


def warn_unknown_variables() -> None:
    """Once per process (at the first knob read from the environment): a RuntimeWarning naming each
    unknown RECSAVE_* variable, since it is ignored (a misspelt RECSAVE_FSYNC=0 would otherwise
    leave fsync on without a word)."""
    global _environment_checked
    _environment_checked = True
    for var, close in unknown_variables().items():
        hint = f"did you mean {close}?" if close else f"the knobs' variables: {', '.join(_env_names())}"
        warnings.warn(f"environment variable {var} names no recsave knob and is ignored; {hint}",
                      RuntimeWarning, stacklevel=3)


def _env_names() -> list:
    return sorted(k.env for k in _KNOBS.values())


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily sets knobs (in this thread). A value of the wrong type raises TypeError, one
    out of range UsageError (a ValueError), both naming the knob."""
    checked = {}
    for name, value in values.items():
        if name not in _KNOBS:
            raise UsageError(f"unknown knob {name!r}; known knobs: {sorted(_KNOBS)}")
        checked[name] = _KNOBS[name].check(name, value)
    _overrides().append(checked)
    try:
        yield
    finally:
        _overrides().pop()


def names() -> list:
    return sorted(_KNOBS)


def current() -> Dict[str, Any]:
    """Every knob's value as this thread sees it; ``override(**current())`` carries them into a
    background thread (an async save writes with the knobs in force when it was started)."""
    return {name: get(name) for name in _KNOBS}


def carried(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` bound to the knob values this thread sees now, to run on another thread (overrides are
    per thread; an async save writes with the knobs in force when it was started)."""
    values = current()

    def run(*args: Any, **kwargs: Any) -> T:
        with override(**values):
            return fn(*args, **kwargs)
    return run
