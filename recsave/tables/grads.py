"""The row gradients a HashTable collects in backward until zero_grad: (rows, values) pairs, never
a dense [capacity, dim] tensor."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch


class RowGrads:
    """Pending gradients of a table of width `dim`."""

    # Parts kept before they are summed into one: a table whose gradients no optimizer takes (a
    # dense-only loop that never calls the table's zero_grad) then holds at most its touched rows,
    # not every backward's gradients.
    MAX_PARTS = 256

    def __init__(self, dim: int):
        self.dim = dim
        self._parts: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.applied = 0  # optimizer steps that applied these gradients (0 after clear)

    def __bool__(self) -> bool:
        return bool(self._parts)

    def add(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Records the gradient of a lookup; rows < 0 (absent ids in eval mode) are dropped."""
        grad = grad.reshape(-1, self.dim)
        keep = rows >= 0
        if not bool(keep.all()):
            rows, grad = rows[keep], grad[keep]
        self._parts.append((rows, grad))
        if len(self._parts) > self.MAX_PARTS:
            summed = self.coalesced()
            assert summed is not None
            self._parts = [summed]

    def forget_rows(self, freed: torch.Tensor) -> None:
        """Drops the gradients of freed rows: the next new id reuses a freed row, and pending
        gradients must not follow it there."""
        if freed.numel() and self._parts:
            self._parts = [(r[keep], g[keep]) for r, g in self._parts
                           for keep in [~torch.isin(r, freed.to(r.device))]]

    def coalesced(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(unique rows ascending, summed row gradients), or None when nothing is pending."""
        if not self._parts:
            return None
        rows = torch.cat([r for r, _ in self._parts])
        grads = torch.cat([g for _, g in self._parts])
        unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
        summed = torch.zeros(unique.numel(), self.dim, dtype=grads.dtype, device=grads.device)
        summed.index_add_(0, inverse, grads)
        return unique, summed

    def clear(self) -> None:
        self._parts.clear()
        self.applied = 0
