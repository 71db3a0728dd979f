"""What changed in a table since its baseline: the input of an incremental (delta) checkpoint.

A table marks a row changed when its id is inserted, looked up in training, updated by a sparse
optimizer or written by a load; ids removed by delete / evict become tombstones, and clear() (or a
restore, which clears first) sets ``cleared``. Taking the changes for a save moves the baseline to
that moment, so writes made while an async save runs land in the next delta. docs/FORMAT.md
("Delta checkpoints") gives the merge rule a chain of such deltas follows.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, List

import numpy as np
import torch

from recsave.tables.rows import put_rows

# Baselines are numbered from one counter shared by every table, so an epoch names one baseline of
# one table: a Saver that recorded it can tell when anything else moved the baseline since.
_EPOCHS = itertools.count(1)


@dataclass(frozen=True)
class TableChanges:
    """A table's changes since its baseline (all tensors int64 on the CPU).

    ids / rows: live ids whose row changed, by ascending row, and their rows. tombstones: ids
    removed since the baseline and not live now. cleared: every row the baseline had is gone (then
    `ids` holds every live id). epoch: the baseline these are relative to. tracked: False when the
    table does not track changes (knob ``track_changes``): the rest is then meaningless.
    """
    ids: torch.Tensor
    rows: torch.Tensor
    tombstones: torch.Tensor
    cleared: bool
    epoch: int
    tracked: bool


class ChangeTracker:
    """Changed rows (a bool mask over row storage) and removed ids of one table. A new tracker's
    baseline is the empty table: cleared, every row inserted later changed."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        self._changed = torch.zeros(0, dtype=torch.bool, device=device)
        self._removed: List[torch.Tensor] = []
        self.cleared = True
        self.epoch = next(_EPOCHS)

    def reserve(self, rows: int) -> None:
        """Room in the mask for rows [0, rows) (the table calls it as it grows, so mark() needs
        no bounds pass)."""
        if self.enabled and rows > self._changed.numel():
            size, old = max(rows, 2 * self._changed.numel()), self._changed
            if old.device.type == "cpu":
                # numpy zeroes and copies on this thread: torch.zeros wakes its intra-op threads, which
                # took 7-8 ms a table on a busy 2-core machine, after a restore's reads (mark_first).
                mask = np.zeros(size, dtype=np.bool_)
                mask[: old.numel()] = old.numpy()
                self._changed = torch.from_numpy(mask)
                return
            grown = torch.zeros(size, dtype=torch.bool, device=old.device)
            grown[: old.numel()] = old
            self._changed = grown

    def mark(self, rows: torch.Tensor) -> None:
        """Marks rows (on the table's device, in [0, reserved)) changed."""
        if self.enabled and rows.numel():
            put_rows(self._changed, rows, True)

    def mark_first(self, n: int) -> None:
        """Marks rows [0, n) changed (a restore fills exactly those)."""
        if self.enabled and n:
            self.reserve(n)
            if self._changed.device.type == "cpu":
                self._changed.numpy()[:n] = True
            else:
                self._changed[:n] = True

    def removed(self, ids: torch.Tensor, freed_rows: torch.Tensor) -> None:
        """`ids` (CPU) left the table, freeing `freed_rows`: they become tombstones, and the freed
        rows stop being changed until an id takes them again."""
        if not self.enabled or ids.numel() == 0:
            return
        self._removed.append(ids.detach().cpu().clone())
        if len(self._removed) > 64:  # many small deletes between saves: keep the list short
            self._removed = [torch.unique(torch.cat(self._removed))]
        freed = freed_rows.to(self._changed.device)
        freed = freed[freed < self._changed.numel()]
        put_rows(self._changed, freed, False)

    def clear(self) -> None:
        """Every id left the table."""
        self.cleared = True
        self._removed.clear()
        _zero(self._changed)

    def changes(self, row_ids: torch.Tensor, lookup: Callable[[torch.Tensor], torch.Tensor]) -> TableChanges:
        """The changes since the baseline. `row_ids[r]` is the id of row r; `lookup(ids)` gives
        their rows, -1 for absent ids (a removed id inserted again is live, not a tombstone)."""
        empty = torch.empty(0, dtype=torch.int64)
        if not self.enabled:
            return TableChanges(empty, empty, empty, True, self.epoch, False)
        rows = _nonzero(self._changed)  # removed rows are unmarked: these are live
        ids = row_ids[rows].cpu()
        tombstones = torch.unique(torch.cat(self._removed)) if self._removed else empty
        if tombstones.numel():
            tombstones = tombstones[lookup(tombstones).cpu() < 0]
        return TableChanges(ids, rows.cpu(), tombstones, self.cleared, self.epoch, True)

    def reset(self) -> None:
        """Moves the baseline to now: nothing changed, nothing removed."""
        self.cleared = False
        self._removed.clear()
        _zero(self._changed)
        self.epoch = next(_EPOCHS)


# Whole-mask passes on the CPU go through numpy: torch's intra-op threads cost a wake-up per op,
# which on a busy machine was 15-30 ms a call, far more than the pass itself.
def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return torch.nonzero(mask).reshape(-1)


def _zero(mask: torch.Tensor) -> None:
    if mask.device.type == "cpu":
        mask.numpy().fill(False)
    else:
        mask.zero_()
