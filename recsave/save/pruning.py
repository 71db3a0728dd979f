"""Deleting the checkpoint directories rotation prunes without making the save wait for it.

On a local file system, unlinking a checkpoint's files frees their pages in the page cache: about
60 ms per GB on the development VM, a quarter of a steady-state save with `max_keep`
(benchmarks/README.md). The directory is renamed into the output dir's PRUNED_DIR instead (one
atomic step: its id is gone from the output dir at once, as with a plain delete) and a background
thread deletes it. Where no cheap rename exists (object stores) the deletion stays inline, the
index first.
docs/FORMAT.md section 1 names PRUNED_DIR; a save's collect_garbage removes one a dead process left.
"""
from __future__ import annotations

import itertools
import os
import warnings
from concurrent.futures import Future
from typing import Optional

from recsave import threads
from recsave.format.ckptlist import PRUNED_DIR
from recsave.format.index import INDEX_FILE
from recsave.storage import Storage

_names = itertools.count()


class Pruner:
    """Removes an output dir's pruned checkpoint directories: remove() is collect_garbage's removal
    (the directory moved aside, or deleted where it cannot be), start() deletes what was moved
    aside on a thread, join() waits for that thread (before the next collection and before the
    writer lock is released)."""

    def __init__(self, storage: Storage, output_dir: str):
        self.storage = storage
        self.root = storage.join(output_dir, PRUNED_DIR)
        self._moved = False  # remove() moved something aside since the last start()
        self._deleting: Optional["Future[None]"] = None

    def remove(self, path: str) -> None:
        name = f"{os.path.basename(path.rstrip('/'))}-{os.getpid()}-{next(_names)}"
        if self.storage.move_tree_aside(path, self.storage.join(self.root, name)):
            self._moved = True
            return
        # In place, the index first: a process that dies midway leaves a directory without an
        # index (a leftover the next collection removes), never an index whose files are partly
        # gone, which a rebuilt list would take for a committed checkpoint.
        self.storage.remove_file(self.storage.join(path, INDEX_FILE))
        self.storage.remove_tree(path)

    def start(self) -> None:
        """Deletes PRUNED_DIR on a thread if remove() moved directories into it. The writer lock is
        not held for it: a Saver dropped meanwhile releases the lock, and a next writer's
        collection may delete the same garbage at the same time, which only costs a failed unlink."""
        if self._moved:
            self._moved = False
            self._deleting = threads.start(self.storage.remove_tree, self.root, name="recsave-prune")

    def join(self) -> None:
        """Waits for the deletion started last; a failure is a warning (the next collection
        removes what is left)."""
        deleting, self._deleting = self._deleting, None
        if deleting is None:
            return
        try:
            deleting.result()
        except Exception as exc:
            warnings.warn(f"{self.root}: deleting pruned checkpoints failed ({exc}); the next save removes "
                          f"what is left", RuntimeWarning, stacklevel=2)

