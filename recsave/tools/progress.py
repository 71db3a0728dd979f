"""A one-line progress bar on stderr for long command-line operations, shown only on a terminal."""
from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import IO, Optional, Type


class Progress:
    """``with Progress("verify", total, unit="MB", scale=1e6) as p: p.advance(n)`` (or close()).

    Draws at most ten times a second and only when `stream` is a terminal, so logs and pipes stay
    clean. Leaving the `with` block on an error ends the bar's line without drawing it complete, so
    the error message starts on a line of its own."""

    def __init__(self, label: str, total: int, *, unit: str = "", scale: float = 1.0,
                 stream: Optional[IO[str]] = None):
        self.label, self.total, self.unit, self.scale = label, max(int(total), 0), unit, scale
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self._drawn = 0.0
        self._closed = False

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
        """Draws the final state and ends the line (once)."""
        if self.enabled and not self._closed:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
        self._closed = True

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if kind is None:
            self.close()
        elif self.enabled and not self._closed:  # failed: end the line, keep what was drawn
            self._closed = True
            if self.done:
                self.stream.write("\n")
                self.stream.flush()
