"""The id -> row maps behind HashTable, with one tensor interface.

- ``CpuIdMap``: the C++ map of the extension (``recsave._C.IdMap``), for tables on the CPU.
- ``TensorIdMap``: open addressing over torch tensors on the table's own device (a CUDA table keeps
  ids, rows and map on the GPU; every step is a batched tensor op, never a per-id Python loop). On
  a CUDA device its two probe loops run as kernels of csrc/cuda/ where those are built
  (tables/cudakernels.py); elsewhere, and on the CPU, as torch ops, which is how CPU-only CI tests
  its logic. Both give the same rows.

Both follow the same contract (csrc/core/id_map.h): a new id takes the lowest row freed by
erase() if any, else ``row_capacity`` (which then grows by one); new ids of a batch get rows in
order of first occurrence; ``export`` lists (id, row) pairs by ascending row. So a table's rows,
and therefore its checkpoints, do not depend on which map it uses.
"""
from __future__ import annotations

import os
from typing import Any, Tuple

import torch

from recsave import _C, knobs
from recsave.argcheck import fail as type_error
from recsave.errors import ArgumentTypeError, UsageError
from recsave.tables import cudakernels

# murmur3 fmix64 constants as signed int64 (torch has no uint64 arithmetic; int64 products wrap).
_FMIX_1 = 0xFF51AFD7ED558CCD - (1 << 64)
_FMIX_2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_EMPTY, _DELETED = -1, -2  # row values of a slot that holds no id
_MAX_FILL = 0.5  # live ids + deleted markers per slot before the table is rebuilt larger


class CpuIdMap:
    """``recsave._C.IdMap`` with tensors in and out (CPU int64)."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self._map = _C.IdMap(0)

    def __len__(self) -> int:
        return len(self._map)

    @property
    def row_capacity(self) -> int:
        return self._map.row_capacity

    @property
    def slot_capacity(self) -> int:
        return self._map.slot_capacity

    @property
    def nbytes(self) -> int:
        """Host memory of the map: 16 bytes a slot (id, row) and a bit a row for the free rows."""
        return 16 * self._map.slot_capacity + self._map.row_capacity // 8

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self._map.lookup(_host_array(ids), knobs.get("concurrency")))

    def lookup_or_insert(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
        rows, is_new, num_new = self._map.lookup_or_insert(_host_array(ids), knobs.get("concurrency"))
        return torch.from_numpy(rows), torch.from_numpy(is_new).bool(), int(num_new)

    def erase(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self._map.erase(_host_array(ids)))

    def load_distinct(self, ids: torch.Tensor) -> bool:
        """Restore into an empty map: ids[i] gets row i (several threads, one range of slots
        each); False, leaving the map empty, if an id repeats."""
        return bool(self._map.load_distinct(_host_array(ids), min(knobs.get("concurrency"), usable_cores())))

    def export(self) -> Tuple[torch.Tensor, torch.Tensor]:
        ids, rows = self._map.export()
        return torch.from_numpy(ids), torch.from_numpy(rows)

    def clear(self) -> None:
        self._map.clear()

    def reserve(self, n: int, huge_pages: bool = True) -> None:
        """Room for `n` ids without growing (a restore knows its count up front). Without
        `huge_pages` a new slot array stays on 4 KB pages until advise_huge_pages(): faulting in
        2 MB pages can stall on memory compaction, which a restore's serial start would wait on."""
        self._map.reserve(n, huge_pages)

    def advise_huge_pages(self) -> None:
        """Asks for huge pages for the slot array (taken up in the background by khugepaged)."""
        self._map.advise_huge_pages()


class TensorIdMap:
    """Open addressing with linear probing over power-of-two ``keys`` / ``rows`` tensors on
    `device`. A slot is empty when its row is -1 and deleted when it is -2, so every int64 is a
    valid id. Batches probe all their ids at once, one probe step per loop round; concurrent
    inserts into one slot are settled by a claim array (one writer wins, the others probe on), so
    the slot layout may vary between runs but the rows handed out never do."""

    def __init__(self, device: torch.device | str = "cpu", capacity: int = 1024):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # the GPU its tensors land on now, not whichever is current at a later call
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._size = 0
        self._deleted = 0
        self._row_capacity = 0
        self._free = torch.empty(0, dtype=torch.int64, device=self.device)  # ascending
        self._allocate(_pow2(capacity))

    def _allocate(self, capacity: int) -> None:
        self._keys = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self._rows = torch.full((capacity,), _EMPTY, dtype=torch.int64, device=self.device)
        self._claim = torch.empty(0, dtype=torch.int64, device=self.device)  # the torch-ops _place's, made there
        self._mask = capacity - 1
        self._deleted = 0

    def __len__(self) -> int:
        return self._size

    @property
    def row_capacity(self) -> int:
        return self._row_capacity

    @property
    def slot_capacity(self) -> int:
        return self._mask + 1

    @property
    def nbytes(self) -> int:
        """Memory of the map on its device: keys and rows (8 bytes each a slot), the claims of the
        torch-ops insert where it ran (8 more a slot), free rows."""
        return 16 * self.slot_capacity + 8 * (self._claim.numel() + self._free.numel())

    # ------------------------------------------------------------------------------- probing
    def _kernels(self) -> bool:
        """Probe with the CUDA kernels (a CUDA map, the kernels built and the knob on)."""
        return self.device.type == "cuda" and cudakernels.available(self.device)

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        h = ids ^ _lsr(ids, 33)
        h = h * _FMIX_1
        h = h ^ _lsr(h, 33)
        h = h * _FMIX_2
        h = h ^ _lsr(h, 33)
        return h & self._mask

    def _find(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(row, slot) of each id; -1 / -1 where absent."""
        n = ids.numel()
        if n and self._size and self._kernels():
            return cudakernels.find(self._keys, self._rows, self._mask, ids)
        rows = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        slots = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        if n == 0 or self._size == 0:
            return rows, slots
        active = torch.arange(n, device=self.device)
        keys, pos = ids, self._home(ids)
        while active.numel():
            slot_rows = self._rows[pos]
            hit = (slot_rows >= 0) & (self._keys[pos] == keys)
            rows[active[hit]] = slot_rows[hit]
            slots[active[hit]] = pos[hit]
            going = ~hit & (slot_rows != _EMPTY)  # an empty slot ends the probe: absent
            active, keys, pos = active[going], keys[going], (pos[going] + 1) & self._mask
        return rows, slots

    def _place(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Stores ids known to be absent (and distinct) with their rows; capacity must suffice."""
        if self._kernels():
            self._deleted -= cudakernels.place(self._keys, self._rows, self._mask, ids, rows)
            return
        if self._claim.numel() != self.slot_capacity:
            self._claim = torch.full((self.slot_capacity,), -1, dtype=torch.int64, device=self.device)
        keys, vals, pos = ids, rows, self._home(ids)
        while keys.numel():
            open_ = self._rows[pos] < 0
            # Every id at an open slot claims it; one claim per slot wins, the rest probe on.
            ticket = torch.arange(keys.numel(), device=self.device)
            self._claim[pos[open_]] = ticket[open_]
            won = open_ & (self._claim[pos] == ticket)
            self._claim[pos[open_]] = -1
            won_pos = pos[won]
            self._deleted -= int((self._rows[won_pos] == _DELETED).sum())
            self._keys[won_pos] = keys[won]
            self._rows[won_pos] = vals[won]
            going = ~won
            keys, vals, pos = keys[going], vals[going], (pos[going] + 1) & self._mask

    def _make_room(self, extra: int) -> None:
        capacity = self._mask + 1
        if self._size + self._deleted + extra <= _MAX_FILL * capacity:
            return
        while (self._size + extra) > _MAX_FILL * capacity / 2:  # rebuilt table starts <= 1/4 full
            capacity *= 2
        live = self._rows >= 0
        ids, rows = self._keys[live], self._rows[live]
        self._allocate(capacity)
        self._place(ids, rows)

    # --------------------------------------------------------------------------------- batches
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Row of each id, -1 where absent."""
        return self._find(self._ids(ids))[0]

    def lookup_or_insert(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """(rows, is_new, num_new): absent ids are inserted; is_new marks each new id's first
        occurrence in the batch."""
        ids = self._ids(ids)
        rows = self._find(ids)[0]
        is_new = torch.zeros(ids.numel(), dtype=torch.bool, device=self.device)
        missing = (rows < 0).nonzero().squeeze(1)
        if missing.numel() == 0:
            return rows, is_new, 0
        unique, inverse, first = _first_occurrences(ids[missing])
        order = torch.argsort(first)  # new ids in order of first occurrence
        count = unique.numel()
        reused = min(count, self._free.numel())
        assigned = torch.cat([self._free[:reused],
                              torch.arange(self._row_capacity, self._row_capacity + count - reused,
                                           device=self.device)])
        self._make_room(count)
        self._place(unique[order], assigned)
        self._free = self._free[reused:]
        self._row_capacity += count - reused
        self._size += count
        row_of_unique = torch.empty_like(assigned)
        row_of_unique[order] = assigned
        rows[missing] = row_of_unique[inverse]
        is_new[missing[first]] = True
        return rows, is_new, count

    def erase(self, ids: torch.Tensor) -> torch.Tensor:
        """Removes ids; returns the freed row of each id's first occurrence, -1 elsewhere."""
        ids = self._ids(ids)
        rows, slots = self._find(ids)
        freed = torch.full_like(rows, -1)
        present = (rows >= 0).nonzero().squeeze(1)
        if present.numel() == 0:
            return freed
        _unique, _inverse, first = _first_occurrences(ids[present])
        at = present[first]
        freed[at] = rows[at]
        self._rows[slots[at]] = _DELETED
        self._size -= at.numel()
        self._deleted += at.numel()
        self._free = torch.sort(torch.cat([self._free, rows[at]])).values
        return freed

    def export(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ids, rows) of every live id, by ascending row."""
        live = self._rows >= 0
        ids, rows = self._keys[live], self._rows[live]
        order = torch.argsort(rows)
        return ids[order], rows[order]

    def clear(self) -> None:
        self._rows.fill_(_EMPTY)
        self._size = self._deleted = self._row_capacity = 0
        self._free = self._free[:0]

    def reserve(self, n: int) -> None:
        """Room for `n` ids without growing."""
        self._make_room(max(0, n - self._size))

    def load_distinct(self, ids: torch.Tensor) -> bool:
        """Restore into an empty map: ids[i] gets row i; False, leaving the map empty, if an id
        repeats."""
        if self._size or self._row_capacity:
            raise UsageError(f"load_distinct needs an empty map ({self._size} ids, row capacity "
                             f"{self._row_capacity}); clear() it first")
        if self.lookup_or_insert(ids)[2] == flat_ids(ids).numel():
            return True
        self.clear()
        return False

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        return flat_ids(ids).to(self.device)


def usable_cores() -> int:
    """CPUs this process may run on (its affinity, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def check_ids(ids: Any, where: str) -> None:
    """Ids are an int64 tensor; anything else is an ArgumentTypeError naming `ids` and `where`."""
    if not isinstance(ids, torch.Tensor):
        raise type_error(where, "ids", "an int64 tensor", ids)
    if ids.dtype != torch.int64:
        raise ArgumentTypeError(f"{where}: ids must be an int64 tensor, got {str(ids.dtype)[6:]} tensor "
                                f"(convert with ids.long() if the values are ids)", key="ids")


def flat_ids(ids: torch.Tensor) -> torch.Tensor:
    """`ids` as a flat int64 tensor (a view where possible); UsageError for anything else."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
        raise UsageError(f"ids must be an int64 tensor, got {getattr(ids, 'dtype', type(ids))}")
    return ids.detach().reshape(-1)


def _host_array(ids: torch.Tensor):
    """The ids as a contiguous int64 numpy array for the C++ map (no copy for CPU tensors)."""
    return flat_ids(ids).cpu().contiguous().numpy()


def _first_occurrences(ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique ids, inverse, position of each unique id's first occurrence in `ids`)."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    positions = torch.arange(ids.numel(), device=ids.device)
    first = torch.full((unique.numel(),), ids.numel(), dtype=torch.int64, device=ids.device)
    first.scatter_reduce_(0, inverse, positions, reduce="amin")
    return unique, inverse, first


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _pow2(n: int) -> int:
    p = 1
    while p < max(n, 2):
        p *= 2
    return p


def make_id_map(device: torch.device, kind: str = "auto"):
    """The map for a table on `device`: ``auto`` picks the C++ map on the CPU and TensorIdMap
    elsewhere; ``cpu`` / ``tensor`` force one."""
    if kind not in ("auto", "cpu", "tensor"):
        raise UsageError(f"id_map must be 'auto', 'cpu' or 'tensor', got {kind!r}")
    if kind == "cpu" or (kind == "auto" and device.type == "cpu"):
        return CpuIdMap()
    return TensorIdMap(device)
