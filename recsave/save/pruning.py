"""Deleting the checkpoint directories rotation prunes without making the save wait for it.

On a local file system, unlinking a checkpoint's files frees their pages in the page cache: about
60 ms per GB on the development VM, a quarter of a steady-state save with `max_keep`
(benchmarks/README.md). The directory is renamed into the output dir's PRUNED_DIR instead (one
atomic step: its id is gone from the output dir at once, as with a plain delete) and a background
thread deletes it. Where no cheap rename exists (object stores: a copy per object) the index is
deleted at once (the checkpoint is then an uncommitted leftover, which no list or load takes) and
the rest of its objects on the thread; that thread keeps the writer lock held until it is done,
so that no writer can reuse the directory's name while its objects are being deleted.
docs/FORMAT.md section 1 names PRUNED_DIR; a save's collect_garbage removes one a dead process left.
"""
from __future__ import annotations

import itertools
import os
import warnings
from concurrent.futures import Future
from typing import List, Optional

from recsave import knobs, threads
from recsave.format.ckptlist import PRUNED_DIR
from recsave.format.index import INDEX_FILE
from recsave.storage import Storage
from recsave.storage.lock import WriterLock, busy_until

_names = itertools.count()


class Pruner:
    """Removes an output dir's pruned checkpoint directories: remove() is collect_garbage's removal
    (the directory moved aside, or its index deleted where it cannot be), start() deletes what was
    moved aside or left in place on a thread, join() waits for that thread (before the next
    collection and before the writer lock is released)."""

    def __init__(self, storage: Storage, output_dir: str):
        self.storage = storage
        self.root = storage.join(output_dir, PRUNED_DIR)
        self._moved = False  # remove() moved something aside since the last start()
        self._in_place: List[str] = []  # directories remove() left to delete where they are
        # The deletion started last; a forked child's copy waits for none (its thread is the parent's).
        self._deleting: threads.ThisProcess["Future[None]"] = threads.ThisProcess()

    def remove(self, path: str, lock: Optional[WriterLock] = None) -> None:
        """Takes `path` out of the output dir: moved aside, else its index deleted now and the rest
        by start()'s thread, which keeps `lock` held meanwhile; with no lock to keep (the knob
        writer_lock off) nothing would stop a writer from saving into the name while the thread
        deletes, so it is all deleted here."""
        name = f"{os.path.basename(path.rstrip('/'))}-{os.getpid()}-{next(_names)}"
        if self.storage.move_tree_aside(path, self.storage.join(self.root, name)):
            self._moved = True
            return
        # In place, the index first and now: the checkpoint is gone, and a process that dies
        # before the thread has deleted the rest leaves a directory without an index (a leftover
        # the next collection removes), never an index whose files are partly gone, which a
        # rebuilt list would take for a committed checkpoint.
        self.storage.remove_file(self.storage.join(path, INDEX_FILE))
        if lock is None:
            self.storage.remove_tree(path)
        else:
            self._in_place.append(path)

    def start(self, lock: Optional[WriterLock] = None) -> None:
        """Deletes on a thread what remove() moved into PRUNED_DIR or left in place.

        For what was moved aside the writer lock is not needed: a Saver dropped meanwhile releases
        it, and a next writer's collection may delete the same garbage at the same time, which
        only costs a failed unlink. A directory deleted in place still has its checkpoint's name,
        which a next writer could save into: then the thread keeps `lock` (the writer lock) alive,
        hence held (its renewal thread goes on), until it is done
        (storage/lock.py busy_until: a writer of this process waits for it, one of another finds
        the lock held)."""
        paths = ([self.root] if self._moved else []) + self._in_place  # what was moved aside first
        held = [lock] if self._in_place and lock is not None else []
        self._moved, self._in_place = False, []
        if not paths:
            return

        def delete() -> None:
            try:
                errors = []
                for path in paths:
                    if held and held[0].lost and path != self.root:
                        # Taken over: the new owner may save into these names. What is left
                        # of them has no index: a leftover its next save or gc removes.
                        break
                    try:
                        self.storage.remove_tree(path)
                    except Exception as exc:  # the others still go; the next collection retries
                        errors.append(exc)
                if errors:
                    raise errors[0]
            finally:
                held.clear()  # a dropped Saver's lock is released here, before the future is done

        lock_path = held[0].path if held else None  # (the thread may have cleared `held` already)
        deleting = threads.start(knobs.carried(delete), name="recsave-prune")
        self._deleting.set(deleting)
        if lock_path is not None:
            busy_until(lock_path, deleting)

    def join(self) -> None:
        """Waits for the deletion started last; a failure is a warning (the next collection
        removes what is left). Interrupted (KeyboardInterrupt), it still counts as running: the
        next join() waits for it again."""
        deleting = self._deleting.get()
        if deleting is None:
            return
        try:
            deleting.result()
        except Exception as exc:
            warnings.warn(f"{self.root}: deleting pruned checkpoints failed ({exc}); the next save removes "
                          f"what is left", RuntimeWarning, stacklevel=2)
        self._deleting.set(None)

    def running(self) -> bool:
        """Whether the deletion started last is still running."""
        deleting = self._deleting.get()
        return deleting is not None and not deleting.done()
