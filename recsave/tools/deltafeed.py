"""Parquet delta feed between two checkpoints (``recsave export --since OLD NEW OUT_DIR``): the rows
that changed, for a serving system that applies updates instead of reloading whole tables.

Each table's merged state is read through the load path (CheckpointSource.read_table), one table
at a time. Upserts are the ids of NEW that OLD lacks or whose embedding bytes differ; deletes are
the ids of OLD that NEW lacks. Layout (docs/FORMAT.md section 7): ``<out_dir>/<table>/part-00000.parquet``
with columns ``op`` (string: "upsert" or "delete"), ``step`` (int64, NEW's step, null when it has
none), ``id`` (int64) and ``embedding`` (``fixed_size_list<T>[dim]`` as in the Parquet export; null
for deletes), upserts first; then the manifest ``<out_dir>/recsave_delta.json``."""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recsave import argcheck, knobs
from recsave.argcheck import check
from recsave.errors import ConfigError, UsageError
from recsave.load.arrow import DELTA_MANIFEST, DTYPE_KEY, arrow_errors, arrow_type, table_dir_name, to_arrow
from recsave.load.config import TableInfo
from recsave.storage import Storage, get_storage
from recsave.tables.idmap import CpuIdMap
from recsave.tools import toolargs
from recsave.tools.export import ArrowSink, manifest_head

__all__ = ["export_delta", "DELTA_MANIFEST", "DELTA_FORMAT", "diff_rows"]

DELTA_FORMAT = "recsave.parquet.delta"
DELTA_FORMAT_VERSION = 1
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def export_delta(old: str, new: str, out_dir: str, tables: Optional[Sequence[str]] = None, *,
                 row_group_rows: int = 65536, progress: Optional[Callable[[int], None]] = None) -> Dict[str, Any]:
    """Writes the delta feed from checkpoint `old` to checkpoint `new` (each a checkpoint dir, or an
    output dir: its latest checkpoint) into `out_dir` and returns its manifest. `tables`: a name or
    a list (default: every table of either). A table only in `old` becomes deletes of all its ids,
    one only in `new` upserts of all its rows. ConfigError for an unknown table or one whose dim or
    dtype changed; UsageError when `out_dir` already holds a feed or a non-empty table directory.
    On failure the files written are removed, and the directories it made when empty. `progress`
    gets the rows written after each row group."""
    where = "export_delta"
    argcheck.path(old, "old", where)
    argcheck.path(new, "new", where)
    argcheck.path(out_dir, "out_dir", where)
    toolargs.check_tables_arg(tables, where)
    check(row_group_rows, int, "row_group_rows", where)
    argcheck.callback(progress, "progress", where)
    if row_group_rows < 1:
        raise UsageError(f"row_group_rows must be a positive int, got {row_group_rows!r}", key="row_group_rows")
    # not at import time: sources imports tools.export
    from recsave.load.sources import open_source, require_checkpoint

    srcs = [open_source(p) for p in (old, new)]
    for src, path in zip(srcs, (old, new)):
        require_checkpoint(src, path, "export_delta (a delta feed compares two checkpoints)")
    before, after = (s.contents.tables for s in srcs)
    known = list(after) + [n for n in before if n not in after]
    names = toolargs.select_tables(tables, known, f"{srcs[0].ckpt_dir} or {srcs[1].ckpt_dir}")
    for name in names:
        a, b = before.get(name), after.get(name)
        if a is not None and b is not None and (a.dim, a.dtype) != (b.dim, b.dtype):
            raise ConfigError(f"table {name!r} changed from dim {a.dim} {a.dtype} to dim {b.dim} {b.dtype}; "
                              f"a delta feed cannot express that: export {srcs[1].ckpt_dir} in full "
                              f"(recsave export)", key=name)
    storage = get_storage(out_dir)
    for src in srcs:
        toolargs.refuse_source_dirs(src, storage, out_dir, "export_delta", "the delta feed", output_dir=False)
    manifest_path = toolargs.check_out_dir(storage, out_dir, DELTA_MANIFEST, names, "a delta feed")
    written: List[str] = []
    created = toolargs.missing_dirs(storage, out_dir)  # removed again (when empty) on failure
    try:
        entries = {}
        for name in names:
            info = after.get(name) or before[name]
            entries[name] = _table(srcs, name, info, storage, out_dir, written, created, row_group_rows, progress)
        storage.makedirs(out_dir)  # made by the first table's directory, unless `tables` selected none
        manifest = {**manifest_head(DELTA_FORMAT, DELTA_FORMAT_VERSION), "step": srcs[1].step,
                    "old": {"source": srcs[0].ckpt_dir, "step": srcs[0].step},
                    "new": {"source": srcs[1].ckpt_dir, "step": srcs[1].step}, "tables": entries}
        storage.write_atomic(manifest_path, json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8"))
    except BaseException:
        toolargs.undo_writes(storage, written, created)
        raise
    return manifest


def diff_rows(old_ids: torch.Tensor, old_rows: torch.Tensor, new_ids: torch.Tensor, new_rows: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(positions in `new_ids` of the upserts, positions in `old_ids` of the deletes): ids new to
    `new_ids` or whose row bytes differ, and ids `new_ids` lacks. Rows are compared bit for bit
    (a NaN equals the same NaN, -0.0 differs from 0.0)."""
    old_rows_of_new = _positions(old_ids, new_ids)  # -1: not in old
    changed = old_rows_of_new < 0
    found = ~changed
    changed[found] = (_bits(new_rows[found]) != _bits(old_rows[old_rows_of_new[found]])).any(1)
    gone = _positions(new_ids, old_ids) < 0
    return changed.nonzero().squeeze(1), gone.nonzero().squeeze(1)


def _positions(ids: torch.Tensor, of: torch.Tensor) -> torch.Tensor:
    """Position in `ids` of each of `of` (-1 where absent), through the C++ id map (hashing: no sort)."""
    index = CpuIdMap()
    index.reserve(ids.numel())
    if not index.load_distinct(ids):
        raise UsageError("the ids of a table repeat; a checkpoint's table holds each id once")
    return index.lookup(of)


def _bits(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.contiguous()  # the same bits, compared as integers
    size = rows.element_size()
    return rows.view(_INT_OF_SIZE[size]) if size in _INT_OF_SIZE else rows.view(torch.uint8)


def _state(src: Any, name: str, info: TableInfo) -> Tuple[torch.Tensor, torch.Tensor]:
    """The table's merged ids and embedding rows (empty when the checkpoint lacks the table)."""
    if name not in src.contents.tables:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, info.dim, dtype=getattr(torch, info.dtype))
    ids, cols = src.read_table(name, ["embedding"], 0, 1, knobs.get("concurrency"))
    return ids, cols["embedding"]


def _table(srcs: List[Any], name: str, info: TableInfo, storage: Storage, out_dir: str, written: List[str],
           created: List[str], row_group_rows: int, progress: Optional[Callable[[int], None]]) -> Dict[str, Any]:
    old_ids, old_rows = _state(srcs[0], name, info)
    new_ids, new_rows = _state(srcs[1], name, info)
    ups, dels = diff_rows(old_ids, old_rows, new_ids, new_rows)
    up_ids, up_rows, del_ids = new_ids[ups], new_rows[ups], old_ids[dels]
    del old_ids, old_rows, new_ids, new_rows
    step = srcs[1].step
    emb_type = pa.list_(arrow_type(info.dtype), info.dim)
    schema = pa.schema([
        pa.field("op", pa.string(), nullable=False), pa.field("step", pa.int64()),
        pa.field("id", pa.int64(), nullable=False),
        pa.field("embedding", emb_type, metadata={DTYPE_KEY: info.dtype.encode()})],
        metadata={b"recsave.table": json.dumps({"table": name, "dim": info.dim, "dtype": info.dtype,
                                                "old": srcs[0].ckpt_dir, "new": srcs[1].ckpt_dir,
                                                "step": step}).encode()})
    ops = pa.array(["upsert", "delete"])

    def batch(op: int, ids: torch.Tensor, rows: Optional[torch.Tensor]) -> pa.Table:
        n = ids.numel()
        emb = pa.nulls(n, emb_type) if rows is None else \
            pa.FixedSizeListArray.from_arrays(to_arrow(rows, info.dtype), info.dim)
        steps = pa.nulls(n, pa.int64()) if step is None else pa.array(np.full(n, step, dtype=np.int64))
        return pa.Table.from_arrays([ops.take(pa.array(np.full(n, op, dtype=np.int32))), steps,
                                     pa.array(ids.numpy()), emb], schema=schema)

    def produce(f: Any) -> None:
        with pq.ParquetWriter(ArrowSink(f), schema, use_dictionary=["op"], write_statistics=["op", "id"]) as w:
            for op, ids, rows in ((0, up_ids, up_rows), (1, del_ids, None)):
                for a in range(0, ids.numel(), row_group_rows):
                    b = min(ids.numel(), a + row_group_rows)
                    w.write_table(batch(op, ids[a:b], None if rows is None else rows[a:b]),
                                  row_group_size=row_group_rows)
                    if progress is not None:
                        progress(b - a)

    rel_dir = table_dir_name(name)
    toolargs.make_dir(storage, storage.join(out_dir, rel_dir), created)
    fname = "part-00000.parquet"
    path = storage.join(out_dir, rel_dir, fname)
    written.append(path)
    with arrow_errors(path, "writing"):
        storage.write_stream(path, produce)
    return {"dim": info.dim, "dtype": info.dtype, "upserts": int(up_ids.numel()), "deletes": int(del_ids.numel()),
            "files": [{"path": f"{rel_dir}/{fname}", "rows": int(up_ids.numel() + del_ids.numel()),
                       "size": storage.size(path)}]}
