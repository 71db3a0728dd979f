"""The lifecycle part of HashTable: the table step, row metadata (``last_step``, ``count``), change
tracking for incremental checkpoints (tables/tracking.py) and eviction.

A mixin of HashTable only (it uses the table's own id map, row storage and tracker); kept apart so
hashtable.py stays about lookups, gradients and loads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

from recsave.argcheck import check
from recsave.errors import ArgumentTypeError, UsageError
from recsave.tables.idmap import check_ids
from recsave.tables.modes import outside_inference_mode
from recsave.tables.rows import RowStorage
from recsave.tables.tracking import ChangeTracker, TableChanges


class TableLifecycle:
    """Step, metadata, changes and eviction of a HashTable (see the module docstring)."""

    # Set by HashTable.__init__.
    table_name: Optional[str]
    _map: Any
    _store: RowStorage
    _tracker: ChangeTracker
    _step: int
    _device: torch.device

    if TYPE_CHECKING:  # HashTable's own methods, which these use
        def __len__(self) -> int: ...
        def lookup(self, ids: torch.Tensor, insert: bool) -> torch.Tensor: ...
        def delete(self, ids: torch.Tensor) -> int: ...

    @property
    def step(self) -> int:
        """The table step: sparse optimizers advance it once per step() that updates the table;
        a training lookup records it as the row's ``last_step``."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        check(value, int, "step", "HashTable.step")
        if value < 0:
            raise UsageError(f"table {self.table_name!r}: step must be >= 0, got {value}", key=self.table_name)
        self._step = value

    def advance_step(self, n: int = 1) -> None:
        """Advances the table step by `n` (the sparse optimizers call this)."""
        check(n, int, "n", "HashTable.advance_step")
        self.step = self._step + n

    def meta_columns(self) -> Dict[str, torch.Tensor]:
        """Row metadata storage, row-aligned with columns(): ``last_step`` and ``count`` as
        [row_capacity, 1] int64 views."""
        cap = self._map.row_capacity
        return {m: t[:cap] for m, t in self._store.meta_columns().items()}

    def row_meta(self, rows: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Copies (CPU, [len(rows), 1] int64) of ``last_step`` and ``count`` at `rows` (int64 or
        int32, in [0, row_capacity): ArgumentTypeError / UsageError otherwise)."""
        return self._store.gather_meta(self._checked_rows(rows, "row_meta"))

    def mark_changed(self, ids: torch.Tensor) -> int:
        """Marks the rows of `ids` changed (after writing through ``weight`` / ``slot()``
        directly), so the next incremental checkpoint saves them; returns how many ids are present."""
        check_ids(ids, "HashTable.mark_changed")
        rows = self.lookup(ids, insert=False)
        rows = rows[rows >= 0].to(self._device)
        self._tracker.mark(rows)
        return int(rows.numel())

    def mark_rows_changed(self, rows: torch.Tensor) -> None:
        """Marks live `rows` changed (the sparse optimizers call this for the rows they update):
        int64 or int32, in [0, row_capacity) (-1, lookup's answer for an absent id, is refused).
        The range is checked on the CPU only: on a GPU the check would wait for the device at
        every optimizer step."""
        rows = self._checked_rows(rows, "mark_rows_changed", in_range=self._device.type == "cpu")
        self._tracker.mark(rows.to(self._device))

    def _checked_rows(self, rows: Any, method: str, in_range: bool = True) -> torch.Tensor:
        """`rows` when it is an int64 or int32 tensor (ArgumentTypeError) of rows in
        [0, row_capacity) (UsageError; checked with `in_range`)."""
        where = f"HashTable {self.table_name!r}.{method}"
        check(rows, torch.Tensor, "rows", where, expected="an int64 tensor of rows")
        if rows.dtype not in (torch.int64, torch.int32):
            raise ArgumentTypeError(f"{where}: rows must be an int64 (or int32) tensor, got {str(rows.dtype)[6:]}",
                                    key="rows")
        if in_range and rows.numel():
            low, high = (int(v) for v in torch.aminmax(rows))
            if low < 0 or high >= self._map.row_capacity:
                raise UsageError(f"{where}: rows must lie in [0, {self._map.row_capacity}), got {low}..{high} "
                                 f"(-1 is lookup's answer for an absent id: drop those rows first)", key="rows")
        return rows

    def pending_changes(self) -> TableChanges:
        """What changed since the baseline (the baseline does not move)."""
        return self._tracker.changes(self._store.row_ids, self._map.lookup)

    def take_changes(self) -> TableChanges:
        """What changed since the baseline, and moves the baseline to now (``change_epoch`` takes a
        new value). A save calls it when its snapshot is taken."""
        changes = self.pending_changes()
        self._tracker.reset()
        return changes

    def reset_changes(self) -> None:
        """Moves the baseline to now (e.g. right after a restore): nothing counts as changed."""
        self._tracker.reset()

    @property
    def change_epoch(self) -> int:
        """Names the current baseline; unique across tables and never reused, so a Saver can tell
        whether anything but itself moved it."""
        return self._tracker.epoch

    @outside_inference_mode
    def evict(self, older_than_steps: Optional[int] = None, min_count: Optional[int] = None) -> int:
        """Removes the rows not looked up in training in the last `older_than_steps` table steps
        (``last_step < step - older_than_steps``) or looked up fewer than `min_count` times; either
        condition suffices. Returns how many ids were removed (they become tombstones)."""
        check(older_than_steps, int, "older_than_steps", "HashTable.evict", optional=True)
        check(min_count, int, "min_count", "HashTable.evict", optional=True)
        for arg, value in (("older_than_steps", older_than_steps), ("min_count", min_count)):
            if value is not None and value < 0:
                raise UsageError(f"HashTable.evict: {arg} must be >= 0, got {value}", key=arg)
        if (older_than_steps is None and min_count is None) or not len(self):
            return 0
        ids, rows = self._map.export()
        rows_d = rows.to(self._device)
        drop = torch.zeros(rows.numel(), dtype=torch.bool, device=self._device)
        if older_than_steps is not None:
            drop |= self._store.meta["last_step"][rows_d] < self._step - older_than_steps
        if min_count is not None:
            drop |= self._store.meta["count"][rows_d] < min_count
        return self.delete(ids[drop.to(ids.device)]) if bool(drop.any()) else 0

