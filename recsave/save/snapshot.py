"""What a save writes, captured at one moment: every table's ids with the storage its rows index,
the dense tensors, the registered extras and io states.

A synchronous save captures *live* state (no copies: nothing changes while it writes). An async
save captures into host buffers (``Stager``), so training may go on while the copy is written;
updates made after the capture never reach the checkpoint. Both write the same bytes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch

from recsave import knobs
from recsave.format import plainstate
from recsave.format.writer import RowSource
from recsave.tables.devcopy import DeviceGather, PinnedPair
from recsave.tables.hashtable import HashTable
from recsave.tables.rows import copy_range, copy_rows
from recsave.tables.tablelike import TableLike, refuse_meta_tensors
from recsave.tables.tracking import TableChanges


@dataclass
class TableState:
    """One table at one moment: ids with their rows (row order, CPU) and the storage those rows
    index for the embedding and every slot (live tensors, or staged host copies). A live state
    exports ids and rows from `table` when asked (a save holds one table's, not every table's)."""

    embedding_dim: int
    dtype: torch.dtype
    columns: Dict[str, torch.Tensor]
    ids: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None  # with ids and no table: None when ids[r] is in row r
    table: Optional[TableLike] = None
    meta: Dict[str, torch.Tensor] = field(default_factory=dict)  # row metadata: last_step, count
    step: Optional[int] = None          # the table step
    live_rows: int = 0                  # rows of the table (a delta writes only the changed ones)
    tombstones: Optional[torch.Tensor] = None  # a delta's ids removed since the parent (else None)
    cleared: bool = False               # a delta's table was cleared since the parent

    def id_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.table is not None:
            return self.table.id_rows()
        assert self.ids is not None
        return self.ids, self.rows if self.rows is not None else torch.arange(self.ids.numel(), dtype=torch.int64)

    def ids_by_row(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """id_rows, or (ids, None) when the id at position r is in row r for every r (a table
        that never freed a row, HashTable.dense_row_ids): no list of rows is made."""
        if self.table is not None:
            return ids_by_row(self.table)
        assert self.ids is not None
        return self.ids, self.rows

    def slot_names(self) -> List[str]:
        return sorted(c for c in self.columns if c != "embedding")

    def row_count(self) -> Optional[int]:
        """The rows a save writes of this table: the live table's, or those of `ids`; None when only
        reading the table would tell (a converter's table, read when its turn comes)."""
        if self.table is None:
            assert self.ids is not None
            return int(self.ids.numel())
        return len(self.table) if hasattr(type(self.table), "__len__") else None

    def row_source(self, column: str, rows: torch.Tensor, buffers: Optional[PinnedPair] = None) -> RowSource:
        """`column` at `rows` (CPU int64) without copying it: the engine gathers CPU storage as it
        writes; device storage is gathered on the device and copied through `buffers` (pinned,
        double-buffered) on a side stream."""
        storage = self.columns[column] if column in self.columns else self.meta[column]
        if storage.device.type == "cpu":
            return RowSource.take(storage, rows)
        return RowSource(storage.dtype, (rows.numel(),) + tuple(storage.shape[1:]),
                         DeviceGather(storage, rows, buffers or PinnedPair()))


def ids_by_row(table: TableLike) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The table's (ids, rows) in row order, or (ids, None) when the id at position r is in row r for
    every r (HashTable.dense_row_ids): no list of rows is made."""
    dense_row_ids = getattr(table, "dense_row_ids", None)
    ids = dense_row_ids() if callable(dense_row_ids) else None
    return (ids, None) if ids is not None else table.id_rows()


@dataclass
class SaveState:
    tables: Dict[str, TableState]
    dense: Dict[str, torch.Tensor]
    extras: Dict[str, Any]  # name -> state_dict()
    io_state: Dict[str, Any]  # name -> dump_io_state()
    parent: Optional[str] = None  # a delta's parent checkpoint id; None: a full checkpoint


@dataclass(frozen=True)
class Delta:
    """What a delta save writes of one table: the changed ids with their rows (into the table's
    storage), the ids removed since the parent, and whether the table was cleared since."""
    ids: torch.Tensor
    rows: torch.Tensor
    tombstones: torch.Tensor
    cleared: bool


def meta_columns(table: TableLike) -> Dict[str, torch.Tensor]:
    """The table's row metadata storage (last_step, count), [capacity, 1] int64; {} for a TableLike
    without row metadata."""
    columns = getattr(table, "meta_columns", None)
    return dict(columns()) if callable(columns) else {}


def change_epoch(table: TableLike) -> Optional[int]:
    """The table's change epoch (HashTable.change_epoch); None for a TableLike without one."""
    epoch = getattr(table, "change_epoch", None)
    return epoch if isinstance(epoch, int) else None


def used_rows(table: TableLike) -> int:
    """Rows of the table's storage that may hold a row: HashTable's row_capacity (the length of
    `weight`; rows beyond it hold nothing), or every row of a TableLike without `weight`."""
    weight = getattr(table, "weight", None)
    return len(weight) if weight is not None else len(table.columns()["embedding"])


def table_step(table: TableLike) -> Optional[int]:
    """The table step (HashTable.step); None for a TableLike without one."""
    step = getattr(table, "step", None)
    return int(step) if isinstance(step, int) else None


# Stager buffer keys: a table's columns and row metadata, and dense tensors, in separate namespaces
# (a table named "dense" and a dense tensor named "embedding" must not share a buffer).
def column_key(table: str, column: str) -> Tuple[str, ...]:
    return ("table", table, column)


def meta_key(table: str, column: str) -> Tuple[str, ...]:
    return ("table", table, "@meta", column)


def dense_key(name: str) -> Tuple[str, ...]:
    return ("dense", name)


@dataclass(frozen=True)
class _Mirror:
    """A table's host copy as a full async save left it: every row up to `used`, as the table held
    them at change epoch `epoch`, under the buffer keys `keys`."""
    epoch: int
    used: int
    keys: Tuple[Tuple[str, ...], ...]


class Stager:
    """Host buffers an async save copies the state into, reused from one save to the next (a save
    waits for the previous write before staging). With `pinned`, copies of CUDA tensors go to
    page-locked memory, which the D2H copy fills at full bus speed.

    A CPU table's buffers hold a whole copy of its rows after a full stage (its *mirror*). Given
    the rows changed since (change tracking, knob `stage_changed_rows`), the next stage of that
    table copies only those: stage_table()."""

    def __init__(self, pinned: bool = False):
        self.pinned = pinned
        self._buffers: Dict[Any, torch.Tensor] = {}
        self._device_copies: Set[torch.device] = set()  # devices with non-blocking copies in flight
        self._mirrors: Dict[str, _Mirror] = {}
        self.rows_copied: Dict[str, int] = {}  # per table: rows the last capture copied

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def mirror_epoch(self, name: str) -> Optional[int]:
        """The change epoch of table `name`'s mirror (None: no whole copy is kept)."""
        mirror = self._mirrors.get(name)
        return mirror.epoch if mirror is not None else None

    def forget(self, name: str) -> None:
        """Table `name`'s buffers no longer hold its whole copy (a delta staged its changed rows
        there)."""
        self._mirrors.pop(name, None)

    def stage_table(self, name: str, columns: Mapping[str, torch.Tensor], meta: Mapping[str, torch.Tensor],
                    used: int, epoch: Optional[int], changed_rows: Optional[torch.Tensor] = None,
                    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """Host copies of rows [0, used) of a table's columns and row metadata (each a [capacity, ...]
        storage). With `changed_rows` (CPU int64: every live row written since the mirror's epoch)
        and a mirror of the same columns in buffers that still fit, only those rows and the rows
        added since are copied into it; otherwise every row. The result becomes the table's mirror
        at `epoch` (its change epoch now) when every column is on the CPU."""
        cols: Dict[Tuple[str, ...], torch.Tensor] = {column_key(name, c): t for c, t in columns.items()}
        metas: Dict[Tuple[str, ...], torch.Tensor] = {meta_key(name, c): t for c, t in meta.items()}
        sources = {**cols, **metas}
        keys = tuple(sorted(sources, key=repr))
        mirror = self._mirrors.pop(name, None)  # recorded again only once this stage completes
        on_cpu = all(t.device.type == "cpu" for t in sources.values())
        staged = None
        if changed_rows is not None and mirror is not None and mirror.keys == keys and on_cpu:
            staged = self._restage(name, sources, mirror.used, used, changed_rows)
        if staged is None:
            # Room for the table's capacity: the buffer lasts until the table doubles. meta_columns()
            # are views up to row_capacity: room for the whole storage behind them.
            staged = {k: self.stage(k, t[:used], room=t.numel()) for k, t in cols.items()}
            staged.update({k: self.stage(k, t[:used], room=t.untyped_storage().nbytes() // t.element_size())
                           for k, t in metas.items()})
            self.rows_copied[name] = used
        if on_cpu and epoch is not None:
            self._mirrors[name] = _Mirror(epoch, used, keys)
        return {k[-1]: staged[k] for k in cols}, {k[-1]: staged[k] for k in metas}

    def prefill(self, tables: Mapping[str, TableLike], dense: Mapping[str, torch.Tensor]) -> None:
        """Allocates and fills the buffers a later capture of these tables and dense tensors copies
        into, while training may go on (Saver.prepare_async). Each table's copy becomes its mirror at
        the change epoch it had before the copy began: rows written meanwhile are changed since, so
        the next stage copies them again. CPU tensors only (device copies belong to the training
        stream)."""
        for name, table in tables.items():
            # The epoch before anything else: every row written from here on is changed since it.
            # `used` before the columns: storage taken later holds at least that many rows.
            epoch = change_epoch(table)
            used = used_rows(table)
            columns, meta = table.columns(), meta_columns(table)
            if any(t.device.type != "cpu" for t in [*columns.values(), *meta.values()]):
                continue
            self.stage_table(name, columns, meta, used, epoch)
        for n, t in dense.items():
            if t.device.type == "cpu":
                self.stage(dense_key(n), t)

    def _restage(self, name: str, sources: Mapping[Any, torch.Tensor], mirrored: int, used: int,
                 changed_rows: torch.Tensor) -> Optional[Dict[Any, torch.Tensor]]:
        """The mirror of rows [0, mirrored) brought up to rows [0, used) of `sources`: the changed
        rows below `mirrored` and every row from there on copied. None, nothing copied, when a
        buffer no longer fits."""
        if used < mirrored:
            return None
        views: Dict[Any, torch.Tensor] = {}
        for key, src in sources.items():
            buf = self._buffers.get(key)
            need = used * src[:1].numel()
            if buf is None or buf.dtype != src.dtype or buf.is_pinned() or buf.numel() < need:
                return None
            views[key] = buf[:need].view((used,) + tuple(src.shape[1:]))
        rows = changed_rows[changed_rows < mirrored]
        for key, src in sources.items():
            copy_rows(views[key], src, rows, knobs.get("concurrency"))
            if used > mirrored:
                copy_range(views[key], src, mirrored, used)
        self.rows_copied[name] = int(rows.numel()) + used - mirrored
        return views

    def stage(self, key: Any, src: torch.Tensor, room: Optional[int] = None) -> torch.Tensor:
        """A host copy of `src` in the buffer reused under `key`, allocated for `room` elements (at
        least src's): tables pass their storage's capacity, so the buffer lasts until the table
        doubles. Without `room` the buffer has src's exact size (torch.save writes whole buffers)."""
        src = src.detach()
        pin = self.pinned and src.device.type == "cuda"
        need = src.numel()
        size = need if room is None else max(room, need)
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != src.dtype or buf.is_pinned() != pin or buf.numel() < need \
                or (room is None and buf.numel() != need):
            self._buffers.pop(key, None)  # free the old one before allocating its successor
            buf = torch.empty(size, dtype=src.dtype, pin_memory=pin)
            self._buffers[key] = buf
        out = buf[:need].view(src.shape)
        out.copy_(src, non_blocking=pin)
        if src.device.type == "cuda":
            self._device_copies.add(src.device)
        return out

    def finish(self) -> None:
        """Waits for the non-blocking device copies issued by stage(), on every device they came
        from (torch.cuda.synchronize() alone waits for the current device only: tables on another
        GPU would be written from buffers still filling)."""
        for device in self._device_copies:
            torch.cuda.synchronize(device)
        self._device_copies.clear()

    def release(self) -> None:
        self._buffers.clear()
        self._mirrors.clear()


def _changed_rows(changes: TableChanges) -> Optional[torch.Tensor]:
    """The rows to copy into a table's mirror, or None when it must be copied whole."""
    return changes.rows if changes.tracked and not changes.cleared else None


def capture(tables: Mapping[str, TableLike], dense: Mapping[str, torch.Tensor],
            extras: Mapping[str, Any], io_states: Mapping[str, Any],
            stager: Optional[Stager] = None, deltas: Optional[Mapping[str, Delta]] = None,
            parent: Optional[str] = None, changed: Optional[Mapping[str, TableChanges]] = None) -> SaveState:
    """The state a save writes. Without a stager it refers to the live tensors and objects; with
    one, tables and dense tensors are copied into its buffers and extras / io states deep-copied.
    Extras and io states are checked first (format/plainstate.py): one the safe loader could not
    restore raises UsageError before anything is staged or written. With `deltas` (a delta save
    against checkpoint `parent`), each table contributes only its changed rows (an async save
    copies only those) and its tombstones. `changed` (with a stager): a table's changes since its
    stager's mirror, taken at this snapshot; only those rows are copied into the mirror
    (Stager.stage_table), which a delta's rows are then written from."""
    refuse_meta_tensors(dense, "save")
    extra_state = {n: plainstate.encode(o.state_dict(), "extra", n, "state_dict", "load_state_dict")
                   for n, o in extras.items()}
    io_state = {n: plainstate.encode(o.dump_io_state(), "io state", n, "dump_io_state", "load_io_state")
                for n, o in io_states.items()}
    states: Dict[str, TableState] = {}
    if stager is not None:
        stager.rows_copied.clear()
    for name, table in tables.items():
        columns = table.columns()
        meta = meta_columns(table)
        step, live = table_step(table), len(table)
        delta = deltas.get(name) if deltas is not None else None
        if delta is not None:
            ids, rows = delta.ids, delta.rows
            if stager is not None and changed is not None and name in changed:
                # The table's whole copy is current but for these rows: bring it up to date (it
                # stays the next save's copy) and write the delta's rows from it.
                used = used_rows(table)
                columns, meta = stager.stage_table(name, columns, meta, used, change_epoch(table),
                                                   _changed_rows(changed[name]))
            elif stager is not None:  # only the changed rows are copied
                stager.forget(name)  # into the buffers that held the table's whole copy
                at = rows.to(columns["embedding"].device)
                need = int(rows.numel())
                stager.rows_copied[name] = need
                columns = {c: stager.stage(column_key(name, c), t.index_select(0, at), room=2 * need * t[:1].numel())
                           for c, t in columns.items()}
                meta = {c: stager.stage(meta_key(name, c), t.index_select(0, at), room=2 * need * t[:1].numel())
                        for c, t in meta.items()}
                rows = torch.arange(need, dtype=torch.int64)
            states[name] = TableState(table.embedding_dim, table.dtype, columns, ids, rows, meta=meta,
                                      tombstones=delta.tombstones, cleared=delta.cleared, step=step,
                                      live_rows=live)
            continue
        if stager is None:
            states[name] = TableState(table.embedding_dim, table.dtype, columns, table=table, meta=meta, step=step,
                                      live_rows=live)
            continue
        ids, dense_rows = ids_by_row(table)
        if not isinstance(table, HashTable):
            # The write reads them after training goes on: a TableLike may hand out its live id
            # buffer (HashTable's are made for the call). 8 bytes a row beside the columns' copy.
            ids = ids.clone()
            dense_rows = dense_rows.clone() if dense_rows is not None else None
        used = used_rows(table)
        since = changed.get(name) if changed is not None else None
        columns, meta = stager.stage_table(name, columns, meta, used, change_epoch(table),
                                           _changed_rows(since) if since is not None else None)
        states[name] = TableState(table.embedding_dim, table.dtype, columns, ids, dense_rows, meta=meta, step=step,
                                  live_rows=live)
    if stager is None:
        dense_state = {n: t.detach() for n, t in dense.items()}
    else:
        dense_state = {n: stager.stage(dense_key(n), t) for n, t in dense.items()}
        extra_state = copy.deepcopy(extra_state)
        io_state = copy.deepcopy(io_state)
        stager.finish()
    return SaveState(states, dense_state, extra_state, io_state, parent)
