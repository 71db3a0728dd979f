"""The staging / restore part of HashTable: what loads use to fill a table (prepare_load,
load_rows, set_slot_rows) and to make a load all-or-nothing (swap_contents with a table from
HashTable.new_like; load/transaction.py).

A mixin of HashTable only (it uses the table's own id map, row storage, gradients and tracker);
kept apart so hashtable.py stays about lookups and gradients, as tables/lifecycle.py is.
"""
from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from recsave import knobs, threads
from recsave.argcheck import check
from recsave.errors import ArgumentTypeError, ShapeMismatchError, UsageError
from recsave.tables.grads import RowGrads
from recsave.tables.idmap import CpuIdMap, check_ids, flat_ids
from recsave.tables.modes import outside_inference_mode
from recsave.tables.rows import META_COLUMNS, RowStorage, check_slot_name, put_rows
from recsave.tables.tracking import ChangeTracker


@dataclass(frozen=True)
class DeferredIds:
    """A table's ids for `HashTable.prepare_loads` that the load reads itself, once the fill has
    started: `count` ids, which `read_into(dest)` writes into `dest`, a contiguous int64 CPU tensor
    of `count` elements (the table's own row ids, so no other copy of them is made). It runs on
    the thread that called prepare_loads, while the fill reads the columns: a restore's id reads
    and the allocation of its id maps then overlap the column reads instead of preceding them."""
    count: int
    read_into: Callable[[torch.Tensor], None]

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise UsageError(f"DeferredIds: count must be an int >= 0, got {self.count!r}")
        if not callable(self.read_into):
            raise ArgumentTypeError(f"DeferredIds: read_into must be callable, got {type(self.read_into).__name__}")

    def read(self) -> torch.Tensor:
        """The ids in a new tensor (a table that cannot wait for the fill takes them up front)."""
        out = torch.empty(self.count, dtype=torch.int64)
        self.read_into(out)
        return out


IdsArg = Union[torch.Tensor, Callable[[], torch.Tensor], DeferredIds]


def _check_read_ids(ids: Any, where: str) -> None:
    """Ids a function returned (or a DeferredIds read up front): a tensor of an integer dtype,
    copied into the int64 row ids (a checkpoint may store them as int32); ArgumentTypeError else."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex \
            or ids.dtype == torch.bool:
        check_ids(ids, where)  # raises, naming what it got


class TableStaging:
    """Restore, row loading and content swaps of a HashTable (see the module docstring)."""

    # Set by HashTable.__init__.
    embedding_dim: int
    table_name: Optional[str]
    _map: Any
    _store: RowStorage
    _grads: RowGrads
    _tracker: ChangeTracker
    _step: int
    _dtype: torch.dtype
    _device: torch.device
    _partition: Optional[Tuple[int, int, int]]
    _layout: int

    if TYPE_CHECKING:  # HashTable's own members, which these use
        @property
        def dtype(self) -> torch.dtype: ...
        @property
        def device(self) -> torch.device: ...
        @property
        def _weight(self) -> torch.Tensor: ...
        @property
        def _slots(self) -> Dict[str, torch.Tensor]: ...
        def clear(self) -> None: ...
        def lookup(self, ids: torch.Tensor, insert: bool) -> torch.Tensor: ...
        def initial_rows(self, ids: torch.Tensor) -> torch.Tensor: ...
        def _check_owned(self, ids: torch.Tensor) -> None: ...

    @outside_inference_mode
    def swap_contents(self, other: "TableStaging") -> None:
        """Exchanges ids, rows, slots, row metadata, the table step, change tracking and pending
        gradients with `other` (same dim, dtype and device): commits a staged load, and swapping
        again rolls it back. Partitions stay."""
        if not isinstance(other, TableStaging):
            raise ArgumentTypeError(f"HashTable.swap_contents: other must be a HashTable (a new_like() of this "
                                    f"one), got {type(other).__name__}", key="other")
        if (other.embedding_dim, other.dtype, other.device) != (self.embedding_dim, self._dtype, self._device):
            raise UsageError(f"table {self.table_name!r}: cannot swap contents with a table of dim "
                             f"{other.embedding_dim}, {other.dtype} on {other.device}; expected "
                             f"{self.embedding_dim}, {self._dtype} on {self._device}", key=self.table_name)
        mine = self._contents()
        self._set_contents(other._contents())  # noqa: SLF001 (same class)
        other._set_contents(mine)  # noqa: SLF001 (same class)

    def _contents(self) -> Tuple[Any, RowStorage, RowGrads, ChangeTracker, int]:
        return self._map, self._store, self._grads, self._tracker, self._step

    def _set_contents(self, contents: Tuple[Any, RowStorage, RowGrads, ChangeTracker, int]) -> None:
        self._map, self._store, self._grads, self._tracker, self._step = contents
        self._layout += 1  # other rows hold the ids now

    @outside_inference_mode
    def prepare_load(self, ids: torch.Tensor, columns: List[str],
                     fill: Optional[Callable[[Dict[str, torch.Tensor]], None]] = None,
                     ) -> Optional[Dict[str, torch.Tensor]]:
        """Restore in place: clears the table, makes `ids` rows 0..n-1 and returns, for each of
        `columns` ('embedding', slot names and / or the metadata 'last_step' / 'count', whose
        views are [n, 1] int64), the storage rows [0, n) to read the checkpoint straight into — no
        second copy of the table (views on the table's device: a CUDA table's are filled by
        host-to-device copies). Columns not listed get their initial values (metadata 0).

        `fill(views)`, when given, fills the views on another thread while the id map is rebuilt
        (a restore reads the checkpoint while hashing the ids); if it raises, the table is left
        cleared and its error propagates. Returns None (table left cleared) when this is not
        possible: duplicate ids. `prepare_loads` does this for several tables with one fill."""
        whole = None if fill is None else lambda views: fill(views[0])
        return TableStaging.prepare_loads([(self, ids, columns)], whole)[0]

    @staticmethod
    @outside_inference_mode
    def prepare_loads(requests: Sequence[Tuple["TableStaging", IdsArg, List[str]]],
                      fill: Optional[Callable[[List[Dict[str, torch.Tensor]]], None]] = None,
                      ) -> List[Optional[Dict[str, torch.Tensor]]]:
        """`prepare_load` of several tables, given as (table, ids, columns), at once: every table
        is cleared and gets its views first, then one `fill(views of each table, in order)` runs on
        another thread while the tables' id maps are rebuilt one after another. A restore of many
        tables thus reads them in one pass (no table waits for the previous one's reads to drain,
        and its hashing overlaps them). A table whose ids repeat gets None and is left cleared; if
        `fill` raises, or a table refuses its ids (another rank's), every table is left cleared
        and the error propagates.

        `ids` may be a function returning them, called once, in order: the ids it returns are
        dropped once copied into the table's row ids (the map is rebuilt from those), so a load
        of many tables holds one table's ids read, not every table's. Or a `DeferredIds` (CPU
        tables whose columns include 'embedding'; elsewhere it is read up front like a function):
        the table's rows and map are allocated for its `count` ids, the fill starts, and then its
        ids are read straight into the row ids and hashed, table after table."""
        tables = [t for t, _, _ in requests]
        for table, ids, columns in requests:  # a refused call changes nothing: checked before any clear
            table._check_request(ids, columns)  # noqa: SLF001 (same class)
        if len({id(t) for t in tables}) != len(tables):  # its second views would overwrite the first
            twice = next(t for k, t in enumerate(tables) if any(t is u for u in tables[:k]))
            raise UsageError(f"HashTable.prepare_loads: table {twice.table_name!r} is given twice; give "
                             f"each table once, with all of its ids", key=twice.table_name)
        views: List[Dict[str, torch.Tensor]] = []
        map_ids: List[Union[torch.Tensor, DeferredIds]] = []  # what each map is rebuilt from
        hashed: List[torch.Tensor] = []  # each table's row ids, once read
        distinct: List[bool] = []
        filled: Optional["Future[None]"] = None
        try:
            for table, ids, columns in requests:
                if isinstance(ids, DeferredIds) and table._defers(columns):  # noqa: SLF001 (same class)
                    views.append(table._begin_views(ids.count, columns, reserve=False))  # noqa: SLF001
                    map_ids.append(ids)
                    continue
                given = ids.read() if isinstance(ids, DeferredIds) else ids() if callable(ids) else ids
                _check_read_ids(given, f"HashTable {table.table_name!r}.prepare_loads")
                if given.dtype != torch.int64 and "embedding" not in columns:
                    given = given.to(torch.int64)  # initial_rows hashes int64 ids
                views.append(table._begin_load(given, columns))  # noqa: SLF001 (same class)
                # Ids read for this call are now the table's row ids: hash those, drop the read.
                map_ids.append(given if isinstance(ids, torch.Tensor)
                               else table._store.row_ids[:given.numel()])  # noqa: SLF001 (same class)
                del given
            # A plain thread (recsave/threads.py: it also runs once the main thread has ended, e.g.
            # a restore in a thread outliving it); knob overrides are per thread: the fill thread
            # sees this one's.
            filled = threads.start(knobs.carried(fill), views, name="recsave-fill") if fill else None
            try:
                for table, ids in zip(tables, map_ids):
                    row_ids = table._read_row_ids(ids) if isinstance(ids, DeferredIds) else ids  # noqa: SLF001
                    hashed.append(row_ids)
                    distinct.append(table._rebuild_map(row_ids))  # noqa: SLF001 (same class)
            finally:  # nothing writes the views after this returns or raises
                if filled is not None:
                    futures_wait([filled])
            error = filled.exception() if filled else None
            if error is not None:
                raise error
        except BaseException as exc:
            for table in tables:
                table.clear()
            fill_error = filled.exception() if filled is not None and filled.done() else None
            if fill_error is not None and fill_error is not exc and exc.__context__ is None:
                exc.__context__ = fill_error  # an id read failed while the fill failed too: show both
            raise
        out: List[Optional[Dict[str, torch.Tensor]]] = []
        for table, ids, table_views, ok in zip(tables, hashed, views, distinct):
            if isinstance(table._map, CpuIdMap):  # noqa: SLF001 (same class)
                table._map.advise_huge_pages()  # noqa: SLF001 (reserved on 4 KB pages in _begin_views)
            if ok:  # ids[i] -> row i
                table._store.advise_hugepages()  # noqa: SLF001 (same class)
                table._tracker.mark_first(ids.numel())  # noqa: SLF001 (same class)
            else:  # a repeated id: rows cannot be 0..n-1
                table.clear()
            out.append(table_views if ok else None)
        return out

    def _check_request(self, ids: Any, columns: Any) -> None:
        """A prepare_loads request's arguments: ids an int64 tensor (or a function or DeferredIds,
        whose ids are checked once read), columns a list of 'embedding', 'last_step', 'count',
        slots of the table or names a new slot may take (ArgumentTypeError / UsageError)."""
        where = f"HashTable {self.table_name!r}.prepare_load"
        if not (callable(ids) or isinstance(ids, DeferredIds)):
            check_ids(ids, where)
        check(columns, (list, tuple), "columns", where, expected="a list of column names")
        slots = set(self._store.slot_names())
        for column in columns:
            check(column, str, "column", where, expected="a column name")
            if column != "embedding" and column not in META_COLUMNS and column not in slots:
                check_slot_name(column)  # a new slot: restore_views adds it

    def _begin_load(self, ids: torch.Tensor, columns: List[str]) -> Dict[str, torch.Tensor]:
        """prepare_load's first step: the cleared table's views of rows [0, n), its row ids, and
        room for n ids in the map."""
        n = ids.numel()
        initial = self.initial_rows(ids) if "embedding" not in columns else None  # (seed, id) alone
        views = self._begin_views(n, columns, initial)
        self._store.row_ids[:n] = ids.reshape(-1).to(self._device)
        return views

    def _defers(self, columns: List[str]) -> bool:
        """Whether a DeferredIds request can wait for the fill: the rows' initial values do not
        depend on the ids (the embedding is read), and the row ids are host memory to read into."""
        return "embedding" in columns and self._device.type == "cpu"

    def _begin_views(self, n: int, columns: List[str], initial: Optional[torch.Tensor] = None,
                     reserve: bool = True) -> Dict[str, torch.Tensor]:
        """The cleared table's views of rows [0, n) (the embedding's rows set to `initial` unless
        read) and room for n ids in the map; the row ids are the caller's to set."""
        self.clear()
        # Filled on 4 KB pages (a huge page is zeroed whole before the read overwrites it: an extra
        # pass over memory), advised for huge pages after the fill.
        views = self._store.restore_views(n, columns, torch.empty(0) if initial is None else initial)
        # The map's slots (on 4 KB pages, as the table's rows: huge pages are asked for once
        # filled) are allocated here, before the fill starts, unless the caller reserves them
        # while it reads (DeferredIds): alone a few ms a table, two to four times that beside the
        # fill's page faults on 2 cores, yet off the critical path on a host with cores to spare
        # (a 1 GB restore 1.3x faster on 16 cores, the same on 2; benchmarks/README.md).
        if reserve:
            self._reserve_map(n)
        return views

    def _reserve_map(self, n: int) -> None:
        if isinstance(self._map, CpuIdMap):
            self._map.reserve(n, huge_pages=False)
        else:
            self._map.reserve(n)

    def _read_row_ids(self, ids: DeferredIds) -> torch.Tensor:
        """A DeferredIds' ids, read into the row ids of the rows _begin_views made."""
        dest = self._store.row_ids[:ids.count]
        ids.read_into(dest)
        self._reserve_map(ids.count)
        return dest

    def _rebuild_map(self, ids: torch.Tensor) -> bool:
        """prepare_load's second step, while the views fill: ids[i] -> row i (False: an id repeats)."""
        if self._partition is not None:
            self._check_owned(ids)
        return bool(self._map.load_distinct(flat_ids(ids)))

    def _check_slot_values(self, slots: Any, where: str) -> Dict[str, torch.Tensor]:
        """`slots` is a dict of this table's slot names to tensors (a new slot is created with
        add_slot first, so a typo never becomes a slot)."""
        check(slots, dict, "slots", where, expected="a dict of slot name -> tensor")
        for slot, t in slots.items():
            if not isinstance(slot, str) or not isinstance(t, torch.Tensor):
                raise ArgumentTypeError(f"{where}: slots must map slot names (str) to tensors, got "
                                        f"{type(slot).__name__} -> {type(t).__name__}", key="slots")
        unknown = sorted(set(slots) - set(self._slots))
        if unknown:
            raise UsageError(f"table {self.table_name!r} has no slot(s) {unknown}; its slots: "
                             f"{sorted(self._slots)}. Create a slot with add_slot(name, init) first",
                             key=self.table_name)
        return slots

    @outside_inference_mode
    def set_slot_rows(self, ids: torch.Tensor, slots: Dict[str, torch.Tensor]) -> int:
        """Sets slot values of the `ids` already in the table (others are ignored); returns how many
        ids were updated. Used to warm-start optimizer state without touching embeddings. Every slot
        must exist (add_slot) already."""
        where = f"HashTable {self.table_name!r}.set_slot_rows"
        check_ids(ids, where)
        self._check_slot_values(slots, where)
        for slot, t in slots.items():
            if t.dim() == 0 or t.shape[0] != ids.numel():
                raise ShapeMismatchError(f"table {self.table_name!r}: slot {slot!r} has {tuple(t.shape)} rows "
                                         f"for {ids.numel()} ids", key=self.table_name)
            if t.shape[1:] != self._slots[slot].shape[1:]:
                raise ShapeMismatchError(f"table {self.table_name!r}: slot {slot!r} rows have shape "
                                         f"{tuple(t.shape[1:])}, expected {tuple(self._slots[slot].shape[1:])}",
                                         key=self.table_name)
        rows = self.lookup(ids, insert=False)
        keep = rows >= 0
        rows_d = rows[keep].to(self._device)
        for slot, t in slots.items():
            put_rows(self._slots[slot], rows_d, t[keep])
        self._tracker.mark(rows_d)
        return int(keep.sum())

    @outside_inference_mode
    def load_rows(self, ids: torch.Tensor, values: torch.Tensor, slots: Optional[Dict[str, torch.Tensor]] = None,
                  *, clear: bool = True, meta: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Sets the rows of `ids` to `values` (and the given slots and row metadata); clears the
        table first when `clear`, else merges (ids present in both take the loaded values). Slots
        not given keep their values for existing ids and their init value for new ones; every slot
        given must exist (add_slot) already. `meta` maps 'last_step' / 'count' to [n] or [n, 1]
        int64 tensors (metadata not given: kept for existing ids; last_step = the table step and
        count 0 for new ones). Nothing changes when an argument is refused."""
        where = f"HashTable {self.table_name!r}.load_rows"
        check_ids(ids, where)
        check(values, torch.Tensor, "values", where, expected="a [len(ids), embedding_dim] tensor")
        check(clear, bool, "clear", where)
        slots = self._check_slot_values({} if slots is None else slots, where)
        n = ids.numel()
        if values.dim() != 2 or values.shape[0] != n or values.shape[1] != self.embedding_dim:
            raise ShapeMismatchError(
                f"table {self.table_name!r}: {n} ids with values of shape {tuple(values.shape)}; the "
                f"table expects [{n}, {self.embedding_dim}]", key=self.table_name)
        for slot, t in slots.items():
            if tuple(t.shape) != tuple(values.shape):
                raise ShapeMismatchError(f"table {self.table_name!r}: slot {slot!r} has shape "
                                         f"{tuple(t.shape)}, expected {tuple(values.shape)}", key=self.table_name)
        meta = self._check_meta_values(meta, n, where)
        if self._partition is not None and n:
            self._check_owned(flat_ids(ids))  # before clear(): a refused load changes nothing
        if clear:
            self.clear()
        rows = self.lookup(ids, insert=True).to(self._device)
        put_rows(self._weight, rows, values)
        for slot, t in slots.items():
            put_rows(self._slots[slot], rows, t)
        for m, t in meta.items():
            put_rows(self._store.meta[m], rows, t)
        self._tracker.mark(rows)

    def _check_meta_values(self, meta: Any, n: int, where: str) -> Dict[str, torch.Tensor]:
        """`meta` as {name: [n] int64} (None: {}); refuses unknown names and other shapes."""
        if meta is None:
            return {}
        check(meta, dict, "meta", where, expected="a dict of 'last_step' / 'count' -> int64 tensor")
        out: Dict[str, torch.Tensor] = {}
        for m, t in meta.items():
            if m not in META_COLUMNS:
                raise UsageError(f"{where}: unknown row metadata {m!r}; known: {list(META_COLUMNS)}", key=m)
            check(t, torch.Tensor, f"meta[{m!r}]", where)
            flat = t.reshape(-1) if t.dim() == 2 and t.shape[1] == 1 else t
            if flat.dim() != 1 or flat.numel() != n:
                raise ShapeMismatchError(f"table {self.table_name!r}: row metadata {m!r} has shape "
                                         f"{tuple(t.shape)}, expected [{n}] or [{n}, 1]", key=self.table_name)
            out[m] = flat.to(torch.int64)
        return out

