"""The background write of an async save: one at a time, its error kept until someone collects it
(and, until then, the process's exit status: save/unheard.py)."""
from __future__ import annotations

import logging
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Callable, Optional, Set, Tuple

from recsave import knobs, threads
from recsave.save.unheard import WriteFuture, heard, outcome, record
from recsave.storage import dist

log = logging.getLogger("recsave")

# The writes running in this process, any Saver's: wait_for_every_write(). A forked child's copy
# holds none (their threads are the parent's), and gets its lock anew (a write's thread may hold
# it at the fork: its done callback).
_running: threads.ThisProcess[Set[Future]] = threads.ThisProcess()
_running_lock = threads.ForkSafeRLock()


def wait_for_every_write() -> None:
    """With several ranks, waits until no background write of this process is running, whichever
    Saver started it (their outcomes stay for their own Savers to collect); at once without. Call
    it before collectives on recsave's gloo group, where every write runs its own: run alongside
    one, the ranks would pair the two threads' collectives in whatever order each reaches them,
    failing both or committing one checkpoint's index from the other's parts. After it, a call's
    collectives follow the writes started before it, on every rank alike."""
    if not dist.collective(dist.group()[1]):
        return
    with _running_lock:
        running = list(_running.get() or ())
    futures_wait(running)


def _track(future: Future) -> None:
    with _running_lock:
        running = _running.get() or set()
        running.add(future)
        _running.set(running)

    def done(f: Future) -> None:
        with _running_lock:
            (_running.get() or set()).discard(f)
    future.add_done_callback(done)


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
                # would otherwise never hear of it (nor its exit status: save/unheard.py).
                record(future, ckpt_id, exc, exit_code)
                log.error("recsave: the background write of async_save(%r) failed (%s: %s); the previous "
                          "committed checkpoint is still the latest; the error is raised by the next save, "
                          "wait() or close()", ckpt_id, type(exc).__name__, exc)
                raise
        _track(future)
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
        record(future, ckpt_id, error, knobs.get("async_failure_exit_code"))
        self._pending.set((ckpt_id, future))

    def collect(self, consume: bool) -> Optional[str]:
        """Waits for the write. With `consume` its result is collected: the path is returned or its
        error raised, with a note naming the write. Without, a success is forgotten and an error
        stays pending for the next collect(consume=True). None when nothing was pending."""
        pending = self._pending.get()
        if pending is None:
            return None
        ckpt_id, future = pending
        exc = outcome(future)
        if not consume:
            if exc is None:
                self._pending.set(None)
            return None
        self._pending.set(None)
        heard(future)
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
