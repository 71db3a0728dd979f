"""The row storage behind a HashTable: the embedding and every slot, row-aligned, grown by doubling,
with each row's id and metadata (``last_step``, ``count``).

Row r of every column belongs to the id the table's id map gives row r (``row_ids[r]``); rows no id
has taken hold nothing meaningful. The table owns one ``RowStorage`` and decides which rows to write; this class
only keeps the columns aligned as they grow.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch

from recsave import _C
from recsave.errors import UsageError
from recsave.tables.memhint import advise_hugepages

MIN_CAPACITY = 1024
# Per-row metadata (int64): the table step of the row's last training lookup, and how many
# training lookups it had. Saved as [rows, 1] columns next to the embedding.
META_COLUMNS = ("last_step", "count")
TOMBSTONE_COLUMN = "tombstone"  # a delta's `<table>@tombstone`: ids removed since its parent
# Column names a slot may not take: the checkpoint's own per-row tensors (`<table>@id`, `@embedding`,
# the metadata, a delta's `@tombstone`) and the names convert / plain exports give ids and weights.
RESERVED_COLUMNS = ("id", "ids", "embedding", "weight", *META_COLUMNS, TOMBSTONE_COLUMN)


def check_slot_name(slot: str) -> None:
    """UsageError unless `slot` may name a slot: non-empty, without '@', not a RESERVED_COLUMNS name."""
    if not slot or "@" in slot or slot in RESERVED_COLUMNS:
        raise UsageError(f"slot name {slot!r} is reserved or invalid: a slot needs a non-empty name without "
                         f"'@' other than {list(RESERVED_COLUMNS)}")


class RowStorage:
    """Columns ``weight`` ([capacity, dim]) and ``slots`` (name -> [capacity, dim]), with the value
    each slot takes in newly initialised rows (``slot_init``); ``row_ids`` ([capacity] int64, the
    id of each row) and ``meta`` (META_COLUMNS -> [capacity] int64)."""

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device):
        self.weight = torch.empty(0, dim, dtype=dtype, device=device)
        self.slots: Dict[str, torch.Tensor] = {}
        self.slot_init: Dict[str, float] = {}
        self.row_ids = torch.empty(0, dtype=torch.int64, device=device)
        self.meta: Dict[str, torch.Tensor] = {m: torch.empty(0, dtype=torch.int64, device=device)
                                              for m in META_COLUMNS}

    @property
    def capacity(self) -> int:
        return self.weight.shape[0]

    def slot_names(self) -> List[str]:
        return sorted(self.slots)

    def nbytes(self) -> Dict[str, int]:
        """Bytes allocated per kind of column (whole capacity, used or not)."""
        return {"embedding": self.weight.nbytes, "slots": sum(t.nbytes for t in self.slots.values()),
                "row_ids": self.row_ids.nbytes, "meta": sum(t.nbytes for t in self.meta.values())}

    def add_slot(self, slot: str, init: float) -> None:
        """A new slot filled with `init` (an existing one only takes `init` for later rows)."""
        if slot not in self.slots:
            self.slots[slot] = torch.full_like(self.weight, init)
        self.slot_init[slot] = float(init)

    def column(self, name: str) -> torch.Tensor:
        """The whole storage of 'embedding' or of a slot."""
        return self.weight if name == "embedding" else self.slots[name]

    def columns(self) -> Dict[str, torch.Tensor]:
        return {"embedding": self.weight, **{s: self.slots[s] for s in self.slot_names()}}

    def ensure_capacity(self, rows: int, huge_pages: bool = True) -> None:
        cap = self.capacity
        if rows <= cap:
            return
        new_cap = max(rows, 2 * cap, MIN_CAPACITY)  # doubling: amortised O(1) copies per row
        self.weight = _grow(self.weight, new_cap, huge_pages)
        for slot, storage in self.slots.items():
            self.slots[slot] = _grow(storage, new_cap, huge_pages)
        self.row_ids = _grow(self.row_ids, new_cap, False)
        self.meta = {m: _grow(t, new_cap, False) for m, t in self.meta.items()}

    def init_rows(self, rows: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, step: int) -> None:
        """Rows `rows` (on the storage's device) now hold `ids`: writes `values` as their
        embedding, every slot's init value, last_step = `step` and count 0."""
        put_rows(self.weight, rows, values.to(dtype=self.weight.dtype))
        for slot, storage in self.slots.items():
            put_rows(storage, rows, self.slot_init[slot])
        put_rows(self.row_ids, rows, ids.to(self.row_ids.device))
        put_rows(self.meta["last_step"], rows, step)
        put_rows(self.meta["count"], rows, 0)

    def touch(self, rows: torch.Tensor, step: int) -> None:
        """A training lookup of `rows` (repeats count once each): count += 1, last_step = step."""
        count = self.meta["count"]
        count.index_add_(0, rows, torch.ones_like(rows))
        self.meta["last_step"][rows] = step

    def meta_columns(self) -> Dict[str, torch.Tensor]:
        """The metadata as [capacity, 1] views (the layout of a saved column)."""
        return {m: t.unsqueeze(1) for m, t in self.meta.items()}

    def restore_views(self, n: int, columns: List[str], initial: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Rows [0, n) of `columns` ('embedding', slots (added if new) and / or META_COLUMNS,
        whose views are [n, 1]) to restore into; the other columns' rows [0, n) take their initial
        values (`initial` for the embedding, 0 for metadata).
        Grown on 4 KB pages: a huge page is zeroed whole before the read overwrites it (an extra
        pass over memory); call advise_hugepages() after the fill."""
        self.ensure_capacity(n, huge_pages=False)
        for slot in columns:
            if slot != "embedding" and slot not in self.slots and slot not in self.meta:
                self.add_slot(slot, 0.0)
        if "embedding" not in columns:
            self.weight[:n] = initial.to(device=self.weight.device, dtype=self.weight.dtype)
        for slot, storage in self.slots.items():
            if slot not in columns:
                storage[:n] = self.slot_init[slot]
        for m, storage in self.meta.items():
            if m not in columns:
                storage[:n] = 0
        return {c: self.meta[c][:n].unsqueeze(1) if c in self.meta else self.column(c)[:n] for c in columns}

    def gather(self, rows: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Copies (CPU) of the embedding and of every slot at `rows`."""
        rows_d = rows.to(self.weight.device)
        values = self.weight.index_select(0, rows_d).cpu()
        return values, {s: t.index_select(0, rows_d).cpu() for s, t in self.slots.items()}

    def gather_meta(self, rows: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Copies (CPU, [len(rows), 1]) of the metadata at `rows`."""
        rows_d = rows.to(self.weight.device)
        return {m: t.index_select(0, rows_d).unsqueeze(1).cpu() for m, t in self.meta.items()}

    def advise_hugepages(self) -> None:
        for storage in [self.weight, *self.slots.values()]:
            advise_hugepages(storage)

    def convert(self, dtype: torch.dtype) -> None:
        """The embedding and every slot as `dtype` (copies; metadata and ids stay int64)."""
        self.weight = self.weight.to(dtype)
        self.slots = {slot: storage.to(dtype) for slot, storage in self.slots.items()}
        self.advise_hugepages()


# dtypes numpy shares memory with (bfloat16 has no numpy dtype)
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool)


def put_rows(dst: torch.Tensor, rows: torch.Tensor, values: "torch.Tensor | float | int | bool") -> None:
    """``dst[rows] = values``. CPU tensors go through the engine (one row each, in order, prefetched:
    about twice numpy's indexed assignment) or numpy: one thread, where torch's intra-op threads cost
    a wake-up per call (milliseconds on a busy machine, for a few rows)."""
    if isinstance(values, torch.Tensor):
        # Values only: a source that requires grad (an nn.Embedding's weight) would otherwise make
        # the torch path's assignment a node of its graph, and `dst` (table storage) a non-leaf.
        values = values.detach()
    if _scatters(dst, rows, values):
        assert isinstance(values, torch.Tensor)
        flat = rows.contiguous()
        _C.scatter_rows(dst.data_ptr(), len(dst), _row_bytes(dst), flat.data_ptr(), flat.numel(), values.data_ptr())
        return
    if dst.device.type == "cpu" and dst.dtype in _NUMPY_DTYPES and rows.device.type == "cpu":
        if not isinstance(values, torch.Tensor):
            dst.numpy()[rows.numpy()] = values
            return
        if values.device.type == "cpu" and values.dtype == dst.dtype:
            dst.numpy()[rows.numpy()] = values.numpy()
            return
    dst[rows] = values.to(device=dst.device, dtype=dst.dtype) if isinstance(values, torch.Tensor) else values


def _scatters(dst: torch.Tensor, rows: torch.Tensor, values: object) -> bool:
    """Whether put_rows can hand the rows to the engine: CPU, contiguous, one dtype, int64 rows and
    one value row per row (no broadcasting), rows of at least a byte, values apart from dst."""
    return (isinstance(values, torch.Tensor) and dst.device.type == values.device.type == rows.device.type == "cpu"
            and rows.dtype == torch.int64 and rows.dim() == 1 and dst.dim() >= 1 and values.dtype == dst.dtype
            and tuple(values.shape) == (rows.numel(),) + tuple(dst.shape[1:]) and dst.is_contiguous()
            and values.is_contiguous() and rows.numel() > 0 and _row_bytes(dst) > 0
            # bytes as they lie: not a conjugate view, nothing autograd tracks, and values not read
            # from dst's own storage (an indexed assignment copies them first)
            and not values.is_conj() and not dst.requires_grad
            and values.untyped_storage().data_ptr() != dst.untyped_storage().data_ptr())


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (along the first dimension) of a contiguous tensor."""
    return t.element_size() * math.prod(t.shape[1:])


def copy_rows(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor, threads: int = 1) -> None:
    """``dst[rows] = src[rows]`` along the first dimension. Contiguous CPU tensors of one dtype and
    row shape go through the engine (rows copied in place, runs as blocks, on up to `threads`
    threads: 5-10x numpy's fancy indexing); others through torch."""
    cpu = dst.device.type == src.device.type == rows.device.type == "cpu"
    if cpu and dst.dtype == src.dtype and dst.shape[1:] == src.shape[1:] and dst.is_contiguous() \
            and src.is_contiguous() and rows.dtype == torch.int64:
        flat = rows.contiguous()
        num_rows = min(len(dst), len(src))
        row_bytes = _row_bytes(dst)
        if flat.numel() and row_bytes:
            _C.copy_rows(dst.data_ptr(), src.data_ptr(), num_rows, row_bytes, flat.data_ptr(), flat.numel(), threads)
        elif flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < num_rows):
            raise UsageError(f"copy_rows: a row lies outside [0, {num_rows})")
        return
    dst.index_copy_(0, rows.to(dst.device), src.index_select(0, rows.to(src.device)).to(dst.device))


def copy_range(dst: torch.Tensor, src: torch.Tensor, start: int, stop: int) -> None:
    """``dst[start:stop] = src[start:stop]``; CPU tensors through numpy (one memcpy, no wake-up of
    torch's intra-op threads, which cost milliseconds on a busy machine)."""
    if dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype and dst.dtype in _NUMPY_DTYPES:
        dst.numpy()[start:stop] = src.numpy()[start:stop]
        return
    dst[start:stop] = src[start:stop]


def _grow(t: torch.Tensor, rows: int, huge_pages: bool = True) -> torch.Tensor:
    # New rows are left uninitialised: a row is written (init_rows, a load) when an id takes it,
    # and nothing reads rows no id has taken — filling them would only add a pass over memory.
    out = torch.empty((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    if huge_pages:
        advise_hugepages(out)
    out[: t.shape[0]] = t
    return out
