"""Filling an async save's host buffers ahead of it (Saver.prepare_async): one background thread
that copies the model into the Stager while training goes on, joined before anything else uses the
Stager. Its failure costs nothing but the head start: the next async save copies as usual."""
from __future__ import annotations

import logging
import threading
from typing import Mapping, Optional

import torch

from recsave import knobs
from recsave.save.snapshot import Stager
from recsave.tables.tablelike import TableLike

log = logging.getLogger("recsave")


class Prefill:
    """At most one prefill thread at a time."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None

    def start(self, stager: Stager, tables: Mapping[str, TableLike], dense: Mapping[str, torch.Tensor]) -> None:
        """Starts filling `stager` from these tables and dense tensors (after any earlier prefill)."""
        self.join()

        def run() -> None:
            try:
                stager.prefill(tables, dense)
            except Exception as exc:  # e.g. out of memory: the next async save copies as usual
                log.warning("recsave: prepare_async could not fill the host buffers (%s: %s); the next "
                            "async_save copies the tables it did not reach whole", type(exc).__name__, exc)
        thread = threading.Thread(target=knobs.carried(run), name="recsave-prefill", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # out of threads: no head start, nothing else changes
            log.warning("recsave: prepare_async could not start its thread (%s)", exc)
            return
        self._thread = thread

    def join(self) -> None:
        """Waits for the running prefill, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
