"""What a load did: per name, where it came from and how much was read."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Protocol, Tuple

from recsave.format.chain import IndexIdentity


@dataclass
class LoadedItem:
    category: str            # sparse | sparse_opt | dense | extra | io_state
    checkpoint: str          # source checkpoint directory
    source: str              # name in the source checkpoint
    rows: int = 0            # table rows read (sparse / sparse_opt), also ids a slot-only load ignores
    nbytes: int = 0          # bytes of this item read from storage


class _TableItem(Protocol):
    category: str
    checkpoint: str
    source: str
    rows: int


def table_rows_read(items: Mapping[str, _TableItem]) -> int:
    """Table rows a load reads (LoadedItem or PlannedItem values): a table's columns that come from
    one source table are one read of its rows; columns from another entry or source table (a slot
    from another checkpoint) are another."""
    reads: Dict[Tuple[str, str, str], int] = {}
    for name, item in items.items():
        column = item.category == "sparse" or (item.category == "sparse_opt" and "@" in item.source)
        if column:  # not the sparse optimizer's own state (category sparse_opt, no "@")
            reads[(name.partition("@")[0], item.checkpoint, item.source.partition("@")[0])] = item.rows
    return sum(reads.values())


IndexRead = IndexIdentity  # its name in LoadReport.indexes_read before 8369b58

@dataclass
class LoadReport:
    """Returned by Saver.load / load_by_config and CheckpointManager.load_model_bank / restore."""

    checkpoints: List[str] = field(default_factory=list)
    step: Optional[int] = None
    loaded: Dict[str, LoadedItem] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)      # model names not selected by load / exclude
    missing: List[str] = field(default_factory=list)      # selected, but absent from the checkpoint
    unexpected: List[str] = field(default_factory=list)   # selected in the checkpoint, absent from the model
    notes: List[str] = field(default_factory=list)        # why names were skipped / set otherwise
    rows_read: int = 0
    bytes_read: int = 0
    # The checkpoints whose every table the load read with all its columns (and, for a delta,
    # every member of its chain, base first: each member's shards of them were read).
    read_whole: List[str] = field(default_factory=list)
    # Checkpoint directory -> what the load read of its index (full and delta checkpoints).
    indexes_read: Dict[str, IndexIdentity] = field(default_factory=dict)

    def names(self, category: Optional[str] = None) -> List[str]:
        return sorted(n for n, item in self.loaded.items() if category is None or item.category == category)

    @property
    def tables(self) -> List[str]:
        return self.names("sparse")

    @property
    def dense(self) -> List[str]:
        return self.names("dense")

    @property
    def extras(self) -> List[str]:
        return self.names("extra")

    def summary(self) -> str:
        by_cat: Dict[str, int] = {}
        for item in self.loaded.values():
            by_cat[item.category] = by_cat.get(item.category, 0) + 1
        parts = ", ".join(f"{n} {c}" for c, n in sorted(by_cat.items())) or "nothing"
        return (f"loaded {parts} from {', '.join(self.checkpoints) or '-'}: {self.rows_read} rows, "
                f"{self.bytes_read / 1e6:.1f} MB read; skipped {len(self.skipped)}, missing "
                f"{len(self.missing)}, unexpected {len(self.unexpected)}")
