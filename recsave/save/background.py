"""The background write of an async save: one at a time, its error kept until someone collects it.

A write that fails where nobody hears of it (no later save, ``wait()``, ``close()`` or read of its
future before the interpreter exits) would let a job end with status 0 while its last checkpoint
is missing: the process then exits with the knob ``async_failure_exit_code`` (docs/API.md).
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from recsave import knobs, threads

log = logging.getLogger("recsave")


@dataclass(frozen=True)
class UnheardFailure:
    """A background write that failed and whose error no caller has taken yet."""
    ckpt_id: str
    error: str       # "<type>: <message>"
    exit_code: int   # the knob async_failure_exit_code at the async_save call (0: none)
    pid: int         # the process whose write it was (a forked child inherits the record)


_unheard: Dict[int, UnheardFailure] = {}  # id(write future) -> failure
_unheard_lock = threading.Lock()


class WriteFuture(Future):
    """The future async_save returns for its write: reading its outcome (``result()`` or
    ``exception()``) counts as hearing of a failure, as the next save, ``wait()`` or ``close()``
    does."""

    def result(self, timeout: Optional[float] = None) -> Any:
        try:
            return super().result(timeout)
        finally:
            if self.done():
                _heard(self)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        exc = super().exception(timeout)
        _heard(self)
        return exc


def _outcome(future: Future) -> Optional[BaseException]:
    """The future's error once it is done, without counting as hearing it (WriteFuture)."""
    return Future.exception(future)


def _record_failure(future: Future, ckpt_id: str, exc: BaseException, exit_code: int) -> None:
    with _unheard_lock:
        _unheard[id(future)] = UnheardFailure(ckpt_id, f"{type(exc).__name__}: {exc}", exit_code, os.getpid())


def _heard(future: Future) -> None:
    with _unheard_lock:
        _unheard.pop(id(future), None)


def unheard_failures() -> List[UnheardFailure]:
    """This process's failed background writes whose errors nobody has taken yet (oldest first)."""
    with _unheard_lock:
        return [f for f in _unheard.values() if f.pid == os.getpid()]


def forget_unheard_failures() -> None:
    """Drops every record of unheard failures: the interpreter's exit then keeps its own status
    (for a harness that ran failing jobs on purpose, e.g. a test suite)."""
    with _unheard_lock:
        _unheard.clear()


@atexit.register
def _exit_if_unheard() -> None:
    """At interpreter exit (after its non-daemon threads, the writes among them, have ended):
    a failure nobody heard of ends the process with its exit code. os._exit is the only way an
    exit handler can set the status; it skips the exit handlers registered before recsave was
    imported, so logging and the standard streams are flushed here first."""
    failures = [f for f in unheard_failures() if f.exit_code]
    if not failures:
        return
    code = failures[-1].exit_code
    named = "; ".join(f"async_save({f.ckpt_id!r}) failed ({f.error})" for f in failures)
    message = (f"recsave: exiting with status {code}: the background write of {named}, and no later save, "
               f"wait(), close() or read of its write future took the error; the previous committed "
               f"checkpoint is still the latest (knob async_failure_exit_code=0 keeps the interpreter's "
               f"own exit status)\n")
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.write(message)
        sys.stderr.flush()
    finally:
        os._exit(code)


class BackgroundWrite:
    """Runs one checkpoint write at a time on a thread of its own and holds its outcome. A plain
    thread (recsave/threads.py), not an executor: an async save started while the interpreter
    shuts down (from a worker thread that outlives the main one, or an atexit handler) must still
    run, and the interpreter's exit waits for it."""

    def __init__(self) -> None:
        # (ckpt_id, future) of the last write; a forked child's copy holds none (the write's
        # thread is the parent's)
        self._pending: threads.ThisProcess[Tuple[str, Future]] = threads.ThisProcess()

    def pending_future(self) -> Future:
        """The future of the last write (one is pending)."""
        pending = self._pending.get()
        assert pending is not None
        return pending[1]

    @property
    def pending_id(self) -> Optional[str]:
        """The id being written (or written last), until collected."""
        pending = self._pending.get()
        return pending[0] if pending is not None else None

    def submit(self, ckpt_id: str, write: Callable[[], str]) -> Future:
        """Starts `write` (callers collect the previous write first)."""
        future = WriteFuture()
        exit_code = knobs.get("async_failure_exit_code")

        def logged() -> str:
            try:
                return write()
            except BaseException as exc:
                # Logged when it happens: a job that exits before its next save / wait() / close()
                # would otherwise never hear of it (and its exit status says so: _exit_if_unheard).
                _record_failure(future, ckpt_id, exc, exit_code)
                log.error("recsave: the background write of async_save(%r) failed (%s: %s); the previous "
                          "committed checkpoint is still the latest; the error is raised by the next save, "
                          "wait() or close()", ckpt_id, type(exc).__name__, exc)
                raise
        threads.start(logged, name="recsave-async-save", future=future)
        self._pending.set((ckpt_id, future))
        return future

    def fail(self, ckpt_id: str, error: BaseException) -> None:
        """Records a write of `ckpt_id` that failed with `error` without running:
        what the other ranks hold once their write learnt of this rank's refusal, so that this
        rank's write future, next save, wait() or close() raise it as theirs do, with no collective
        (the ranks stay in step)."""
        future = WriteFuture()
        future.set_exception(error)
        _record_failure(future, ckpt_id, error, knobs.get("async_failure_exit_code"))
        self._pending.set((ckpt_id, future))

    def collect(self, consume: bool) -> Optional[str]:
        """Waits for the write. With `consume` its result is collected: the path is returned or its
        error raised, with a note naming the write. Without, a success is forgotten and an error
        stays pending for the next collect(consume=True). None when nothing was pending."""
        pending = self._pending.get()
        if pending is None:
            return None
        ckpt_id, future = pending
        exc = _outcome(future)
        if not consume:
            if exc is None:
                self._pending.set(None)
            return None
        self._pending.set(None)
        _heard(future)
        if exc is not None:
            note = (f"(raised by the background write of async_save({ckpt_id!r}); the previous "
                    f"committed checkpoint is still the latest)")
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(note)
            else:
                setattr(exc, "__notes__", [*getattr(exc, "__notes__", []), note])  # noqa: B010
            raise exc
        return str(future.result())

    def shutdown(self) -> None:
        """Waits for the last write's thread to end (its outcome stays for collect)."""
        pending = self._pending.get()
        if pending is not None:
            futures_wait([pending[1]])
