"""Failed async writes that nobody has heard of yet, and the exit status they give the process.

A job that ends right after ``async_save`` (no later save, ``wait()``, ``close()`` or read of the
write future) would otherwise exit with status 0 while its last checkpoint is missing, and its
scheduler would take the run for a success. While such a failure is unheard, the engine holds an
exit status for the end of the interpreter's shutdown (``_C.arm_exit_status``, a Py_AtExit
function: it runs after every exit handler, thread join and file flush, which ``os._exit`` from an
exit handler would skip); the knob ``async_failure_exit_code`` gives it, 0 none (docs/API.md).
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from recsave import _C, threads

log = logging.getLogger("recsave")


@dataclass(frozen=True)
class UnheardFailure:
    """A background write that failed and whose error no caller has taken yet."""
    ckpt_id: str
    error: str       # "<type>: <message>"
    exit_code: int   # the knob async_failure_exit_code at the async_save call (0: none)
    pid: int         # the process whose write it was (a forked child inherits the record)


# Keyed by the future itself (a strong reference): a freed future's id could be a new one's.
_unheard: Dict[Future, UnheardFailure] = {}
# Renewed in a forked child: a fork taken while a write thread held it would leave it held.
_lock = threads.ForkSafeRLock()


class WriteFuture(Future):
    """The future async_save returns for its write: reading its outcome (``result()`` or
    ``exception()``) counts as hearing of a failure, as the next save, ``wait()`` or ``close()``
    does. A wait that times out hears nothing."""

    def result(self, timeout: Optional[float] = None) -> Any:
        super().exception(timeout)  # waits; raises only on a timeout or cancellation
        heard(self)
        return super().result(0)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        exc = super().exception(timeout)
        heard(self)
        return exc


def outcome(future: Future) -> Optional[BaseException]:
    """The future's error once it is done, without counting as hearing it (WriteFuture)."""
    return Future.exception(future)


def record(future: Future, ckpt_id: str, exc: BaseException, exit_code: int) -> None:
    """`future`'s write of `ckpt_id` failed with `exc`: unheard until heard(future)."""
    with _lock:
        _unheard[future] = UnheardFailure(ckpt_id, f"{type(exc).__name__}: {exc}", exit_code, os.getpid())
        _arm()


def heard(future: Future) -> None:
    """Someone took `future`'s outcome."""
    with _lock:
        if _unheard.pop(future, None) is not None:
            _arm()


def unheard_failures() -> List[UnheardFailure]:
    """This process's failed background writes whose errors nobody has taken yet (oldest first)."""
    with _lock:
        return _mine()


def forget_unheard_failures() -> None:
    """Drops every record of unheard failures: the interpreter's exit then keeps its own status
    (for a harness that ran failing jobs on purpose, e.g. a test suite)."""
    with _lock:
        _unheard.clear()
        _arm()


def _mine() -> List[UnheardFailure]:
    return [f for f in _unheard.values() if f.pid == os.getpid()]


def _arm() -> None:
    """Holds the exit status of the unheard failures in the engine, or none (with _lock held)."""
    failures = [f for f in _mine() if f.exit_code]
    if not failures:
        _C.disarm_exit_status()
        return
    code = failures[-1].exit_code
    named = "; ".join(f"async_save({f.ckpt_id!r}) failed ({f.error})" for f in failures)
    armed = _C.arm_exit_status(code, (
        f"recsave: exiting with status {code}: the background write of {named}, and no later save, wait(), "
        f"close() or read of its write future took the error; the previous committed checkpoint is still "
        f"the latest (knob async_failure_exit_code=0 keeps the interpreter's own exit status)\n"))
    if not armed:  # every Py_AtExit slot of the interpreter is taken (32)
        log.warning("recsave: cannot set the exit status for the failed background write of async_save(%r): the "
                    "interpreter has no exit-function slot left; the process will exit with its own status",
                    failures[-1].ckpt_id)
