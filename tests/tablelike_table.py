"""A small pure-PyTorch table that is TableLike but no HashTable (tests of recsave.TableLike):
an ids buffer, a weight buffer and one slot buffer, rows in insertion order."""
from typing import Dict, List, Optional, Tuple

import torch


class TensorTable(torch.nn.Module):
    __recsave_table__ = True

    def __init__(self, embedding_dim: int, name: Optional[str] = None, slots: Optional[Dict[str, float]] = None):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.table_name = name
        self.partition: Optional[Tuple[int, int, int]] = None
        self._inits: Dict[str, float] = {}
        self.register_buffer("ids", torch.empty(0, dtype=torch.int64))
        self.register_buffer("weight", torch.empty(0, embedding_dim))
        for slot, init in ({"acc": 0.0} if slots is None else slots).items():
            self.add_slot(slot, init)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def __len__(self) -> int:
        return self.ids.numel()

    def slot_names(self) -> List[str]:
        return sorted(self._inits)

    def add_slot(self, slot: str, init: float = 0.0) -> None:
        if slot not in self._inits:
            self.register_buffer(f"slot_{slot}", torch.full((len(self), self.embedding_dim), float(init)))
        self._inits[slot] = float(init)

    def slot_init(self, slot: str) -> float:
        return self._inits[slot]

    def id_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.ids.clone(), torch.arange(len(self), dtype=torch.int64)

    def columns(self) -> Dict[str, torch.Tensor]:
        out = {"embedding": self.weight}
        out.update({s: getattr(self, f"slot_{s}") for s in self._inits})
        return out

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ids.numel(), self.embedding_dim)

    def set_partition(self, rank: int, world_size: int, num_buckets: int = 4096) -> None:
        self.partition = (rank, world_size, num_buckets) if world_size > 1 else None

    def new_like(self, copy_rows: bool = False) -> "TensorTable":
        other = TensorTable(self.embedding_dim, self.table_name, dict(self._inits))
        other.partition = self.partition
        if copy_rows:
            other.load_rows(self.ids, self.weight, {s: getattr(self, f"slot_{s}") for s in self._inits})
        return other

    def swap_contents(self, other: "TensorTable") -> None:
        mine = (self.ids, self.weight, {s: getattr(self, f"slot_{s}") for s in self._inits})
        theirs = (other.ids, other.weight, {s: getattr(other, f"slot_{s}") for s in other._inits})
        self._set(*theirs)
        other._set(*mine)

    def _set(self, ids: torch.Tensor, weight: torch.Tensor, slots: Dict[str, torch.Tensor]) -> None:
        self.ids = ids
        self.weight = weight
        for s in list(self._inits):
            delattr(self, f"slot_{s}")
        for s, v in slots.items():
            self.register_buffer(f"slot_{s}", v)
        self._inits = {s: self._inits.get(s, 0.0) for s in slots}

    def load_rows(self, ids: torch.Tensor, values: torch.Tensor, slots: Optional[Dict[str, torch.Tensor]] = None,
                  *, clear: bool = True) -> None:
        slots = slots or {}
        new = {s: torch.full((ids.numel(), self.embedding_dim), self._inits[s]) for s in self._inits}
        new.update({s: v.to(self.dtype) for s, v in slots.items()})
        if clear:
            keep = torch.zeros(0, dtype=torch.int64)
        else:
            keep = torch.nonzero(~torch.isin(self.ids, ids)).flatten()
        old_slots = {s: getattr(self, f"slot_{s}") for s in self._inits}
        self._set(torch.cat([self.ids[keep], ids]), torch.cat([self.weight[keep], values.to(self.dtype)]),
                  {s: torch.cat([old_slots[s][keep], new[s]]) for s in self._inits})

    def set_slot_rows(self, ids: torch.Tensor, slots: Dict[str, torch.Tensor]) -> int:
        pos = {int(i): r for r, i in enumerate(self.ids.tolist())}
        rows = torch.tensor([pos.get(int(i), -1) for i in ids.tolist()], dtype=torch.int64)
        hit = rows >= 0
        for s, v in slots.items():
            getattr(self, f"slot_{s}")[rows[hit]] = v[hit].to(self.dtype)
        return int(hit.sum())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = {int(i): r for r, i in enumerate(self.ids.tolist())}
        rows = torch.tensor([pos[int(i)] for i in ids.flatten().tolist()], dtype=torch.int64)
        return self.weight[rows].view(*ids.shape, self.embedding_dim)

    def state(self) -> Dict[str, torch.Tensor]:
        """ids sorted, with their rows and slot rows: for comparisons."""
        order = torch.argsort(self.ids)
        out = {"ids": self.ids[order], "weight": self.weight[order]}
        out.update({s: getattr(self, f"slot_{s}")[order] for s in self._inits})
        return out
