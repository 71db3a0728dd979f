"""The CheckpointManager's incremental-checkpoint policy (docs/API.md, "CheckpointManager"):
whether an autosave is a delta or a full checkpoint (`full_every`, `rebase_ratio`), and eviction
of stale rows right before each save (`evict`)."""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from recsave.errors import RecsaveError
from recsave.format import chain
from recsave.load import contents
from recsave.storage import Storage


def chain_bytes(storage: Storage, ckpt_dir: Optional[str]) -> List[int]:
    """Bytes of each checkpoint of `ckpt_dir`'s chain, base first ([] when there is no checkpoint or
    its chain does not verify: then the next save is full anyway)."""
    if ckpt_dir is None:
        return []
    try:
        return [m.index.total_bytes for m in chain.resolve(storage, ckpt_dir)]
    except RecsaveError:
        return []


def wants_delta(full_every: Optional[int], rebase_ratio: float, chain: List[int],
                estimate: Optional[int] = None) -> Tuple[bool, str]:
    """(save a delta?, why) for a save after a checkpoint whose chain has these bytes (base first).

    With `full_every=K` every K-th save of a chain is full: the base and K-1 deltas. A delta is
    also replaced by a full save (a rebase) when the chain's delta bytes plus this delta's
    (`estimate`; None: as large as the previous delta) would exceed `rebase_ratio` x the base's
    bytes."""
    if full_every is None:
        return False, "full_every is None"
    if not chain:
        return False, "no checkpoint (or no verified chain) to be a delta of"
    deltas = chain[1:]
    if len(deltas) + 1 >= full_every:
        return False, f"every {full_every}th save is full"
    projected = sum(deltas) + (estimate if estimate is not None else deltas[-1] if deltas else 0)
    if projected > rebase_ratio * chain[0]:
        return False, (f"the chain's deltas would reach {projected} bytes, over rebase_ratio "
                       f"{rebase_ratio:g} x the base's {chain[0]}")
    return True, "delta"


def opens_kept_window(step: int, keep_every_n_steps: Optional[int], steps: Iterable[Optional[int]]) -> bool:
    """Whether a save at `step` is the one keep_every_n_steps keeps for good in its window (no
    checkpoint, of the listed ones' `steps`, has a lower step in it: format/retention.py). Such a
    save is full: as a delta it would keep its whole chain alive with it, and with a large
    full_every nearly every checkpoint would stay."""
    if not keep_every_n_steps:
        return False
    window = step // keep_every_n_steps
    return not any(s is not None and s // keep_every_n_steps == window and s < step for s in steps)


def estimate_delta_bytes(model: torch.nn.Module) -> Optional[int]:
    """The sparse bytes a delta saved now would write (changed rows with every column and their
    metadata, tombstones), from the tables' pending changes; None when a table does not track
    changes. Dense state is left out: it is small, and full saves write it too."""
    tables, _ = contents.model_state(model)
    total = 0
    for table in tables.values():
        pending = getattr(table, "pending_changes", None)
        if not callable(pending):
            return None
        changes = pending()
        if not changes.tracked:
            return None
        itemsize = torch.empty(0, dtype=table.dtype).element_size()
        row = 8 + 16 + (1 + len(table.slot_names())) * table.embedding_dim * itemsize  # id, metadata, columns
        total += changes.ids.numel() * row + changes.tombstones.numel() * 8
    return total


def evict_rows(model: torch.nn.Module, evict: Mapping[str, int]) -> Dict[str, int]:
    """Runs `table.evict(**evict)` on every table of the model that can evict (HashTables); returns
    the rows removed per table."""
    tables, _ = contents.model_state(model)
    return {name: int(table.evict(**evict)) for name, table in tables.items()  # type: ignore[attr-defined]
            if callable(getattr(table, "evict", None))}
