"""Background work on plain threads that keeps working while the interpreter shuts down.

An async save may still be writing when a script's main thread ends; Python then joins the writer
thread, but ``concurrent.futures`` executors refuse new work from that moment ("cannot schedule
new futures after interpreter shutdown"), which would fail the save. :func:`start` runs the work on
a new thread instead, or here and now where no thread can be started at all.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def start(fn: Callable[..., T], *args: Any, name: str, daemon: bool = False) -> "Future[T]":
    """Runs ``fn(*args)`` on a new thread (by default one the interpreter's exit waits for);
    returns a Future of its result or error. If no thread can be started (a shutting-down
    interpreter, a thread limit), runs it inline."""
    future: "Future[T]" = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)

    try:
        threading.Thread(target=run, name=name, daemon=daemon).start()
    except RuntimeError:
        run()
    return future
