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
from recsave.argcheck import fail as type_error
from recsave.errors import ArgumentTypeError, ShapeMismatchError, UsageError
from recsave.tables import partition
from recsave.tables.idmap import flat_ids, make_id_map
from recsave.tables.memhint import advise_hugepages

_MIN_CAPACITY = 1024


def _check_ids(ids: Any, where: str) -> None:
    """Ids are an int64 tensor; anything else is a type error naming `ids`."""
    if not isinstance(ids, torch.Tensor):
        raise type_error(where, "ids", "an int64 tensor", ids)
    if ids.dtype != torch.int64:
        raise ArgumentTypeError(f"{where}: ids must be an int64 tensor, got {str(ids.dtype)[6:]} tensor "
                                f"(convert with ids.long() if the values are ids)", key="ids")


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
        ctx.table._accumulate_grad(rows, grad)  # noqa: SLF001 (as above)
        return None, None, None


class HashTable(torch.nn.Module):
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
        self._weight = torch.empty(0, embedding_dim, dtype=dtype, device=self._device)
        self._slots: Dict[str, torch.Tensor] = {}
        self._slot_init: Dict[str, float] = {}
        self._grads: List[Tuple[torch.Tensor, torch.Tensor]] = []
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

    def extra_repr(self) -> str:
        return f"{self.embedding_dim}, name={self.table_name!r}, rows={len(self)}, slots={sorted(self._slots)}"

    def ids(self) -> torch.Tensor:
        """All ids, in row order (int64, CPU)."""
        return self._map.export()[0].cpu()

    def clear(self) -> None:
        """Removes every id (storage is kept for reuse)."""
        self._map.clear()
        self._grads.clear()

    def delete(self, ids: torch.Tensor) -> int:
        """Removes the given ids; returns how many were present."""
        _check_ids(ids, "HashTable.delete")
        freed = self._map.erase(flat_ids(ids))
        freed = freed[freed >= 0]
        if freed.numel() and self._grads:
            # A freed row is reused by the next new id: pending gradients must not follow it there.
            freed_d = freed.to(self._device)
            self._grads = [(r[keep], g[keep]) for r, g in self._grads
                           for keep in [~torch.isin(r, freed_d)]]
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
        rank, world, num_buckets = self._partition  # type: ignore[misc]
        owners = partition.owner_of(ids, world, num_buckets)
        foreign = owners != rank
        if bool(foreign.any()):
            i = int(foreign.nonzero()[0])
            raise UsageError(
                f"table {self.table_name!r} is the shard of rank {rank} of {world}, but id "
                f"{int(ids[i])} belongs to rank {int(owners[i])}; route ids to their owners with "
                f"recsave.partition.route / owner_of before the lookup", key=self.table_name)

    # ------------------------------------------------------------------------------------ slots
    def slot_names(self) -> List[str]:
        return sorted(self._slots)

    def add_slot(self, slot: str, init: float = 0.0) -> None:
        """Creates a row-aligned [rows, dim] slot (e.g. an optimizer accumulator) filled with `init`;
        rows inserted later start at `init` too. A slot that exists already keeps its values and takes
        `init` for rows inserted from now on (e.g. a slot restored before its optimizer was built)."""
        check(slot, str, "slot", "HashTable.add_slot")
        check(init, numbers.Real, "init", "HashTable.add_slot")
        if not slot or "@" in slot or slot in ("id", "embedding"):
            raise UsageError(f"slot name {slot!r} is reserved or invalid")
        if slot in self._slots:
            self._slot_init[slot] = float(init)
            return
        self._slots[slot] = torch.full_like(self._weight, init)
        self._slot_init[slot] = float(init)

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
        _check_ids(ids, "HashTable.lookup")
        flat = flat_ids(ids)
        if not insert:
            return self._map.lookup(flat)
        if self._partition is not None:
            self._check_owned(flat)
        rows, is_new, num_new = self._map.lookup_or_insert(flat)
        if num_new:
            self._ensure_capacity(self._map.row_capacity)
            self._init_rows(flat.to(is_new.device)[is_new], rows[is_new])
        return rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, f"HashTable {self.table_name!r}")
        rows = self.lookup(ids, insert=self.training).to(self._device)
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
    def _accumulate_grad(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        grad = grad.reshape(-1, self.embedding_dim)
        keep = rows >= 0
        if not bool(keep.all()):
            rows, grad = rows[keep], grad[keep]
        self._grads.append((rows, grad))

    def coalesced_grad(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(unique rows ascending, summed row gradients) of everything since the last zero_grad."""
        if not self._grads:
            return None
        rows = torch.cat([r for r, _ in self._grads])
        grads = torch.cat([g for _, g in self._grads])
        unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
        summed = torch.zeros(unique.numel(), self.embedding_dim, dtype=grads.dtype, device=grads.device)
        summed.index_add_(0, inverse, grads)
        return unique, summed

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grads.clear()

    # --------------------------------------------------------------------------- storage growth
    def _ensure_capacity(self, rows: int, huge_pages: bool = True) -> None:
        cap = self._weight.shape[0]
        if rows <= cap:
            return
        new_cap = max(rows, 2 * cap, _MIN_CAPACITY)  # doubling: amortised O(1) copies per row
        self._weight = _grow(self._weight, new_cap, huge_pages)
        for slot, storage in self._slots.items():
            self._slots[slot] = _grow(storage, new_cap, huge_pages)

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
        return self._slot_init[slot]

    def _init_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Initialises the rows of newly inserted ids (embedding and every slot)."""
        rows = rows.to(self._device)
        self._weight[rows] = self.initial_rows(ids).to(device=self._device, dtype=self._dtype)
        for slot, storage in self._slots.items():
            storage[rows] = self._slot_init[slot]

    # ---------------------------------------------------------------------- checkpoint support
    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # The table itself is the entry, so split_sparse_dense_state_dict can separate it.
        destination[self.table_name or prefix[:-1]] = self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        key = self.table_name or prefix[:-1]
        other = state_dict.get(key)
        if other is None:
            if strict:
                missing_keys.append(key)
            return
        if not isinstance(other, HashTable):
            error_msgs.append(f"{key}: expected a HashTable, got {type(other).__name__}")
            return
        ids, values, slots = other.export()
        for slot in slots:  # a saved slot this table lacks is created (load_rows refuses unknown ones)
            if slot not in self._slots:
                self.add_slot(slot)
        self.load_rows(ids, values, slots, clear=True)

    def id_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ids, rows) of every live id, in row order (CPU int64)."""
        ids, rows = self._map.export()
        return ids.cpu(), rows.cpu()

    def gather_rows(self, rows: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Copies of the embedding and of every slot at `rows` (CPU), taken at one moment."""
        rows_d = rows.to(self._device)
        values = self._weight.index_select(0, rows_d).cpu()
        return values, {s: t.index_select(0, rows_d).cpu() for s, t in self._slots.items()}

    def columns(self) -> Dict[str, torch.Tensor]:
        """The whole storage of the embedding ('embedding') and of every slot: row r of each belongs
        to the id mapped to r; rows from row_capacity on hold nothing yet."""
        return {"embedding": self._weight, **{s: self._slots[s] for s in self.slot_names()}}

    def export(self, ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
        """One consistent snapshot: ids (row order unless given), their embedding rows and every slot."""
        if ids is None:
            ids, rows = self.id_rows()
        else:
            _check_ids(ids, "HashTable.export")
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
            other.add_slot(slot, self._slot_init[slot])
        if copy_rows and len(self):
            ids, values, slots = self.export()
            other.load_rows(ids, values, slots, clear=True)
        if self._partition is not None:  # after the copy: it restricts later inserts, not these rows
            other.set_partition(*self._partition)
        return other

    def swap_contents(self, other: "HashTable") -> None:
        """Exchanges ids, rows, slots and pending gradients with `other` (same dim, dtype and
        device): commits a staged load, and swapping again rolls it back. Partitions stay."""
        if (other.embedding_dim, other.dtype, other.device) != (self.embedding_dim, self._dtype, self._device):
            raise UsageError(f"table {self.table_name!r}: cannot swap contents with a table of dim "
                             f"{other.embedding_dim}, {other.dtype} on {other.device}; expected "
                             f"{self.embedding_dim}, {self._dtype} on {self._device}", key=self.table_name)
        mine = self._contents()
        self._set_contents(other._contents())  # noqa: SLF001 (same class)
        other._set_contents(mine)  # noqa: SLF001 (same class)

    def _contents(self) -> Tuple[Any, torch.Tensor, Dict[str, torch.Tensor], Dict[str, float], List[Any]]:
        return self._map, self._weight, self._slots, self._slot_init, self._grads

    def _set_contents(self, contents: Tuple[Any, torch.Tensor, Dict[str, torch.Tensor], Dict[str, float],
                                            List[Any]]) -> None:
        self._map, self._weight, self._slots, self._slot_init, self._grads = contents

    def prepare_load(self, ids: torch.Tensor, columns: List[str],
                     fill: Optional[Callable[[Dict[str, torch.Tensor]], None]] = None,
                     ) -> Optional[Dict[str, torch.Tensor]]:
        """Restore in place: clears the table, makes `ids` rows 0..n-1 and returns, for each of
        `columns` ('embedding' and / or slot names), the storage rows [0, n) to read the checkpoint
        straight into — no second copy of the table (views on the table's device: a CUDA table's
        are filled by host-to-device copies). Columns not listed get their initial values.

        `fill(views)`, when given, fills the views on another thread while the id map is rebuilt
        (a restore reads the checkpoint while hashing the ids); if it raises, the table is left
        cleared and its error propagates. Returns None (table left cleared) when this is not
        possible: duplicate ids."""
        self.clear()
        n = ids.numel()
        # Filled on 4 KB pages (a huge page is zeroed whole before the read overwrites it: an extra
        # pass over memory), advised for huge pages after the fill.
        self._ensure_capacity(n, huge_pages=False)
        self._map.reserve(n)
        if self._partition is not None:
            self._check_owned(ids)
        for slot in columns:
            if slot != "embedding" and slot not in self._slots:
                self.add_slot(slot)
        if "embedding" not in columns:
            self._weight[:n] = self.initial_rows(ids).to(device=self._device, dtype=self._dtype)
        for slot, storage in self._slots.items():
            if slot not in columns:
                storage[:n] = self._slot_init[slot]
        views = {c: (self._weight if c == "embedding" else self._slots[c])[:n] for c in columns}
        # Leaving the pool waits for fill: nothing writes the views after this returns or raises.
        with ThreadPoolExecutor(1, thread_name_prefix="recsave-fill") if fill else nullcontext() as pool:
            filled = pool.submit(fill, views) if pool and fill else None
            try:
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
        for storage in [self._weight, *self._slots.values()]:
            advise_hugepages(storage)
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
        _check_ids(ids, where)
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
            self._slots[slot][rows_d] = t[keep].to(device=self._device, dtype=self._slots[slot].dtype)
        return int(keep.sum())

    def load_rows(self, ids: torch.Tensor, values: torch.Tensor, slots: Optional[Dict[str, torch.Tensor]] = None,
                  *, clear: bool = True) -> None:
        """Sets the rows of `ids` to `values` (and the given slots); clears the table first when
        `clear`, else merges (ids present in both take the loaded values). Slots not given keep their
        values for existing ids and their init value for new ones; every slot given must exist
        (add_slot) already. Nothing changes when an argument is refused."""
        where = f"HashTable {self.table_name!r}.load_rows"
        _check_ids(ids, where)
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
        if self._partition is not None and n:
            self._check_owned(flat_ids(ids))  # before clear(): a refused load changes nothing
        if clear:
            self.clear()
        rows = self.lookup(ids, insert=True).to(self._device)
        self._weight[rows] = values.to(device=self._device, dtype=self._dtype)
        for slot, t in slots.items():
            self._slots[slot][rows] = t.to(device=self._device, dtype=self._slots[slot].dtype)


def _grow(t: torch.Tensor, rows: int, huge_pages: bool = True) -> torch.Tensor:
    # New rows are left uninitialised: a row is written (_init_rows, a load) when an id takes it,
    # and nothing reads rows no id has taken — filling them would only add a pass over memory.
    out = torch.empty((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    if huge_pages:
        advise_hugepages(out)
    out[: t.shape[0]] = t
    return out


def split_sparse_dense_state_dict(state_dict: Dict[str, Any]) -> Tuple[Dict[str, "HashTable"], Dict[str, Any]]:
    """(sparse, dense): HashTable entries and everything else. The input is not modified."""
    sparse = {k: v for k, v in state_dict.items() if isinstance(v, HashTable)}
    dense = {k: v for k, v in state_dict.items() if not isinstance(v, HashTable)}
    return sparse, dense


