"""A table's rows in bucket order, as the writer takes them: ids, embedding and slots as sources the
engine gathers while it writes (never a second copy of the table), with checksum segments cut at
bucket boundaries so a resharding reader reads only the buckets it owns (docs/FORMAT.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

import torch

from recsave import knobs
from recsave.errors import UsageError
from recsave.format import segments as bucket_rule
from recsave.format.records import BucketRange
from recsave.format.segments import BucketSegments
from recsave.save.snapshot import PinnedPair, TableState
from recsave.tables import partition
from recsave.tables.rows import TOMBSTONE_COLUMN


def segment_rule(row_bytes: int) -> BucketSegments:
    """The checksum segments of rows sorted by bucket: cut at bucket boundaries once a segment holds
    the knob `min_segment_bytes`, and inside buckets about every `segment_bytes` (on row boundaries,
    so rows can be produced in blocks). The index names this rule (format/segments.py), not the ends."""
    return bucket_rule.rule_for(row_bytes, knobs.get("segment_bytes"), knobs.get("min_segment_bytes"))


@dataclass
class TableLayout:
    """One table's tensors in bucket order, as write_shards takes them."""
    tensors: Dict[str, Any]
    meta: Dict[str, Any]  # chunk fields: the bucket row starts, one BucketRange shared by the tensors
    segments: Dict[str, BucketSegments]
    num_rows: int
    tensor_meta: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # per-tensor chunk fields (tombstones)
    tombstones: int = 0

    def chunk_meta(self, tensor: str) -> Dict[str, Any]:
        return self.tensor_meta.get(tensor, self.meta)


def bucket_layout(name: str, table: TableState, rank: int, world: int, num_buckets: int) -> TableLayout:
    """The table's tensors with rows sorted by the buckets this rank owns."""
    # Peak memory here grows with the table's rows: temporaries are few and freed early.
    ids, rows = table.ids_by_row()
    first, stop = partition.bucket_range(rank, world, num_buckets)
    owned = partition.owned_bucket_order(ids, num_buckets, first, stop)
    if owned is None:  # with one rank every bucket is its own: only several ranks get here
        raise UsageError(
            f"table {name!r} on rank {rank} of {world} holds ids owned by other ranks; route ids "
            f"with recsave.partition.owner_of(ids, {world}) before the lookup", key=name)
    order, counts = owned.order, owned.counts
    row_starts = [0] + torch.cumsum(counts, 0).tolist()
    # Ids come in row order with distinct rows: a table that never freed a row has rows 0..n-1,
    # and its rows in bucket order are the order itself.
    if rows is None or rows.numel() == 0 or int(rows[-1]) == rows.numel() - 1:
        sorted_rows = order
    else:
        sorted_rows = rows[order]
    # The ids were placed in bucket order by the same pass: written as they lie, not gathered.
    tensors: Dict[str, Any] = {f"{name}@id": owned.ids}
    buffers = PinnedPair() if any(t.is_cuda for t in table.columns.values()) else None
    for column in ["embedding"] + table.slot_names() + sorted(table.meta):
        tensors[f"{name}@{column}"] = table.row_source(column, sorted_rows, buffers)
    segments = {n: segment_rule(t.nbytes // max(ids.numel(), 1)) for n, t in tensors.items()}
    # One BucketRange for every tensor of the table: the part pickled to rank 0 holds it once
    # (pickle keeps shared objects shared), as the index does (format version 3).
    layout = TableLayout(tensors, {"buckets": BucketRange(first, tuple(row_starts))}, segments, int(ids.numel()))
    if table.tombstones is not None:
        _add_tombstones(layout, name, table.tombstones, first, stop, num_buckets)
    return layout


def _add_tombstones(layout: TableLayout, name: str, tombstones: torch.Tensor, first: int, stop: int,
                    num_buckets: int) -> None:
    """A delta's `<table>@tombstone`: the removed ids sorted by bucket, with bucket ranges like
    `@id`, so that a reader with another world size reads only the buckets it owns."""
    dead = tombstones.reshape(-1).to(torch.int64).cpu()
    keys = partition.bucket_of(dead, num_buckets).sub_(first)
    if dead.numel() and bool(((keys < 0) | (keys >= stop - first)).any()):
        raise UsageError(f"table {name!r} removed ids owned by other ranks since its last save (its "
                         f"buckets are [{first}, {stop}) of {num_buckets}); route ids with "
                         f"recsave.partition.owner_of before the lookup, so a rank only holds its own",
                         key=name)
    order, counts = partition.bucket_order(keys, stop - first)
    starts = [0] + torch.cumsum(counts, 0).tolist()
    tensor = f"{name}@{TOMBSTONE_COLUMN}"
    layout.tensors[tensor] = dead[order].contiguous()
    layout.tensor_meta[tensor] = {"buckets": BucketRange(first, tuple(starts))}
    layout.segments[tensor] = segment_rule(8)
    layout.tombstones = int(dead.numel())
