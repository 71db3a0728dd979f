"""Background work on plain threads that keeps working while the interpreter shuts down.

An async save may still be writing when a script's main thread ends; Python then joins the writer
thread, but ``concurrent.futures`` executors refuse new work from that moment ("cannot schedule
new futures after interpreter shutdown"), which would fail the save. :func:`start` runs the work on
a new thread instead, or here and now where no thread can be started at all, or where nothing
would wait for it: once the main thread has ended (an atexit handler, or a thread outliving the
main one), a thread started from an atexit handler is not joined and dies with the interpreter.
"""
from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Generic, Optional, Tuple, TypeVar

T = TypeVar("T")


def start(fn: Callable[..., T], *args: Any, name: str, daemon: bool = False,
          future: "Optional[Future[T]]" = None) -> "Future[T]":
    """Runs ``fn(*args)`` on a new thread (by default one the interpreter's exit waits for);
    returns a Future of its result or error (`future`, a new pending one if not given). If no
    thread can be started (a thread limit), or the main thread has ended (the interpreter is
    shutting down: a non-daemon thread started from an atexit handler would be killed, not waited
    for), runs it inline."""
    if future is None:
        future = Future()
    if not daemon and not threading.main_thread().is_alive():
        _settle(future, fn, args)
        return future
    try:
        threading.Thread(target=_settle, args=(future, fn, args), name=name, daemon=daemon).start()
    except RuntimeError:
        _settle(future, fn, args)
    return future


def run_here(fn: Callable[..., T], *args: Any) -> "Future[T]":
    """``fn(*args)`` run now, on this thread, as a finished Future: for a caller that takes either
    this or start()'s, where a thread would cost more than the work. Its error is the Future's;
    a KeyboardInterrupt or SystemExit is raised here and now, as it would be without the Future."""
    future: "Future[T]" = Future()
    future.set_running_or_notify_cancel()
    try:
        future.set_result(fn(*args))
    except Exception as exc:
        future.set_exception(exc)
    return future


def _settle(future: "Future[T]", fn: Callable[..., T], args: Tuple[Any, ...]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # handed to whoever waits on the future
        future.set_exception(exc)


class ThisProcess(Generic[T]):
    """A value that belongs to the process that set it, e.g. the future of one of its threads: in a
    process forked since, it reads None (that thread does not exist there, and waiting on its
    future would never end) until set there."""

    def __init__(self) -> None:
        self._value: Optional[T] = None
        self._pid = os.getpid()

    def get(self) -> Optional[T]:
        return self._value if os.getpid() == self._pid else None

    def set(self, value: Optional[T]) -> None:
        self._value, self._pid = value, os.getpid()


class ForkSafeRLock:
    """A reentrant lock (a context manager) that a forked child gets anew: one a thread held at
    the fork would stay held for ever there (that thread does not exist in the child), and every
    call that takes it would hang, e.g. a DataLoader worker touching a Saver that a training thread
    was saving with."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        _fork_safe_locks.add(self)

    def __enter__(self) -> "ForkSafeRLock":
        self._lock.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def _renew(self) -> None:
        self._lock = threading.RLock()


_fork_safe_locks: "weakref.WeakSet[ForkSafeRLock]" = weakref.WeakSet()


def _renew_fork_safe_locks() -> None:
    for lock in list(_fork_safe_locks):
        lock._renew()  # noqa: SLF001 (same module)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_fork_safe_locks)
