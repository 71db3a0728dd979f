"""Preemption notices: SIGTERM / SIGUSR1 set a flag that CheckpointManager.step() acts on.

The handler only records the signal (a save from inside a signal handler could interleave with
the very save it interrupted) and then calls the handler that was installed before, when that was
a Python callable. Handlers can only be installed from the main thread; close() puts the previous
ones back."""
from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any, Dict, List, Optional

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


# Flags whose handlers are installed, oldest first: each may be the "previous" handler of a later one.
_installed: List["PreemptionFlag"] = []
# True while a live flag's handler passes a signal down the chain (handlers run on the main thread,
# one at a time): a retired handler further down must not end the process under it.
_live_handler_running = False


# Forked children (DataLoader / multiprocessing workers): the handler is the parent's, and nothing
# in a child acts on the flag. Around a fork the signals are blocked, so one sent to the child
# early stays pending (CPython drops the Python-level signals a child got before its after-fork
# step), the child gets the handlers from before recsave's back, and then the pending signal
# takes effect: terminate() of a worker ends it at once. (PreemptionFlag._handle also acts as
# the previous handler in a process other than its own, for a handler installed over ours.)
_fork = threading.local()


def _before_fork() -> None:
    if _installed and hasattr(signal, "pthread_sigmask"):
        _fork.mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def _after_fork_in_parent() -> None:
    mask, _fork.mask = getattr(_fork, "mask", None), None
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _after_fork_in_child() -> None:
    mask, _fork.mask = getattr(_fork, "mask", None), None
    try:
        for sig in SIGNALS:
            handler: Any = signal.getsignal(sig)
            ours = False
            while isinstance(flag := getattr(handler, "__self__", None), PreemptionFlag):
                handler, ours = flag._previous.get(sig), True  # noqa: SLF001 (same module)
            if ours:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    except (ValueError, OSError, TypeError):  # no handler to put back: ours stays, and acts as the previous
        pass
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


class PreemptionFlag:
    """Set by SIGTERM / SIGUSR1 once installed (or by set()); cleared never: a preempted job ends."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}
        self._retired = False  # uninstalled (or its manager collected): acts as the handler before it
        self._pid = os.getpid()  # a forked child inherits the handler, but not the manager that acts on it

    @property
    def is_set(self) -> bool:
        return self.signum is not None

    def set(self, signum: int = int(signal.SIGTERM)) -> None:
        if self.signum is None:
            self.signum = signum

    def install(self) -> bool:
        """Installs the handlers; False (nothing installed) when not on the main thread."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return False
        self._pid = os.getpid()
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        _installed.append(self)
        return True

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        global _live_handler_running
        previous = self._previous.get(signum)
        if self._retired or os.getpid() != self._pid:
            # Still reachable (installed, its uninstall having run off the main thread, or behind a
            # handler that chains to it), or inherited by a forked child (a DataLoader or
            # multiprocessing worker, where nothing would act on the flag and terminate() would
            # hang): behave as if it were not there, doing what the one before it would, the
            # default (ending the process) included, unless a live manager's handler in front is
            # passing the signal on: that one saves first.
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN and not _live_handler_running:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        self.set(signum)
        if callable(previous):  # SIG_DFL / SIG_IGN are ints: the default would end the process now
            running, _live_handler_running = _live_handler_running, True
            try:
                previous(signum, frame)
            finally:
                _live_handler_running = running

    def uninstall(self) -> None:
        """Puts the previous handlers back where ours is the one installed; where a later flag's
        handler was installed over ours, that flag's "previous" becomes ours (closing managers in
        any order, or a manager collected without close(), leaves no dead handler behind). Off the
        main thread nothing can be changed: the handler then only passes signals on."""
        self._retired = True
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            for later in _installed:
                if later is not self and later._previous.get(sig) == self._handle:  # noqa: SLF001 (same class)
                    later._previous[sig] = previous  # noqa: SLF001 (same class)
        if self in _installed:
            _installed.remove(self)
        self._previous = {}
