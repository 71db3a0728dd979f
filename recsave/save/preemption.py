"""Preemption notices: SIGTERM / SIGUSR1 set a flag that CheckpointManager.step() acts on.

The handler only records the signal (a save from inside a signal handler could interleave with
the very save it interrupted) and then calls the handler that was installed before, when that was
a Python callable. Handlers can only be installed from the main thread; close() puts the previous
ones back."""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Dict, Optional

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionFlag:
    """Set by SIGTERM / SIGUSR1 once installed (or by set()); cleared never: a preempted job ends."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

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
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.set(signum)
        previous = self._previous.get(signum)
        if callable(previous):  # SIG_DFL / SIG_IGN are ints: the default would end the process now
            previous(signum, frame)

    def uninstall(self) -> None:
        """Puts the previous handlers back (where ours is still the one installed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
