"""Commits of durable shard files (fsync, rename into place, directory fsync), held back and then
run together.

A save writes one file per table; an fsync per file as soon as it is written makes every file wait
for its own journal commit and device cache flush (about 0.3-1 s each on a virtual disk), during
which the disk takes no new writes. Files written with the writeback hint (the engine's durable
mode) have their pages on the way to disk already; their fsyncs issued together at the end are
merged by the file system into few journal commits and flushes. Measured on the 2 GB benchmark
state (4 tables): 5.2-5.8 s with an fsync per file, 4.3-4.9 s together.

Until :meth:`DeferredCommits.wait` returns, the files are neither durable nor under their names:
callers wait before anything that makes them part of a checkpoint (the index, the commit point).
"""
from __future__ import annotations

import threading
from concurrent.futures import wait as futures_wait
from types import TracebackType
from typing import Any, List, Optional, Type

from recsave import knobs, threads


def _commit(writer: Any) -> None:
    try:
        writer.commit()
    except BaseException:
        writer.abort()  # removes the temporary file
        raise


class DeferredCommits:
    """Queues written `_C.ShardWriter`s and commits them together.

    Used as a context manager: leaving the block without an error commits every queued file (the
    first failure is raised once all have finished; a failed file's temporary is removed). Leaving
    it with an error aborts the queued files instead, so nothing is renamed into place while the
    caller cleans up."""

    def __init__(self) -> None:
        self._queued: List[Any] = []

    def submit(self, writer: Any) -> None:
        """Queues `writer`'s commit (it must have been written completely)."""
        self._queued.append(writer)
        if len(self._queued) >= knobs.get("max_queued_commits"):
            self.wait()

    def wait(self) -> None:
        """Commits every queued file; raises the first failure after all have finished. An
        interrupt while waiting still lets every queued commit finish before it propagates (no
        file is renamed into place while the caller cleans up)."""
        queued, self._queued = self._queued, []
        if not queued:
            return
        errors: List[Optional[BaseException]] = [None] * len(queued)
        todo = iter(range(len(queued)))
        take = threading.Lock()

        def worker() -> None:
            while True:
                with take:
                    i = next(todo, None)
                if i is None:
                    return
                try:
                    _commit(queued[i])
                except BaseException as exc:  # reported below, after every commit has finished
                    errors[i] = exc

        count = min(len(queued), knobs.get("commit_threads"))
        workers = [threads.start(worker, name="recsave-commit") for _ in range(count)]
        try:
            futures_wait(workers)
        except BaseException:  # an interrupt: the started commits finish before it propagates
            futures_wait(workers)
            raise
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def abort(self) -> None:
        """Drops the queued files (their temporaries are removed)."""
        queued, self._queued = self._queued, []
        for writer in queued:
            writer.abort()

    def __enter__(self) -> "DeferredCommits":
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if kind is None:
            self.wait()
        else:
            self.abort()
