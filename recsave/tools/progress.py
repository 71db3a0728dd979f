"""A one-line progress bar on stderr for long command-line operations, shown only on a terminal."""
from __future__ import annotations

import sys
import time
from typing import IO, Optional


class Progress:
    """``p = Progress("verify", total, unit="MB", scale=1e6); p.advance(n); p.close()``.

    Draws at most ten times a second and only when `stream` is a terminal, so logs and pipes stay
    clean."""

    def __init__(self, label: str, total: int, *, unit: str = "", scale: float = 1.0,
                 stream: Optional[IO[str]] = None):
        self.label, self.total, self.unit, self.scale = label, max(int(total), 0), unit, scale
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self._drawn = 0.0

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._drawn > 0.1 or self.done >= self.total):
            self._drawn = now
            self._draw()

    def _draw(self) -> None:
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r{self.label} [{bar:<30}] {frac * 100:5.1f}% "
                          f"{self.done / self.scale:.1f}/{self.total / self.scale:.1f}{self.unit}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
