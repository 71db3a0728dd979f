"""A delta checkpoint as a load source: its chain (base first, format/chain.py) merged into the rows
one full checkpoint would hold (docs/FORMAT.md section 8: apply the base, then each delta in order:
cleared, tombstones, then upserts, newest wins), in bucket order like a full checkpoint's. Dense
state, extras and io states come from the delta itself (it holds them whole)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from recsave.errors import CorruptCheckpointError
from recsave.format import chain
from recsave.format.reader import bytes_to_read, read_tensors
from recsave.format.records import Index
from recsave.load.sources import CheckpointSource
from recsave.storage import Storage
from recsave.tables import partition

META_COLUMNS = ("last_step", "count")  # row metadata, [n, 1] int64; 0 where a member lacks it


class ChainSource(CheckpointSource):
    """A delta checkpoint: reads give the merged rows of its whole chain; each chain member's byte
    ranges are read once per read_table. Opening it checks the chain (CorruptCheckpointError naming
    a missing or damaged member, or a parent whose index changed)."""

    kind = "chain"

    def __init__(self, storage: Storage, ckpt_dir: str, index: Index):
        super().__init__(storage, ckpt_dir, index)
        self.members = chain.resolve(storage, ckpt_dir, index)

    @property
    def chain_ids(self) -> List[str]:
        return [m.ckpt_id for m in self.members]

    def member_source(self, m: chain.Member) -> CheckpointSource:
        return self if m.ckpt_dir == self.ckpt_dir else CheckpointSource(self.storage, m.ckpt_dir, m.index)

    def table_cost(self, table: str, columns: Sequence[str], rank: int, world: int) -> Tuple[int, Dict[str, int]]:
        """Rows of the merged table (exact with one rank, else the owned share of them) and the bytes
        every chain member contributes per column ('id' includes the tombstones)."""
        rows = self.contents.tables[table].rows
        if world > 1:
            lo, hi = partition.bucket_range(rank, world, self.num_buckets)
            rows = rows * (hi - lo) // self.num_buckets
        cost = {c: 0 for c in ["id", *columns]}
        for m in self.members:
            src = self.member_source(m)
            if f"{table}@id" not in m.index.tensors:
                continue
            ranges = src.row_ranges(table, rank, world)
            for c in cost:
                if f"{table}@{c}" in m.index.tensors:
                    cost[c] += bytes_to_read(m.index, f"{table}@{c}", ranges)
            if f"{table}@tombstone" in m.index.tensors:
                cost["id"] += bytes_to_read(m.index, f"{table}@tombstone", _tomb_ranges(src, table, rank, world))
        return rows, cost

    def read_table(self, table: str, columns: Sequence[str], rank: int, world: int, concurrency: int,
                   out: Optional[Dict[str, torch.Tensor]] = None,
                   with_ids: bool = True) -> Tuple[Optional[torch.Tensor], Dict[str, torch.Tensor]]:
        ids, data = merged_table(self, table, list(columns), rank, world, concurrency)
        if out:
            for c, dest in out.items():
                dest.copy_(data[c])
                data[c] = dest
        return (ids if with_ids else None), data


def _tomb_ranges(src: CheckpointSource, table: str, rank: int, world: int) -> Optional[List[Tuple[int, int]]]:
    if world == 1:
        return None
    lo, hi = partition.bucket_range(rank, world, src.num_buckets)
    ranges = []
    for chunk in src.index.tensor(f"{table}@tombstone").chunks:
        if chunk.buckets is None:
            raise CorruptCheckpointError(f"{src.ckpt_dir}: {table}@tombstone has no bucket offsets",
                                         path=src.ckpt_dir, key=table)
        rows = chunk.buckets.rows_of(lo, hi)
        if rows is not None:
            ranges.append((chunk.first_row + rows[0], chunk.first_row + rows[1]))
    return ranges


def _read_member(src: CheckpointSource, table: str, columns: List[str], rank: int, world: int,
                 concurrency: int) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], Optional[torch.Tensor]]:
    """(ids, columns, tombstones or None) of one member, in one read of its files. Row metadata a
    member lacks (written before recsave saved it) reads as 0s."""
    index = src.index
    present = [c for c in columns if f"{table}@{c}" in index.tensors]
    absent = [c for c in columns if c not in present]
    bad = [c for c in absent if c not in META_COLUMNS]
    if bad:
        raise CorruptCheckpointError(f"{src.ckpt_dir}: chain member lacks column(s) {bad} of table "
                                     f"{table!r}", path=src.ckpt_dir, key=table)
    names = [f"{table}@id"] + [f"{table}@{c}" for c in present]
    ranges = src.row_ranges(table, rank, world)
    rows = None if ranges is None else {n: ranges for n in names}
    tomb = f"{table}@tombstone" if f"{table}@tombstone" in index.tensors else None
    if tomb is not None:
        names.append(tomb)
        tr = _tomb_ranges(src, table, rank, world)
        if tr is not None and rows is not None:
            rows[tomb] = tr
    data = read_tensors(src.ckpt_dir, names, index=index, storage=src.storage, concurrency=concurrency, rows=rows)
    ids = data[f"{table}@id"]
    cols = {c: data[f"{table}@{c}"] for c in present}
    for c in absent:
        cols[c] = torch.zeros(ids.numel(), 1, dtype=torch.int64)
    return ids, cols, (data[tomb] if tomb is not None else None)


def merged_table(src: ChainSource, table: str, columns: List[str], rank: int, world: int,
                 concurrency: int) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The table as its compacted full checkpoint would hold it (the rows rank `rank` of `world`
    owns): ids and the given columns, in bucket order (ties in merge order)."""
    ids: Optional[torch.Tensor] = None
    cols: Dict[str, torch.Tensor] = {}
    for m in src.members:
        info = m.index.meta.tables.get(table) if m.index.meta is not None else None
        if info is None:  # the table did not exist yet (or no more): nothing of it here
            ids, cols = None, {}
            continue
        m_ids, m_cols, tomb = _read_member(src.member_source(m), table, columns, rank, world, concurrency)
        if not m.index.is_delta or info.cleared or ids is None:
            ids, cols = m_ids, m_cols
            continue
        keep = ~torch.isin(ids, m_ids)
        if tomb is not None and tomb.numel():
            keep &= ~torch.isin(ids, tomb)
        ids = torch.cat([ids[keep], m_ids])
        cols = {c: torch.cat([cols[c][keep], m_cols[c]]) for c in columns}
    if ids is None:
        raise CorruptCheckpointError(f"{src.ckpt_dir}: no member of the chain holds table {table!r}",
                                     path=src.ckpt_dir, key=table)
    order = partition.stable_order(partition.bucket_of(ids, src.num_buckets), src.num_buckets)
    return ids[order], {c: v[order] for c, v in cols.items()}
