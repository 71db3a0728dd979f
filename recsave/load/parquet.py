"""Parquet tables of embeddings: the layout recsave.export writes, and ParquetSource, a reader of
such exports (or of any Parquet table with `id` + `embedding` columns) that loads and model banks use
as a source.

Layout written by :func:`to_parquet`::

    <out_dir>/<table>/part-00000.parquet [, part-00001.parquet ...]
    <out_dir>/recsave_export.json        the manifest, written last (its presence completes the export)

Each file has the columns ``id`` (int64), ``embedding`` and one per optimizer slot (``adagrad_acc``,
...), each a ``fixed_size_list<T>[dim]``. Values are stored bit for bit: float16 / float32 / float64
natively, other dtypes (bfloat16, float8...) as the unsigned integers of their bit patterns
(bfloat16 -> uint16); every value column carries its torch dtype in the field metadata
``recsave.dtype`` and the manifest lists it under ``columns``. Rows keep the checkpoint's order.

Manifest (UTF-8 JSON): ``{"format": "recsave.parquet", "format_version": 1, "recsave_version",
"created_at", "export_id", "source", "step", "tables": {name: {"dim", "dtype", "slots", "rows",
"columns": {column: dtype}, "files": [{"path": "<dir>/part-00000.parquet", "rows", "size"}]}}}``;
file paths are relative to the manifest's directory.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recsave import knobs
from recsave.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FormatVersionError,
    RecsaveError,
    UsageError,
)
from recsave.format.dtypes import BY_NAME
from recsave.load.arrow import (
    DTYPE_KEY,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    arrow_errors,
    arrow_type,
    native_dtype,
    numpy_view,
)
from recsave.load.config import TableInfo
from recsave.load.opened import OpenedFiles
from recsave.storage import Storage, get_storage
from recsave.tables import partition


# ------------------------------------------------------------------------------- file system
class _Files:
    """Files under `root` (a local path or fsspec URL), named by paths relative to it, read through
    its Storage (with the storage's retries)."""

    def __init__(self, root: str, storage: Optional[Storage] = None):
        self.root = root
        self.storage = storage or get_storage(root)

    def show(self, rel: str) -> str:
        """The path of `rel` (the root itself for "")."""
        return self.root if not rel else self.storage.join(self.root, *rel.split("/"))

    def parquet(self, rel: str) -> pq.ParquetFile:
        with arrow_errors(self.show(rel), "reading"):
            return pq.ParquetFile(self.storage.open_input(self.show(rel)))


# ------------------------------------------------------------------------------------ reading
@dataclass
class _Column:
    fixed: bool          # fixed_size_list (dim from the type) or a variable-size list
    dim: Optional[int]   # None for variable-size lists until a row was seen
    dtype: str           # torch dtype name


@dataclass
class _Table:
    info: TableInfo
    columns: Dict[str, str]                                      # value column -> torch dtype
    files: List[Tuple[str, int, Optional[int]]] = field(default_factory=list)  # (rel path, rows, size)


def _bad(path: str, column: Optional[str], problem: str, fix: str) -> CorruptCheckpointError:
    where = f"{path}: column {column!r}: " if column else f"{path}: "
    return CorruptCheckpointError(f"{where}{problem}; {fix}", path=path, key=column)


_LAYOUT = ("a recsave Parquet table needs an int64 'id' column and an 'embedding' column of "
           "fixed-size float lists (pa.list_(pa.float32(), dim)); slots are further list columns of the same dim")


def _value_column(f: pa.Field, path: str) -> Optional[_Column]:
    t = f.type
    if pa.types.is_fixed_size_list(t):
        fixed, dim = True, t.list_size
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        fixed, dim = False, None
    else:
        return None
    declared = (f.metadata or {}).get(DTYPE_KEY)
    if declared is not None:
        dtype = declared.decode("utf-8", "replace")
        try:
            expected = arrow_type(dtype)
        except UsageError:
            raise _bad(path, f.name, f"declares unknown recsave.dtype {dtype!r}", "re-export it") from None
        if t.value_type != expected:
            raise _bad(path, f.name, f"declares recsave.dtype {dtype} but stores {t.value_type}", "re-export it")
        return _Column(fixed, dim, dtype)
    native = native_dtype(t.value_type)
    return _Column(fixed, dim, native) if native is not None else None


def _table_meta(schema: pa.Schema) -> Optional[Dict[str, Any]]:
    """A recsave file's `recsave.table` metadata (an export's or a delta feed's), else None."""
    raw = (schema.metadata or {}).get(b"recsave.table")
    try:
        meta = json.loads(raw) if raw else None
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _exported_rows(schema: pa.Schema) -> Optional[int]:
    """The rows of the whole table a recsave export's file says the export wrote (its
    `recsave.table` metadata, since format 1's `rows`); None for other files and older exports."""
    meta = _table_meta(schema)
    rows = meta.get("rows") if meta is not None and "old" not in meta else None
    return rows if type(rows) is int and rows >= 0 else None


def _is_delta_feed(schema: pa.Schema) -> bool:
    """Whether the file is an export_delta feed's: its `recsave.table` metadata names the two
    checkpoints compared (`old`, `new`), which a table export's never does; or, where a rewrite
    (pandas, Spark) dropped the metadata, it has the feed's string `op` and numeric `step` columns.
    Loaded as a table, a feed would replace the table with its few changed rows."""
    meta = _table_meta(schema)
    if meta is not None and "old" in meta and "new" in meta:
        return True
    names = schema.names
    if "op" not in names or "step" not in names:
        return False
    op, step = schema.field("op").type, schema.field("step").type
    if pa.types.is_dictionary(op):
        op = op.value_type
    stringy = pa.types.is_string(op) or pa.types.is_large_string(op) or \
        getattr(pa.types, "is_string_view", lambda _: False)(op)  # view strings: polars, newer Arrow
    # A feed's `step` is int64, null where the checkpoint id has no step; pandas turns an integer
    # column with nulls into float64, and an all-null one may come back as type null.
    numeric = pa.types.is_integer(step) or pa.types.is_floating(step) or pa.types.is_null(step)
    return stringy and numeric


def _parse_schema(schema: pa.Schema, path: str) -> Dict[str, _Column]:
    """Value columns (`embedding` first, then slots) of a file; CorruptCheckpointError when it is
    not a recsave Parquet table."""
    names = schema.names
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _bad(path, dup[0], "appears more than once", "rename the duplicate column")
    for required in ("id", "embedding"):
        if required not in names:
            raise _bad(path, None, f"no {required!r} column (columns: {names[:20]})", _LAYOUT)
    if _is_delta_feed(schema):
        raise UsageError(f"{path} is part of an export_delta feed (upserts and deletes since another "
                         f"checkpoint: its metadata, or its string 'op' and numeric 'step' columns, say so), "
                         f"not a table; load the checkpoint itself or a to_parquet export of it (a table "
                         f"with such columns: drop or rename them)", path=path)
    if schema.field("id").type != pa.int64():
        raise _bad(path, "id", f"is {schema.field('id').type}, expected int64",
                   "cast it, e.g. table.set_column(i, 'id', table['id'].cast(pa.int64()))")
    emb = _value_column(schema.field("embedding"), path)
    if emb is None:
        raise _bad(path, "embedding", f"is {schema.field('embedding').type}", _LAYOUT)
    cols = {"embedding": emb}
    for f in schema:
        if f.name in ("id", "embedding") or not f.name or "@" in f.name:
            continue
        col = _value_column(f, path)
        if col is None:
            continue
        if col.dim is not None and emb.dim is not None and col.dim != emb.dim:
            raise _bad(path, f.name, f"holds lists of {col.dim} values but 'embedding' has {emb.dim}",
                       "slot columns must have the embedding's dim; drop or fix the column")
        cols[f.name] = col
    return cols


class ParquetSource:
    """A table source read from Parquet: a :func:`to_parquet` export (its manifest), a single Parquet
    file or a directory of Parquet files with `id` + `embedding` columns (one table named after the
    file or directory, without `.parquet`)."""

    def __init__(self, path: str):
        if not isinstance(path, str) or not path:
            raise UsageError(f"path must be a non-empty string, got {path!r}")
        self.path = path
        storage = get_storage(path)
        if not storage.exists(path):
            raise CheckpointNotFoundError(f"{path} does not exist; give a to_parquet output directory, a "
                                          f"Parquet file or a directory of Parquet files", path=path)
        self.step: Optional[int] = None  # the exported checkpoint's step (exports only)
        # its sparse optimizer's step count per table, when the export recorded them (exports only)
        self.optimizer_steps: Optional[Dict[str, int]] = None
        # plain files as opened (an export's have sizes in its manifest): ids and values are read
        # in two passes, and a file written again in between would give ids the rows of others
        self._opened = OpenedFiles(storage)
        if storage.isdir(path, follow_links=True):
            self._files = _Files(path, storage)
            if storage.exists(self._files.show(MANIFEST)):
                self._load_manifest()
                return
            files = [n for n in storage.listdir(path) if n.endswith(".parquet") and not n.startswith((".", "_"))]
            if not files:
                raise CheckpointNotFoundError(f"{path}: neither {MANIFEST} nor *.parquet files found; give a "
                                              f"to_parquet output directory or Parquet files", path=path)
            self._load_plain(_leaf_name(storage, path), files, whole_table=True)
            return
        parent, leaf = storage.split(path)
        self._files = _Files(parent, storage)
        if leaf == MANIFEST:
            self.path = parent
            self._load_manifest()
        else:
            self._load_plain(_leaf_name(storage, path), [leaf])

    # -------------------------------------------------------------------------------- opening
    def _load_manifest(self) -> None:
        where = self._files.show(MANIFEST)
        raw = self._files.storage.read_bytes(where, MAX_MANIFEST_BYTES)
        self.version = hashlib.sha256(raw).hexdigest()
        try:
            m = json.loads(raw.decode("utf-8"))
            if not isinstance(m, dict) or m.get("format") != FORMAT:
                raise ValueError(f"'format' is not {FORMAT!r}")
            if m.get("format_version") != FORMAT_VERSION:
                raise FormatVersionError(f"{where}: format_version {m.get('format_version')!r} is not "
                                         f"{FORMAT_VERSION}; upgrade recsave or re-export", path=where)
            self._tables = {str(name): _manifest_table(t) for name, t in m["tables"].items()}
            steps = {str(name): t["optimizer_steps"] for name, t in m["tables"].items() if "optimizer_steps" in t}
            if any(type(v) is not int or not 0 <= v < 1 << 63 for v in steps.values()):
                raise ValueError(f"optimizer_steps must be ints in [0, 2**63), got {steps}")
            self.optimizer_steps = steps or None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, RecsaveError):
                raise
            raise _bad(where, None, f"not a recsave export manifest ({exc!r})", "re-export") from None
        self.step = m.get("step") if type(m.get("step")) is int else None

    def _load_plain(self, name: str, files: List[str], whole_table: bool = False) -> None:
        """A table of plain Parquet files (`whole_table`: a directory's, which must then hold every
        row of a recsave export's table whose files it holds)."""
        cols: Dict[str, _Column] = {}
        entries: List[Tuple[str, int, Optional[int]]] = []
        exported: Optional[int] = None  # the rows recsave's export wrote of the table (its files say)
        for rel in sorted(files):
            pf = self._files.parquet(rel)
            exported = _exported_rows(pf.schema_arrow) if exported is None else exported
            these = _parse_schema(pf.schema_arrow, self._files.show(rel))
            if entries and _shape_of(these) != _shape_of(cols):
                raise _bad(self._files.show(rel), None, f"its list columns differ from those of {entries[0][0]!r}",
                           "every file of a table needs the same id / embedding / slot columns")
            cols = cols or these
            entries.append((rel, pf.metadata.num_rows, None))
            for k, c in cols.items():  # a variable-size list's dim: its first row's length
                if c.dim is None and pf.metadata.num_rows:
                    with arrow_errors(self._files.show(rel), "reading"):
                        first = next(pf.iter_batches(batch_size=1, columns=[k])).column(0)
                    c.dim = len(first[0]) if first[0].is_valid else None
        emb = cols["embedding"]
        for k, c in cols.items():
            if c.dim is None or c.dim != emb.dim:
                raise _bad(self._files.show(entries[0][0]), k,
                           "is a variable-size list whose first row is null or missing" if c.dim is None else
                           f"holds lists of {c.dim} values but 'embedding' has {emb.dim}",
                           "write fixed-size lists (pa.list_(pa.float32(), dim)) of the embedding's dim")
        slots = tuple(k for k in cols if k != "embedding")
        rows = sum(e[1] for e in entries)
        if whole_table and exported is not None and rows != exported:
            raise _bad(self.path, None, f"its Parquet files hold {rows} rows, but recsave exported table {name!r} "
                                        f"with {exported} (an export interrupted before its manifest, or files "
                                        f"missing)", "export the checkpoint again, or load a complete export's "
                                        "directory (the one holding its manifest)")
        dim = cast(int, emb.dim)  # every column's dim was checked above
        self._tables = {name: _Table(TableInfo(dim, emb.dtype, slots, rows, {s: cols[s].dtype for s in slots}),
                                     {k: c.dtype for k, c in cols.items()}, entries)}
        token = hashlib.sha256()
        for rel, _, _ in entries:
            token.update(f"{rel}\0{self._opened.record(self._files.show(rel))}\0".encode())
        self.version = token.hexdigest()

    # -------------------------------------------------------------------------------- queries
    def tables(self) -> Dict[str, TableInfo]:
        return {n: TableInfo(t.info.dim, t.info.dtype, tuple(t.info.slots), t.info.rows, dict(t.info.slot_dtypes))
                for n, t in self._tables.items()}

    def _table(self, table: str) -> _Table:
        if table not in self._tables:
            raise ConfigError(f"{self.path}: no table {table!r}; it has {sorted(self._tables)}",
                              path=self.path, key=table)
        return self._tables[table]

    def _columns(self, t: _Table, table: str, columns: Sequence[str]) -> List[str]:
        cols = list(dict.fromkeys([columns] if isinstance(columns, str) else columns))
        unknown = [c for c in cols if c not in t.columns]
        if unknown:
            raise ConfigError(f"{self.path}: table {table!r} has no column(s) {unknown}; it has "
                              f"{list(t.columns)}", path=self.path, key=table)
        return cols

    def bytes_for(self, table: str, columns: Sequence[str]) -> int:
        t = self._table(table)
        cols = self._columns(t, table, columns)
        return t.info.rows * (8 + sum(t.info.dim * BY_NAME[t.columns[c]].itemsize for c in cols))

    def read_table(self, table: str, columns: Sequence[str], rank: int = 0, world: int = 1,
                   num_buckets: int = partition.DEFAULT_NUM_BUCKETS) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """(ids, {column: [n, dim] values}) of the rows whose ids rank `rank` of `world` owns, in
        stored order. Reads in bounded batches; memory is the result plus one batch."""
        t = self._table(table)
        cols = self._columns(t, table, columns)
        partition.bucket_range(rank, world, num_buckets)  # validates rank / world
        dim = t.info.dim
        row_bytes = 8 + sum(dim * BY_NAME[t.columns[c]].itemsize for c in cols)
        batch = max(1, min(65536, knobs.get("io_chunk_bytes") // row_bytes))
        id_parts: List[np.ndarray] = []
        masks: List[Optional[np.ndarray]] = []
        for rel, rows, size in t.files:
            pf = self._open_checked(t, rel, size, cols)
            file_masks, seen = [], 0
            with arrow_errors(self._files.show(rel), "reading"):
                for b in pf.iter_batches(batch_size=batch, columns=["id"]):
                    col = b.column(0)
                    if col.null_count:
                        raise _bad(self._files.show(rel), "id", "has null ids", "drop or fill those rows")
                    ids = col.to_numpy()
                    seen += len(ids)
                    if world > 1:
                        m = (partition.owner_of(torch.from_numpy(ids.copy()), world, num_buckets) == rank).numpy()
                        file_masks.append(m)
                        ids = ids[m]
                    id_parts.append(ids)
            if seen != rows:
                raise _bad(self._files.show(rel), None, f"has {seen} rows, expected {rows}", "re-export the table")
            masks.append(np.concatenate(file_masks) if world > 1 and file_masks else None)
        ids_out = torch.from_numpy(np.concatenate(id_parts)) if id_parts else torch.empty(0, dtype=torch.int64)
        n = ids_out.numel()
        out = {c: torch.empty((n, dim), dtype=BY_NAME[t.columns[c]].torch_dtype) for c in cols}
        if not cols or not n:
            self._check_unchanged(t)
            return ids_out, out
        dest = {c: numpy_view(out[c], t.columns[c]) for c in cols}
        pos = 0
        for (rel, _rows, size), mask in zip(t.files, masks):
            pf = self._open_checked(t, rel, size, cols)
            row = 0
            with arrow_errors(self._files.show(rel), "reading"):
                for b in pf.iter_batches(batch_size=batch, columns=cols):
                    k = b.num_rows
                    sel = None if mask is None else mask[row:row + k]
                    take = k if sel is None else int(sel.sum())
                    if pos + take > n:
                        raise _bad(self._files.show(rel), None, "changed while it was read", "read it again")
                    for c in cols:
                        vals = _values(b.column(c), dim, self._files.show(rel), c, row)
                        dest[c][pos:pos + take] = vals if sel is None else vals[sel]
                    row += k
                    pos += take
        if pos != n:
            raise _bad(self.path, None, f"table {table!r} changed while it was read", "read it again")
        self._check_unchanged(t)
        return ids_out, out

    def _check_unchanged(self, t: _Table) -> None:
        self._opened.check(self._files.show(rel) for rel, _, _ in t.files)

    def _open_checked(self, t: _Table, rel: str, size: Optional[int], cols: List[str]) -> pq.ParquetFile:
        where = self._files.show(rel)
        if size is not None:
            try:
                actual = self._files.storage.size(where)
            except CheckpointNotFoundError:
                raise CheckpointNotFoundError(f"{where}: file listed in {MANIFEST} is missing; re-export",
                                              path=where) from None
            if actual != size:
                raise _bad(where, None, f"is {actual} bytes, the manifest records {size}",
                           "the export was changed after it was written; re-export")
        pf = self._files.parquet(rel)
        found = _parse_schema(pf.schema_arrow, where)
        for c in cols:
            col = found.get(c)
            if col is None or col.dtype != t.columns[c] or (col.dim is not None and col.dim != t.info.dim):
                what = "is missing" if col is None else f"holds {col.dtype}[{col.dim}]"
                raise _bad(where, c, f"{what}, expected {t.columns[c]}[{t.info.dim}]",
                           "every file of a table needs the same columns; re-export")
        return pf


def _values(arr: pa.Array, dim: int, where: str, column: str, row0: int) -> np.ndarray:
    """[k, dim] numpy values (Arrow storage type) of a list column batch; ragged or null rows refused."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count:
        raise _bad(where, column, "has null rows", "drop or fill those rows")
    if not pa.types.is_fixed_size_list(arr.type):
        lengths = np.diff(np.asarray(arr.offsets))
        bad = np.flatnonzero(lengths != dim)
        if bad.size:
            raise _bad(where, column, f"row {row0 + int(bad[0])} has {int(lengths[bad[0]])} values, expected "
                       f"{dim} (a ragged list)", "every row needs exactly dim values; fix or drop those rows")
    flat = arr.flatten()
    if flat.null_count or len(flat) != len(arr) * dim:
        raise _bad(where, column, "has null values inside its lists", "fill them (e.g. with 0) or drop the rows")
    return flat.to_numpy(zero_copy_only=False).reshape(len(arr), dim)


def _manifest_table(t: Dict[str, Any]) -> _Table:
    dim, rows = t["dim"], t["rows"]
    if type(dim) is not int or dim < 1 or type(rows) is not int or rows < 0:
        raise ValueError(f"bad dim {dim!r} or rows {rows!r}")
    columns = {str(k): str(v) for k, v in t["columns"].items() if k != "id"}
    slots = tuple(str(s) for s in t["slots"])
    if t["dtype"] not in BY_NAME or "embedding" not in columns or set(columns) != {"embedding", *slots} \
            or any(v not in BY_NAME for v in columns.values()):
        raise ValueError(f"columns {sorted(columns)} / dtypes do not match slots {list(slots)}")
    files: List[Tuple[str, int, Optional[int]]] = []
    for f in t["files"]:
        rel = f["path"]
        parts = rel.split("/") if isinstance(rel, str) else [""]
        if any(p in ("", ".", "..") or "\\" in p for p in parts) or type(f["rows"]) is not int \
                or type(f["size"]) is not int:
            raise ValueError(f"bad file entry {f!r}")
        files.append((rel, f["rows"], f["size"]))
    if sum(f[1] for f in files) != rows:
        raise ValueError(f"file rows do not add up to {rows}")
    return _Table(TableInfo(dim, str(t["dtype"]), slots, rows, {s: columns[s] for s in slots}), columns, files)


def _shape_of(cols: Dict[str, _Column]) -> Dict[str, tuple]:
    return {k: (c.fixed, c.dim if c.fixed else None, c.dtype) for k, c in cols.items()}


def _leaf_name(storage: Storage, path: str) -> str:
    """Table name of a plain Parquet file or directory: its base name without `.parquet`."""
    leaf = storage.split(path)[1]
    return leaf[: -len(".parquet")] if leaf.endswith(".parquet") and len(leaf) > len(".parquet") else leaf


def is_parquet_source(path: str) -> bool:
    """True for a to_parquet output (manifest), a `*.parquet` file or a directory of them."""
    try:
        storage = get_storage(path)
        if not storage.exists(path):
            return False
        base = storage.split(path)[1]
        if not storage.isdir(path, follow_links=True):
            return base.endswith(".parquet") or base == MANIFEST
        names = storage.listdir(path)
        return MANIFEST in names or (any(n.endswith(".parquet") and not n.startswith((".", "_")) for n in names)
                                     and "index" not in names)
    except (RecsaveError, OSError, ValueError):
        return False
