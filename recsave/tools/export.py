"""Export of a checkpoint's tables to Parquet (``recsave export`` on the command line). The layout
and the manifest are described in recsave.parquet, which also reads them back."""
from __future__ import annotations

import datetime
import json
import uuid
import warnings
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from recsave import argcheck, knobs
from recsave.argcheck import check
from recsave.errors import CorruptCheckpointError, RecsaveError, UsageError
from recsave.format.reader import read_tensors
from recsave.load.arrow import (
    DTYPE_KEY,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    arrow_errors,
    arrow_type,
    table_dir_name,
    to_arrow,
)
from recsave.load.config import SPARSE_OPTIM, TableInfo, sparse_optim_steps
from recsave.load.parquet import ParquetSource, is_parquet_source
from recsave.storage import Storage, get_storage
from recsave.tools import toolargs
from recsave.version import __version__

__all__ = ["to_parquet", "ParquetSource", "is_parquet_source", "MANIFEST"]

def to_parquet(ckpt: str, out_dir: str, tables: Optional[Sequence[str]] = None, *,
               row_group_rows: int = 65536, rows_per_file: Optional[int] = None,
               progress: Optional[Callable[[int], None]] = None) -> Dict[str, Any]:
    """Exports tables of the checkpoint `ckpt` (a checkpoint dir, or an output dir: its latest
    checkpoint) to one Parquet dataset per table under `out_dir`, streaming `row_group_rows` rows at a
    time (one row group each); a table's file is split every `rows_per_file` rows (None: one file).
    Writes the manifest last and returns it. Raises ConfigError for an unknown table and UsageError
    when `out_dir` already holds an export or a non-empty directory of a selected table. On failure
    it removes what it created (files, then the directories it made, `out_dir` and its parents
    included, when empty); what `out_dir` held before is left as it was.
    `progress`, when given, is called with the number of rows written after each row group."""
    where = "to_parquet"
    argcheck.path(ckpt, "ckpt", where)
    argcheck.path(out_dir, "out_dir", where)
    toolargs.check_tables_arg(tables, where)
    check(row_group_rows, int, "row_group_rows", where)
    check(rows_per_file, int, "rows_per_file", where, optional=True)
    argcheck.callback(progress, "progress", where)
    if row_group_rows < 1:
        raise UsageError(f"row_group_rows must be a positive int, got {row_group_rows!r}", key="row_group_rows")
    if rows_per_file is not None and rows_per_file < 1:
        raise UsageError(f"rows_per_file must be a positive int or None (one file per table), got "
                         f"{rows_per_file!r}", key="rows_per_file")
    from recsave.load.sources import open_source, require_checkpoint  # not at import time: sources imports this

    src = open_source(ckpt)
    require_checkpoint(src, ckpt, "to_parquet")
    available = src.contents.tables
    names = toolargs.select_tables(tables, list(available), f"the checkpoint {src.ckpt_dir}", src.ckpt_dir)
    storage = get_storage(out_dir)
    toolargs.refuse_source_dirs(src, storage, out_dir, "to_parquet", "the export", output_dir=False)
    manifest_path = toolargs.check_out_dir(storage, out_dir, MANIFEST, names, "an export")
    written: List[str] = []
    created: List[str] = toolargs.missing_dirs(storage, out_dir)  # removed again (when empty) on failure
    try:
        entries = {}
        for name in names:
            entries[name] = _export_table(src, name, available[name], storage, out_dir, written, created,
                                          row_group_rows, rows_per_file, progress)
        for name, steps in _optimizer_steps(src, {n: available[n] for n in names}).items():
            if name in entries:
                entries[name]["optimizer_steps"] = steps
        storage.makedirs(out_dir)  # made by the first table's directory, unless `tables` selected none
        manifest = {**manifest_head(FORMAT, FORMAT_VERSION), "source": src.ckpt_dir, "step": src.index.step,
                    "tables": entries}
        storage.write_atomic(manifest_path, json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8"))
    except BaseException:
        toolargs.undo_writes(storage, written, created)
        raise
    return manifest


def manifest_head(fmt: str, version: int) -> Dict[str, Any]:
    """The keys every export manifest starts with (docs/FORMAT.md section 7): format, version, the
    writer's recsave version, the UTC time and a fresh export id."""
    return {"format": fmt, "format_version": version, "recsave_version": __version__,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z"),
            "export_id": uuid.uuid4().hex}


def _optimizer_steps(src: Any, tables: Dict[str, TableInfo]) -> Dict[str, int]:
    """The checkpoint's sparse optimizer step count of each table (its extra.pt), {} without one: an
    export with slots carries them, so a warm start from it resumes Adagrad's lr_decay and Adam's
    bias correction where the slots were, not at step 0. Read only when an exported table has
    slots (extra.pt holds every extra: it may be large); an extra.pt that cannot be read costs the
    export its counts (a warning), not the tables."""
    if SPARSE_OPTIM not in getattr(src.contents, "extras", ()) or not any(t.slots for t in tables.values()):
        return {}
    try:
        extra = src.read_pt("extra.pt")
    except (RecsaveError, OSError) as exc:
        warnings.warn(f"{src.ckpt_dir}: the sparse optimizer's step counts are not exported ({type(exc).__name__}: "
                      f"{exc}); a warm start from the export counts its tables' steps from 0", RuntimeWarning,
                      stacklevel=3)
        return {}
    steps = sparse_optim_steps(extra) or {}
    return {str(k): v for k, v in steps.items() if type(v) is int and v >= 0}


def _export_table(src: Any, name: str, info: TableInfo, storage: Storage, out_dir: str, written: List[str],
                  created: List[str], row_group_rows: int, rows_per_file: Optional[int],
                  progress: Optional[Callable[[int], None]]) -> Dict[str, Any]:
    index = src.index
    columns = ["embedding"] + list(info.slots)
    names = [f"{name}@id"] + [f"{name}@{c}" for c in columns]
    id_shape = index.tensor(names[0]).shape
    n = id_shape[0] if id_shape else -1
    dtypes = {c: index.tensor(f"{name}@{c}").dtype for c in columns}
    chained = getattr(src, "kind", "checkpoint") == "chain"
    meta = index.meta
    quantised = meta is not None and name in meta.tables and meta.tables[name].quant is not None
    if chained:  # a delta: its chain's merged rows (as its compacted checkpoint holds them), read once
        fetch, n = _merged_reader(src, name, columns, names)
    elif quantised:  # an int8 serving table: its codes decoded with their scales, as a load does
        fetch = _decoding_reader(src, name, columns, names)
        dtypes["embedding"] = "float32"
    else:
        fetch = _reader(src, names)
    for t in ([] if chained else names):
        want = [n] if t == names[0] else [n, info.dim]
        entry = index.tensor(t)
        if list(entry.shape) != want or (t == names[0] and entry.dtype not in ("int64", "int32")):
            raise CorruptCheckpointError(f"{src.ckpt_dir}: tensor {t!r} is {entry.dtype}"
                                         f"{list(entry.shape)}, expected {want} rows of table {name!r} "
                                         f"(int64 or int32 ids); the checkpoint is inconsistent", path=src.ckpt_dir,
                                         key=t)
    # `rows`: the table's rows in all its files, so that a load of the table's directory alone
    # (no manifest to check) refuses the files of an interrupted export or a partial copy.
    table_meta = {"table": name, "dim": info.dim, "dtype": info.dtype, "slots": list(info.slots),
                  "source": src.ckpt_dir, "step": index.step, "rows": max(n, 0)}
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False)] + [
        pa.field(c, pa.list_(arrow_type(dtypes[c]), info.dim), nullable=False,
                 metadata={DTYPE_KEY: dtypes[c].encode()}) for c in columns],
        metadata={b"recsave.table": json.dumps(table_meta).encode()})
    rel_dir = table_dir_name(name)
    table_dir = storage.join(out_dir, rel_dir)
    toolargs.make_dir(storage, table_dir, created)
    per_file = rows_per_file or max(n, 1)
    files = []
    for part, first in enumerate(range(0, max(n, 1), per_file)):
        fname = f"part-{part:05d}.parquet"
        path = storage.join(table_dir, fname)
        written.append(path)
        rows = _write_file(fetch, names, columns, dtypes, schema, storage, path, first,
                           min(n, first + per_file), row_group_rows, info.dim, progress)
        files.append({"path": f"{rel_dir}/{fname}", "rows": rows, "size": storage.size(path)})
    return {"dim": info.dim, "dtype": info.dtype, "slots": list(info.slots), "rows": n,
            "columns": {"id": "int64", **dtypes}, "files": files}


def _reader(src: Any, names: List[str]) -> Callable[[int, int], Dict[str, Any]]:
    """Rows [a, b) of the named tensors of a full checkpoint (only the segments covering them)."""
    def fetch(a: int, b: int) -> Dict[str, Any]:
        return read_tensors(src.ckpt_dir, names, index=src.index, storage=src.storage,
                            rows={t: [(a, b)] for t in names})
    return fetch


def _decoding_reader(src: Any, table: str, columns: List[str], names: List[str]
                     ) -> Callable[[int, int], Dict[str, Any]]:
    """Rows [a, b) of a table whose embedding is int8 codes, decoded to float32
    (CheckpointSource.read_table: docs/FORMAT.md section 8)."""
    def fetch(a: int, b: int) -> Dict[str, Any]:
        ids, data = src.read_table(table, columns, 0, 1, knobs.get("concurrency"), part=(a, b))
        return {names[0]: ids, **{f"{table}@{c}": data[c] for c in columns}}
    return fetch


def _merged_reader(src: Any, table: str, columns: List[str], names: List[str]
                   ) -> Tuple[Callable[[int, int], Dict[str, Any]], int]:
    """(rows [a, b) of the merged table, its row count) of a delta checkpoint's chain."""
    ids, merged = src.read_table(table, columns, 0, 1, knobs.get("concurrency"))
    whole = {names[0]: ids, **{f"{table}@{c}": merged[c] for c in columns}}

    def fetch(a: int, b: int) -> Dict[str, Any]:
        return {t: v[a:b] for t, v in whole.items()}
    return fetch, int(ids.numel())


def _write_file(fetch: Callable[[int, int], Dict[str, Any]], names: List[str], columns: List[str],
                dtypes: Dict[str, str], schema: pa.Schema,
                storage: Storage, path: str, first: int, stop: int, row_group_rows: int,
                dim: int, progress: Optional[Callable[[int], None]]) -> int:
    """Rows [first, stop) of the table into one file, a row group per `row_group_rows` rows. The
    file appears at `path` only once complete (Storage.write_stream: temporary name + fsync +
    rename locally, one upload remotely; a retried upload writes the file again, and reports its
    rows to `progress` again)."""
    def produce(f: IO[bytes]) -> None:
        with pq.ParquetWriter(ArrowSink(f), schema, use_dictionary=False, write_statistics=["id"]) as writer:
            for start in range(first, stop, row_group_rows):
                end = min(stop, start + row_group_rows)
                data = fetch(start, end)
                arrays = [pa.array(data[names[0]].numpy().astype("int64", copy=False))] + [
                    pa.FixedSizeListArray.from_arrays(to_arrow(data[t], dtypes[c]), dim)
                    for t, c in zip(names[1:], columns)]
                writer.write_table(pa.Table.from_arrays(arrays, schema=schema), row_group_size=row_group_rows)
                if progress is not None:
                    progress(end - start)

    with arrow_errors(path, "writing"):
        storage.write_stream(path, produce)
    return stop - first


class ArrowSink:
    """The storage's file as pyarrow's output: pyarrow must not close it (the storage publishes it
    when `produce` returns)."""

    def __init__(self, f: IO[bytes]):
        self.f, self.closed, self.pos = f, False, 0

    def write(self, data: Any) -> int:
        self.f.write(data)
        n = memoryview(data).nbytes
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
