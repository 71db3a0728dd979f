"""HashTable: an embedding whose rows are created on demand for unbounded int64 ids.

Ids map to rows through the C++ id map (`recsave._C.IdMap`); rows live in a growable tensor.
Optimizer state lives next to the embedding as *slots*, row-aligned with it. Gradients reach the
table as (rows, values) pairs collected in backward, never as a dense [capacity, dim] tensor.
"""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from recsave import _C, knobs
from recsave.argcheck import check
from recsave.errors import UsageError
from recsave.tables import partition, tablestate
from recsave.tables.grads import RowGrads
from recsave.tables.idmap import check_ids, flat_ids, make_id_map
from recsave.tables.lifecycle import TableLifecycle
from recsave.tables.modes import outside_inference_mode, recomputing
from recsave.tables.rows import RowStorage, check_slot_name
from recsave.tables.staging import TableStaging
from recsave.tables.tracking import ChangeTracker


class _Lookup(torch.autograd.Function):
    """Gathers rows; backward hands the row gradients to the table instead of returning them."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, table: "HashTable", rows: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
        ctx.table = table
        ctx.layout = table._layout  # noqa: SLF001 (the table's own autograd Function, same module)
        ctx.save_for_backward(rows, ids)
        return table._gather(rows)  # noqa: SLF001 (as above)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, None, None, None]:
        rows, ids = ctx.saved_tensors
        table = ctx.table
        if not table.requires_grad:
            # Frozen since the forward: dropped, as torch's AccumulateGrad drops the gradient of a
            # parameter frozen before its backward (no optimizer may change a frozen table's rows).
            return None, None, None, None
        if table._layout != ctx.layout:  # noqa: SLF001 (as above)
            # Ids were deleted (their rows reused by new ids) or the table was loaded between the
            # forward and this backward: the gradient belongs to the ids, wherever they are now
            # (a deleted id's is dropped), never to whatever id holds the old row.
            rows = table.lookup(ids, insert=False).to(rows.device)
        table._grads.add(rows, grad)  # noqa: SLF001 (as above)
        return None, None, None, None


class HashTable(TableLifecycle, TableStaging, torch.nn.Module):
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
        if seed is not None and not 0 <= seed < 2 ** 64:  # the initialiser's seed is an unsigned 64-bit int
            raise UsageError(f"seed must be in [0, 2**64), got {seed!r}", key="seed")
        if not (math.isfinite(float(init_std)) and init_std >= 0):
            raise UsageError(f"init_std must be a finite number >= 0, got {init_std!r}", key="init_std")
        if not dtype.is_floating_point:
            raise UsageError(f"HashTable rows must be a floating dtype, got {dtype}")
        if name is not None and (not name or "@" in name):
            raise UsageError(f"table name {name!r} must be a non-empty string without '@'")
        self.embedding_dim = embedding_dim
        self.table_name = name
        self.init_std = float(init_std)
        self.seed = int(seed) if seed is not None else 0
        self._device = _table_device(device)
        self._dtype = dtype
        self._id_map_kind = id_map
        self._map = make_id_map(self._device, id_map)
        self._store = RowStorage(embedding_dim, dtype, self._device)
        self._grads = RowGrads(embedding_dim)
        self._tracker = ChangeTracker(self._device, knobs.get("track_changes"))
        self._step = 0  # the table step: sparse optimizers advance it (row metadata last_step)
        self._partition: Optional[Tuple[int, int, int]] = None  # (rank, world_size, num_buckets)
        # Counts changes of which row holds which id (deletes, clears, swapped-in loads): a
        # lookup's backward after one finds its ids' rows again (_Lookup).
        self._layout = 0
        # A leaf that requires grad, so autograd calls _Lookup.backward; it never receives a gradient.
        # requires_grad_(False) clears it: the table is frozen (lookups record no gradient).
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

    def __bool__(self) -> bool:
        # A module is true, as nn.Embedding is: with __len__ alone an empty table would be false, and
        # `if self.table:` (is this optional module there?) would skip its lookups until it has rows.
        return True

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

    @outside_inference_mode
    def clear(self) -> None:
        """Removes every id (storage is kept for reuse)."""
        self._layout += 1
        self._map.clear()
        self._grads.clear()
        self._tracker.clear()

    @outside_inference_mode
    def delete(self, ids: torch.Tensor) -> int:
        """Removes the given ids; returns how many were present (they become tombstones of the
        next incremental checkpoint)."""
        check_ids(ids, "HashTable.delete")
        flat = flat_ids(ids)
        freed = self._map.erase(flat)
        present = freed >= 0
        freed = freed[present]
        if freed.numel():
            self._layout += 1
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

    @outside_inference_mode
    def add_slot(self, slot: str, init: float = 0.0) -> None:
        """Creates a row-aligned [rows, dim] slot (e.g. an optimizer accumulator) filled with `init`;
        rows inserted later start at `init` too. A slot that exists already keeps its values and takes
        `init` for rows inserted from now on (e.g. a slot restored before its optimizer was built)."""
        check(slot, str, "slot", "HashTable.add_slot")
        check(init, numbers.Real, "init", "HashTable.add_slot")
        check_slot_name(slot)
        self._store.add_slot(slot, float(init))

    def slot(self, slot: str) -> torch.Tensor:
        """The slot's storage for rows [0, row_capacity) (index it with rows from lookup())."""
        try:
            return self._slots[slot][: self._map.row_capacity]
        except KeyError:
            raise self._no_slot(slot) from None

    @property
    def weight(self) -> torch.Tensor:
        """Row storage for rows [0, row_capacity)."""
        return self._weight[: self._map.row_capacity]

    # ---------------------------------------------------------------------------------- lookups
    @outside_inference_mode
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
        # Activation checkpointing's recompute inserts nothing: the forward inserted these ids, so
        # one missing now was deleted (or the table loaded) since; it gets no row (zeros, its
        # gradient dropped) rather than coming back as a new id.
        recompute = self.training and recomputing()
        rows = self.lookup(ids, insert=self.training and not recompute).to(self._device)
        if self.training and not recompute:  # row metadata, and the rows an optimizer may update next
            self._store.touch(rows, self._step)
            self._tracker.mark(rows)
        if torch.is_grad_enabled() and self._anchor.requires_grad:
            # A copy: the caller may refill its id buffer before backward (autograd checks saved
            # tensors for in-place changes); only a layout change reads it.
            out = _Lookup.apply(self._anchor, self, rows, ids.reshape(-1).clone())
        else:
            out = self._gather(rows)
        return out.view(*ids.shape, self.embedding_dim)

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        if self._weight.shape[0] == 0:  # no storage yet (an eval lookup of a new table): every id absent
            return self._weight.new_zeros(rows.numel(), self.embedding_dim)
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

    def grad_for_step(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """coalesced_grad() for an optimizer step, which it counts: when these gradients were
        already applied by a step and not cleared since, a RuntimeWarning says they are applied
        again (model.zero_grad() and a dense optimizer's zero_grad() do not reach a HashTable: it
        has no parameters)."""
        grad = self._grads.coalesced()
        if grad is not None and self._grads.applied:
            warnings.warn(f"HashTable {self.table_name!r}: its gradients were applied by an earlier step() "
                          f"and not cleared since, so this step applies them again; call the sparse "
                          f"optimizer's zero_grad() after each step (model.zero_grad() and a dense "
                          f"optimizer's zero_grad() do not reach HashTables, which have no parameters)",
                          RuntimeWarning, stacklevel=4)  # the caller of step(), past its no_grad wrapper
        if grad is not None:
            self._grads.applied += 1
        return grad

    @property
    def requires_grad(self) -> bool:
        """False once requires_grad_(False) froze the table."""
        return bool(self._anchor.requires_grad)

    def requires_grad_(self, requires_grad: bool = True) -> "HashTable":
        """Freezes (False) or unfreezes the table: a frozen table's lookups record no gradient, so
        no optimizer changes its rows. Called on a parent module this does not reach the table (it
        has no parameters): call it on the table."""
        check(requires_grad, bool, "requires_grad", "HashTable.requires_grad_")
        self._anchor.requires_grad_(requires_grad)
        if not requires_grad:
            self._grads.clear()
        return self

    # ------------------------------------------------------------------------- initial values
    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows these ids get when inserted: normal(0, init_std) as a pure function of (seed, id,
        column), float32 on the CPU."""
        check_ids(ids, "HashTable.initial_rows")
        ids = ids.detach().reshape(-1).cpu().contiguous()
        values = torch.empty(ids.numel(), self.embedding_dim, dtype=torch.float32)
        _C.init_rows_normal(ids.data_ptr(), ids.numel(), self.embedding_dim, self.seed, self.init_std,
                            values.data_ptr(), knobs.get("concurrency"))
        return values

    def slot_init(self, slot: str) -> float:
        """The value a slot takes for newly inserted rows."""
        try:
            return self._store.slot_init[slot]
        except (KeyError, TypeError):
            raise self._no_slot(slot) from None

    def _no_slot(self, slot: Any) -> UsageError:
        return UsageError(f"table {self.table_name!r} has no slot {slot!r}; it has {self.slot_names()}",
                          key=self.table_name)

    # ----------------------------------------------------------- Module.to / .double() / .cuda()
    @outside_inference_mode
    def _apply(self, fn: Any, recurse: bool = True) -> "HashTable":
        """Module.to(dtype), .double(), .half(), ... convert the rows and slots (a table has no
        parameters, so torch would skip it and leave it in its old dtype beside converted dense
        layers). A device move leaves the table where it is: its id map lives on its device, and
        CPU tables beside dense layers moved by model.cuda() is a layout of its own."""
        try:
            probe = fn(torch.empty(0, dtype=self._dtype, device=self._device))
        except Exception:  # e.g. .to("cuda") on a CPU-only build: the table stays as it is
            return super()._apply(fn, recurse)
        if isinstance(probe, torch.Tensor) and probe.dtype != self._dtype:
            if not probe.dtype.is_floating_point:
                raise UsageError(f"HashTable {self.table_name!r}: rows must stay a floating dtype, not "
                                 f"{probe.dtype}")
            self._store.convert(probe.dtype)
            self._dtype = probe.dtype
            # Every row's bytes changed: a new baseline (a Saver sees its epoch moved), so the next
            # incremental save is full.
            self.reset_changes()
        return super()._apply(fn, recurse)

    # ----------------------------------------------------- PyTorch interop (tables/tablestate.py)
    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # A subclass's own parameters, buffers and extra state first, as torch saves them; then
        # the table itself is the entry, so split_sparse_dense_state_dict can separate it; the key
        # lies under the module's prefix, where load_state_dict looks for it.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[tablestate.state_key(prefix)] = self

    @outside_inference_mode
    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
        # torch's part first: the load_state_dict pre-hooks (which may rewrite state_dict, e.g.
        # migrate an old key to the table's), then a subclass's own parameters, buffers and extra
        # state; its strict scan takes the table's entry for an unexpected key: it is the table's.
        before = len(unexpected_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = tablestate.state_key(prefix)
        unexpected_keys[before:] = [k for k in unexpected_keys[before:] if k != key]
        owned = set(self._modules) | set(self._parameters) | {
            n for n in self._buffers if n not in self._non_persistent_buffers_set}
        tablestate.load_entry(self, HashTable, state_dict, prefix, missing_keys, unexpected_keys, error_msgs,
                              owned=owned)

    def __getstate__(self) -> Dict[str, Any]:
        """Pickles (torch.save, copy.deepcopy) as configuration + ids, rows and slots; pending
        gradients are not kept."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_map", "_store", "_tracker")}
        state["_grads"] = RowGrads(self.embedding_dim)
        state["_packed_rows"] = tablestate.pack(self)
        return state

    @outside_inference_mode
    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        packed = state.pop("_packed_rows")
        part = state.pop("_partition")
        super().__setstate__(state)
        self.__dict__.setdefault("_layout", 0)  # pickled before it existed
        self._partition = None  # set after the rows: it restricts later inserts, not these
        self._map = make_id_map(self._device, self._id_map_kind)
        self._store = RowStorage(self.embedding_dim, self._dtype, self._device)
        self._tracker = ChangeTracker(self._device, knobs.get("track_changes"))
        tablestate.unpack(self, packed)
        self._partition = part

    def id_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ids, rows) of every live id, in row order (CPU int64)."""
        ids = self.dense_row_ids()
        if ids is not None:
            return ids, torch.arange(ids.numel(), dtype=torch.int64)
        ids, rows = self._map.export()
        return ids.cpu(), rows.cpu()

    def dense_row_ids(self) -> Optional[torch.Tensor]:
        """When no row was ever freed, a CPU copy of the ids of rows 0..n-1 (row r holds the r-th);
        else None (id_rows gives each id's row). A save's layout then needs no list of rows: one
        int64 per row less of fresh memory, whose page faults cost a VM about 2 ms per million."""
        n = len(self._map)
        if n != self._map.row_capacity:
            return None
        # Copied (an async save reads them while training goes on): a memcpy instead of a scan of
        # the map's slots.
        return self._store.row_ids[:n].to("cpu", copy=True)

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes the table holds on its device, by part: ``embedding`` and ``slots`` (row storage
        to capacity), ``row_ids`` and ``meta`` (each row's id, ``last_step`` and ``count``) and
        ``id_map``. Pending gradients are not counted (they last until the optimizer step)."""
        return {**self._store.nbytes(), "id_map": int(self._map.nbytes)}

    def gather_rows(self, rows: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Copies of the embedding and of every slot at `rows` (CPU), taken at one moment. `rows`
        (int64 as lookup returns them, or int32) must lie in [0, row_capacity): UsageError otherwise."""
        return self._store.gather(self._checked_rows(rows, "gather_rows"))

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

    # ------------------------- staging (all-or-nothing loads; the rest is in tables/staging.py)
    @outside_inference_mode
    def new_like(self, copy_rows: bool = False) -> "HashTable":
        """A table with this one's configuration (dim, dtype, device, initialiser, id map kind,
        slots and their init values, partition) and no rows; with `copy_rows`, holding a copy of
        every row. A load is staged in such a table and moved in with swap_contents, so a load that
        fails leaves this table as it was."""
        other = HashTable(self.embedding_dim, self.table_name, dtype=self._dtype, device=self._device,
                          init_std=self.init_std, seed=self.seed, id_map=self._id_map_kind)
        for slot in self.slot_names():
            other.add_slot(slot, self.slot_init(slot))
        if copy_rows:
            tablestate.copy_rows(self, other)
        if self._partition is not None:  # after the copy: it restricts later inserts, not these rows
            other.set_partition(*self._partition)
        return other


def split_sparse_dense_state_dict(state_dict: Dict[str, Any]) -> Tuple[Dict[str, "HashTable"], Dict[str, Any]]:
    """(sparse, dense): the HashTable entries keyed by their checkpoint names (the table's name,
    else its module path: key ``emb.user.table`` -> ``emb.user``), and every other entry under its
    key. UsageError when two different tables would share a name. The input is not modified."""
    return tablestate.split(state_dict, HashTable)


def _table_device(device: Any) -> torch.device:
    """HashTable's `device` argument as a torch.device, or a UsageError saying why no table can
    live there (torch's own errors name neither the argument nor the fix)."""
    if device is None:
        return torch.device("cpu")
    check(device, (str, torch.device, int), "device", "HashTable",
          expected="a torch.device, a device string or a CUDA device index")
    if isinstance(device, int) and not isinstance(device, bool):  # an index: CUDA's, for a table
        device = f"cuda:{device}"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"HashTable: device {device!r} is not a torch device; use 'cpu' or 'cuda[:N]'",
                         key="device") from None
    if dev.type == "meta":  # rows and an id map need storage; a meta tensor has none
        raise UsageError("HashTable: device 'meta' holds no data, and a table's rows and id map need "
                         "storage; build the table on 'cpu' or 'cuda[:N]' (a HashTable stays on its "
                         "device under module.to_empty / module.to)", key="device")
    if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
        have = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
        raise UsageError(f"HashTable: device {device!r} is not available here ({have}); use 'cpu' or an "
                         f"existing 'cuda:N'", key="device")
    return dev

