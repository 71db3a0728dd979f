"""Tuning knobs in one place: a default, overridable by an environment variable, overridable in turn
by the :func:`override` context manager (what tests use).

    with recsave.knobs.override(segment_bytes=1 << 20):
        ...
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Dict, Iterator, TypeVar

from recsave.errors import UsageError

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    return text.strip().lower() not in ("0", "false", "no", "off", "")


# name -> (environment variable, default, parser)
_KNOBS: Dict[str, tuple] = {
    # Bytes covered by one CRC32C in a shard chunk; also the unit of parallel writes.
    "segment_bytes": ("RECSAVE_SEGMENT_BYTES", 4 << 20, int),
    # Smallest checksum segment cut at a bucket boundary: a reader needing a bucket range reads at
    # most one partial segment at each end, so this bounds the extra bytes of a reshard read.
    "min_segment_bytes": ("RECSAVE_MIN_SEGMENT_BYTES", 64 << 10, int),
    # A rank starts a new shard file part once the current one holds this many bytes.
    "max_shard_bytes": ("RECSAVE_MAX_SHARD_BYTES", 4 << 30, int),
    # Threads of the C++ engine per file operation when the caller does not say.
    "concurrency": ("RECSAVE_CONCURRENCY", 4, int),
    # fsync files and directories on commit (turn off only for throwaway runs / benchmarks).
    "fsync": ("RECSAVE_FSYNC", True, _parse_bool),
    # Reader limits, enforced before allocating (docs/FORMAT.md).
    "max_header_bytes": ("RECSAVE_MAX_HEADER_BYTES", 100 << 20, int),
    "max_index_bytes": ("RECSAVE_MAX_INDEX_BYTES", 256 << 20, int),
    # Durable shard files of a save queued for their fsync + rename before the queue is committed
    # early (each holds an open descriptor), and how many of those commits run at once.
    "max_queued_commits": ("RECSAVE_MAX_QUEUED_COMMITS", 64, int),
    "commit_threads": ("RECSAVE_COMMIT_THREADS", 16, int),
    # Seconds a collective of a save / load waits for the other ranks before raising.
    "collective_timeout_s": ("RECSAVE_COLLECTIVE_TIMEOUT_S", 300.0, float),
    # Rows of a GPU table, or of any table saved to remote storage, are gathered and written in
    # blocks of about this many bytes (two in flight). CPU tables saved to local disk are gathered
    # by the engine's writer threads through 256 KiB buffers of their own.
    "write_block_bytes": ("RECSAVE_WRITE_BLOCK_BYTES", 64 << 20, int),
    # Size of one in-memory chunk streamed to / from remote (fsspec) storage.
    "io_chunk_bytes": ("RECSAVE_IO_CHUNK_BYTES", 64 << 20, int),
    # Remote (fsspec) storage: retries of an operation after a transient failure (connection error,
    # timeout, HTTP 5xx / throttling), the first backoff and the longest single backoff (seconds).
    "io_retries": ("RECSAVE_IO_RETRIES", 5, int),
    "io_retry_base_s": ("RECSAVE_IO_RETRY_BASE_S", 0.2, float),
    "io_retry_max_s": ("RECSAVE_IO_RETRY_MAX_S", 10.0, float),
    # Seconds after its last renewal that a writer lock of an output dir counts as abandoned.
    "writer_lease_s": ("RECSAVE_WRITER_LEASE_S", 3600.0, float),
    # Seconds interpreter exit (or a new acquire of the same lock) waits for a remote writer lock's
    # release by a collected Saver (one attempt, no retries) before leaving it to be taken over
    # as stale.
    "lock_release_timeout_s": ("RECSAVE_LOCK_RELEASE_TIMEOUT_S", 10.0, float),
    # Back large table storage with transparent huge pages (madvise): fewer TLB misses on random
    # row access (lookups, the bucket-order gather of a save).
    "hugepages": ("RECSAVE_HUGEPAGES", True, _parse_bool),
    # Take the writer lock of output_dir when saving (one writing Saver per output dir).
    "writer_lock": ("RECSAVE_WRITER_LOCK", True, _parse_bool),
}

_local = threading.local()


def _overrides() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def get(name: str) -> Any:
    """Current value of knob `name`."""
    if name not in _KNOBS:
        raise UsageError(f"unknown knob {name!r}; known knobs: {sorted(_KNOBS)}")
    for layer in reversed(_overrides()):
        if name in layer:
            return layer[name]
    env, default, parse = _KNOBS[name]
    raw = os.environ.get(env)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise UsageError(f"environment variable {env}={raw!r} is not a valid {parse.__name__}") from exc


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily sets knobs (in this thread)."""
    for name in values:
        if name not in _KNOBS:
            raise UsageError(f"unknown knob {name!r}; known knobs: {sorted(_KNOBS)}")
    _overrides().append(dict(values))
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
