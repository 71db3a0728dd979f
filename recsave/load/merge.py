"""The rows of a delta checkpoint's chain (base first, format/chain.py) merged into the rows one full
checkpoint would hold (docs/FORMAT.md section 10: apply the base, then each delta in order:
cleared, tombstones, then upserts, newest wins), in bucket order like a full checkpoint's. Used by
load/sources.py's ChainSource; sources are duck-typed here (CheckpointSource: ckpt_dir, index,
storage, num_buckets, row_ranges)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from recsave.errors import CorruptCheckpointError
from recsave.format.reader import read_tensors
from recsave.tables import partition

META_COLUMNS = ("last_step", "count")  # row metadata, [n, 1] int64; 0 where a member lacks it


def tomb_ranges(src: Any, table: str, rank: int, world: int) -> Optional[List[Tuple[int, int]]]:
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


def read_member(src: Any, table: str, columns: List[str], rank: int, world: int,
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
        tr = tomb_ranges(src, table, rank, world)
        if tr is not None and rows is not None:
            rows[tomb] = tr
    data = read_tensors(src.ckpt_dir, names, index=index, storage=src.storage, concurrency=concurrency, rows=rows)
    # Another writer's int32 ids (and tombstones): every caller, and the merge's bucket maths, take int64.
    ids = data[f"{table}@id"].to(torch.int64)
    cols = {c: data[f"{table}@{c}"] for c in present}
    for c in absent:
        cols[c] = torch.zeros(ids.numel(), 1, dtype=torch.int64)
    return ids, cols, (data[tomb].to(torch.int64) if tomb is not None else None)


def merged_table(src: Any, table: str, columns: List[str], rank: int, world: int,
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
        m_ids, m_cols, tomb = read_member(src.member_source(m), table, columns, rank, world, concurrency)
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
