"""HashTable: an embedding whose rows are created on demand for unbounded int64 ids.

Ids map to rows through the C++ id map (`recsave._C.IdMap`); rows live in a growable tensor.
Optimizer state lives next to the embedding as *slots*, row-aligned with it. Gradients reach the
table as (rows, values) pairs collected in backward, never as a dense [capacity, dim] tensor.
"""
from __future__ import annotations

import numbers
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from recsave import _C, knobs
from recsave.argcheck import check
from recsave.errors import ArgumentTypeError, ShapeMismatchError, UsageError
from recsave.tables import partition, tablestate
from recsave.tables.grads import RowGrads
from recsave.tables.idmap import check_ids, flat_ids, make_id_map
from recsave.tables.lifecycle import TableLifecycle
from recsave.tables.rows import META_COLUMNS, RowStorage, put_rows
from recsave.tables.tracking import ChangeTracker


class _Lookup(torch.autograd.Function):
    """Gathers rows; backward hands the row gradients to the table instead of returning them."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, table: "HashTable", rows: torch.Tensor) -> torch.Tensor:
        ctx.table = table
        ctx.save_for_backward(rows)
        return table._gather(rows)  # noqa: SLF001 (the table's own autograd Function, same module)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, None, None]:
        (rows,) = ctx.saved_tensors
        ctx.table._grads.add(rows, grad)  # noqa: SLF001 (as above)
        return None, None, None


class HashTable(TableLifecycle, torch.nn.Module):
    """Dynamic-id embedding table.

    Args:
        embedding_dim: width of each row.
        name: the table's name in checkpoints (defaults to its attribute path in the model).
        dtype: floating dtype of the rows.
        device: where ids, rows and slots live. CPU tables use the C++ id map; tables on other
            devices (CUDA) keep the id map on the device too (recsave.idmap.TensorIdMap).
        init_std: new rows are drawn from normal(0, init_std) ...
        seed: ... as a pure function of (seed, id, column), so restarts reproduce them exactly.

        id_map: ``auto`` (the above), or ``cpu`` / ``tensor`` to force the C++ map or the torch-ops map.

    In training mode unseen ids are inserted; in eval mode they read as zeros and are not inserted.
    """

    def __init__(self, embedding_dim: int, name: Optional[str] = None, *, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device | str] = None, init_std: float = 0.01,
                 seed: Optional[int] = None, id_map: str = "auto"):
        super().__init__()
        check(embedding_dim, int, "embedding_dim", "HashTable")
        check(name, str, "name", "HashTable", optional=True)
        check(dtype, torch.dtype, "dtype", "HashTable", expected="a torch.dtype")
        check(init_std, numbers.Real, "init_std", "HashTable")
        check(seed, int, "seed", "HashTable", optional=True)
        check(id_map, str, "id_map", "HashTable")
        if embedding_dim <= 0:
            raise UsageError(f"embedding_dim must be a positive int, got {embedding_dim!r}")
        if not dtype.is_floating_point:
            raise UsageError(f"HashTable rows must be a floating dtype, got {dtype}")
        if name is not None and (not name or "@" in name):
            raise UsageError(f"table name {name!r} must be a non-empty string without '@'")
        self.embedding_dim = embedding_dim
        self.table_name = name
        self.init_std = float(init_std)
        self.seed = int(seed) if seed is not None else 0
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._dtype = dtype
        self._id_map_kind = id_map
        self._map = make_id_map(self._device, id_map)
        self._store = RowStorage(embedding_dim, dtype, self._device)
        self._grads = RowGrads(embedding_dim)
        self._tracker = ChangeTracker(self._device, knobs.get("track_changes"))
        self._step = 0  # the table step: sparse optimizers advance it (row metadata last_step)
        self._partition: Optional[Tuple[int, int, int]] = None  # (rank, world_size, num_buckets)
        # A leaf that requires grad, so autograd calls _Lookup.backward; it never receives a gradient.
        self._anchor = torch.zeros((), requires_grad=True)

    # ----------------------------------------------------------------------------------- basics
    @property
    def name(self) -> Optional[str]:
        return self.table_name

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def __len__(self) -> int:
        return len(self._map)

    # The row storage's columns (tables/rows.py), under the names the row-writing methods use.
    @property
    def _weight(self) -> torch.Tensor:
        return self._store.weight

    @property
    def _slots(self) -> Dict[str, torch.Tensor]:
        return self._store.slots

    def extra_repr(self) -> str:
        return f"{self.embedding_dim}, name={self.table_name!r}, rows={len(self)}, slots={sorted(self._slots)}"

    def ids(self) -> torch.Tensor:
        """All ids, in row order (int64, CPU)."""
        return self._map.export()[0].cpu()

    def clear(self) -> None:
        """Removes every id (storage is kept for reuse)."""
        self._map.clear()
        self._grads.clear()
        self._tracker.clear()

    def delete(self, ids: torch.Tensor) -> int:
        """Removes the given ids; returns how many were present (they become tombstones of the
        next incremental checkpoint)."""
        check_ids(ids, "HashTable.delete")
        flat = flat_ids(ids)
        freed = self._map.erase(flat)
        present = freed >= 0
        freed = freed[present]
        self._grads.forget_rows(freed)
        self._tracker.removed(flat.to(present.device)[present], freed)
        return int(freed.numel())

    def set_partition(self, rank: int, world_size: int, num_buckets: int = partition.DEFAULT_NUM_BUCKETS) -> None:
        """Declares this table the shard of rank `rank` of `world_size`: from now on it accepts only
        ids whose bucket that rank owns (recsave.partition) and refuses others with UsageError."""
        for arg, value in (("rank", rank), ("world_size", world_size), ("num_buckets", num_buckets)):
            check(value, int, arg, "HashTable.set_partition")
        partition.bucket_range(rank, world_size, num_buckets)  # validates
        self._partition = (rank, world_size, num_buckets) if world_size > 1 else None

    @property
    def partition(self) -> Optional[Tuple[int, int, int]]:
        """(rank, world_size, num_buckets) of a sharded table, None when it holds every id."""
        return self._partition

    def _check_owned(self, ids: torch.Tensor) -> None:
        partition.check_owned(ids, self._partition, self.table_name)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------ slots
    def slot_names(self) -> List[str]:
        return self._store.slot_names()

    def add_slot(self, slot: str, init: float = 0.0) -> None:
        """Creates a row-aligned [rows, dim] slot (e.g. an optimizer accumulator) filled with `init`;
        rows inserted later start at `init` too. A slot that exists already keeps its values and takes
        `init` for rows inserted from now on (e.g. a slot restored before its optimizer was built)."""
        check(slot, str, "slot", "HashTable.add_slot")
        check(init, numbers.Real, "init", "HashTable.add_slot")
        if not slot or "@" in slot or slot in ("id", "embedding"):
            raise UsageError(f"slot name {slot!r} is reserved or invalid")
        self._store.add_slot(slot, float(init))

    def slot(self, slot: str) -> torch.Tensor:
        """The slot's storage for rows [0, row_capacity) (index it with rows from lookup())."""
        try:
            return self._slots[slot][: self._map.row_capacity]
        except KeyError:
            raise UsageError(f"table {self.table_name!r} has no slot {slot!r}; it has {self.slot_names()}",
                             key=self.table_name) from None

    @property
    def weight(self) -> torch.Tensor:
        """Row storage for rows [0, row_capacity)."""
        return self._weight[: self._map.row_capacity]

    # ---------------------------------------------------------------------------------- lookups
    def lookup(self, ids: torch.Tensor, insert: bool) -> torch.Tensor:
        """Rows of flat int64 ids (int64, on the id map's device: the CPU for CPU tables); -1 for
        absent ids unless `insert`."""
        check_ids(ids, "HashTable.lookup")
        flat = flat_ids(ids)
        if not insert:
            return self._map.lookup(flat)
        if self._partition is not None:
            self._check_owned(flat)
        rows, is_new, num_new = self._map.lookup_or_insert(flat)
        if num_new:
            self._store.ensure_capacity(self._map.row_capacity)
            self._tracker.reserve(self._map.row_capacity)
            new_rows = rows[is_new].to(self._device)
            new_ids = flat.to(is_new.device)[is_new]
            self._store.init_rows(new_rows, new_ids, self.initial_rows(new_ids), self._step)
            self._tracker.mark(new_rows)
        return rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, f"HashTable {self.table_name!r}")
        rows = self.lookup(ids, insert=self.training).to(self._device)
        if self.training:  # row metadata, and the rows an optimizer may update next
            self._store.touch(rows, self._step)
            self._tracker.mark(rows)
        if torch.is_grad_enabled():
            out = _Lookup.apply(self._anchor, self, rows)
        else:
            out = self._gather(rows)
        return out.view(*ids.shape, self.embedding_dim)

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        out = self._weight.index_select(0, rows.clamp(min=0))
        missing = rows < 0
        if bool(missing.any()):
            out[missing] = 0
        return out

    # -------------------------------------------------------------------------------- gradients
    def coalesced_grad(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(unique rows ascending, summed row gradients) of everything since the last zero_grad."""
        return self._grads.coalesced()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grads.clear()

    # ------------------------------------------------------------------------- initial values
    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows these ids get when inserted: normal(0, init_std) as a pure function of (seed, id,
        column), float32 on the CPU."""
        ids = ids.detach().reshape(-1).cpu().contiguous()
        values = torch.empty(ids.numel(), self.embedding_dim, dtype=torch.float32)
        _C.init_rows_normal(ids.data_ptr(), ids.numel(), self.embedding_dim, self.seed, self.init_std,
                            values.data_ptr(), knobs.get("concurrency"))
        return values

    def slot_init(self, slot: str) -> float:
        """The value a slot takes for newly inserted rows."""
        return self._store.slot_init[slot]

    # ----------------------------------------------------- PyTorch interop (tables/tablestate.py)
    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # The table itself is the entry, so split_sparse_dense_state_dict can separate it; the key
        # lies under the module's prefix, where load_state_dict looks for it.
        destination[tablestate.state_key(prefix)] = self

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
        tablestate.load_entry(self, HashTable, state_dict, prefix, missing_keys, unexpected_keys, error_msgs)

    def __getstate__(self) -> Dict[str, Any]:
        """Pickles (torch.save, copy.deepcopy) as configuration + ids, rows and slots; pending
        gradients are not kept."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_map", "_store", "_tracker")}
        state["_grads"] = RowGrads(self.embedding_dim)
        state["_packed_rows"] = tablestate.pack(self)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        packed = state.pop("_packed_rows")
        part = state.pop("_partition")
        super().__setstate__(state)
        self._partition = None  # set after the rows: it restricts later inserts, not these
        self._map = make_id_map(self._device, self._id_map_kind)
        self._store = RowStorage(self.embedding_dim, self._dtype, self._device)
        self._tracker = ChangeTracker(self._device, knobs.get("track_changes"))
        tablestate.unpack(self, packed)
        self._partition = part

    def id_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ids, rows) of every live id, in row order (CPU int64)."""
        ids, rows = self._map.export()
        return ids.cpu(), rows.cpu()

    def gather_rows(self, rows: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Copies of the embedding and of every slot at `rows` (CPU), taken at one moment."""
        return self._store.gather(rows)

    def columns(self) -> Dict[str, torch.Tensor]:
        """The whole storage of the embedding ('embedding') and of every slot: row r of each belongs
        to the id mapped to r; rows from row_capacity on hold nothing yet."""
        return self._store.columns()

    def export(self, ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
        """One consistent snapshot: ids (row order unless given), their embedding rows and every slot."""
        if ids is None:
            ids, rows = self.id_rows()
        else:
            check_ids(ids, "HashTable.export")
            rows = self.lookup(ids, insert=False)
            if bool((rows < 0).any()):
                raise UsageError(f"table {self.table_name!r}: export of ids that are not in the table")
        values, slots = self.gather_rows(rows)
        return ids, values, slots

    # ---------------------------------------------------------- staging (all-or-nothing loads)
    def new_like(self, copy_rows: bool = False) -> "HashTable":
        """A table with this one's configuration (dim, dtype, device, initialiser, id map kind,
        slots and their init values, partition) and no rows; with `copy_rows`, holding a copy of
        every row. A load is staged in such a table and moved in with swap_contents, so a load that
        fails leaves this table as it was."""
        other = HashTable(self.embedding_dim, self.table_name, dtype=self._dtype, device=self._device,
                          init_std=self.init_std, seed=self.seed, id_map=self._id_map_kind)
        for slot in self.slot_names():
            other.add_slot(slot, self.slot_init(slot))
        if copy_rows and len(self):
            ids, rows = self.id_rows()
            values, slots = self.gather_rows(rows)
            other.load_rows(ids, values, slots, clear=True, meta=self.row_meta(rows))
        if copy_rows:
            other.step = self._step
        if self._partition is not None:  # after the copy: it restricts later inserts, not these rows
            other.set_partition(*self._partition)
        return other

    def swap_contents(self, other: "HashTable") -> None:
        """Exchanges ids, rows, slots, row metadata, the table step, change tracking and pending
        gradients with `other` (same dim, dtype and device): commits a staged load, and swapping
        again rolls it back. Partitions stay."""
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
        possible: duplicate ids."""
        self.clear()
        n = ids.numel()
        # Filled on 4 KB pages (a huge page is zeroed whole before the read overwrites it: an extra
        # pass over memory), advised for huge pages after the fill.
        initial = self.initial_rows(ids) if "embedding" not in columns else torch.empty(0)
        views = self._store.restore_views(n, columns, initial)
        self._store.row_ids[:n] = ids.reshape(-1).to(self._device)
        # Leaving the pool waits for fill: nothing writes the views after this returns or raises.
        # The fill starts first: the map's slots are allocated and the ids checked while it reads.
        with ThreadPoolExecutor(1, thread_name_prefix="recsave-fill") if fill else nullcontext() as pool:
            filled = pool.submit(fill, views) if pool and fill else None
            try:
                self._map.reserve(n)
                if self._partition is not None:
                    self._check_owned(ids)
                distinct = self._map.load_distinct(flat_ids(ids))
            except BaseException:
                self.clear()
                raise
        error = filled.exception() if filled else None
        if error is not None or not distinct:  # a repeated id: rows cannot be 0..n-1
            self.clear()
            if error is not None:
                raise error
            return None
        self._store.advise_hugepages()
        self._tracker.mark_first(n)
        return views

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


def split_sparse_dense_state_dict(state_dict: Dict[str, Any]) -> Tuple[Dict[str, "HashTable"], Dict[str, Any]]:
    """(sparse, dense): the HashTable entries keyed by their checkpoint names (the table's name,
    else its module path: key ``emb.user.table`` -> ``emb.user``), and every other entry under its
    key. UsageError when two different tables would share a name. The input is not modified."""
    return tablestate.split(state_dict, HashTable)
