"""What the last committed save did (`Saver.last_save`), and its one log line."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Optional

log = logging.getLogger("recsave")


@dataclass(frozen=True)
class SaveInfo:
    """A committed save, as `Saver.last_save` / `CheckpointManager.last_save` report it.

    `bytes` counts the checkpoint's files (on ranks other than 0: only the shard and io-state files
    that rank wrote); `seconds` is the time from the save call (for an
    async save: from the start of its background write) to the commit; `stall_seconds` how long the
    training thread was blocked (the whole save when synchronous, the snapshot when async);
    `staged_rows` how many table rows an async save copied into its host buffers (every row, the
    changed ones of a delta, or with the knob `stage_changed_rows` those changed since the Saver's
    previous async save); None for a synchronous save."""
    ckpt_id: str
    path: str
    step: Optional[int]
    kind: str  # "full" or "delta"
    bytes: int
    seconds: float
    stall_seconds: float
    metrics: Optional[Mapping[str, float]] = None
    staged_rows: Optional[int] = None

    @property
    def gb_per_s(self) -> float:
        """Bytes written per second of the save, in GB/s (10**9 bytes)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def log_commit(info: SaveInfo) -> None:
    """One INFO line per committed checkpoint on the ``recsave`` logger."""
    log.info("recsave: committed %s (step %s, %s): %d bytes in %.3f s (%.3f GB/s), training stalled %.3f s",
             info.ckpt_id, "-" if info.step is None else info.step, info.kind, info.bytes, info.seconds,
             info.gb_per_s, info.stall_seconds)
