"""Serving export (``recsave export-serving`` on the command line): a checkpoint's embeddings only,
as int8 / float16 / bfloat16 / float32 rows, written as a recsave checkpoint of kind "serving"
(docs/FORMAT.md section 8) that Saver.load and the model bank read like any other.

Rows keep the source's layout: each source rank's chunk of a table becomes one chunk with the same
bucket ranges (written by format/writer.write_shards, checksum segments cut at bucket boundaries),
so a serving checkpoint saved by N ranks loads on M."""
from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from recsave import argcheck, knobs
from recsave.argcheck import check
from recsave.errors import CheckpointExistsError, UsageError
from recsave.format import ckptlist, torchio
from recsave.format import index as index_mod
from recsave.format import segments as bucket_rule
from recsave.format.quant import SCALE_DTYPES, quantize_rows
from recsave.format.reader import read_tensors
from recsave.format.records import (
    KIND_FULL,
    KIND_SERVING,
    QUANT_INT8,
    IndexPart,
    Meta,
    TableMeta,
    version_for,
)
from recsave.format.writer import RowSource, write_shards
from recsave.save.layout import segment_rule
from recsave.storage import Storage, get_storage
from recsave.storage.lock import WriterLock, check_held, renewed, still_owned
from recsave.storage.lock import hold as hold_writer_lock
from recsave.tools import toolargs

__all__ = ["export_serving", "SERVING_DTYPES"]

MODEL_FILE = "model.pt"
# dtype argument -> the dtype of the stored rows (None: int8 codes with scale / offset)
SERVING_DTYPES: Dict[str, Optional[torch.dtype]] = {
    "int8": None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
}


def export_serving(ckpt: str, out_dir: str, dtype: str = "int8", tables: Optional[Sequence[str]] = None, *,
                   scale_dtype: str = "float16", ckpt_id: Optional[str] = None) -> str:
    """Writes the embeddings of checkpoint `ckpt` (a checkpoint dir, or an output dir: its latest
    checkpoint) and its dense parameters (model.pt) into `out_dir` as a committed checkpoint of kind
    "serving"; no optimizer slots, extras or io states. Returns the new checkpoint's directory,
    `<out_dir>/<ckpt_id>` (by default the source's id), listed in `<out_dir>/checkpoint`.

    `dtype`: "int8" (per-row affine codes with `scale_dtype` ("float16" or "float32") scale and
    offset, docs/FORMAT.md section 8), "fp16", "bf16" or "fp32" (rows cast with ``Tensor.to``).
    `tables`: a table name or a list of them (default: all). Raises ConfigError for an unknown table,
    CheckpointExistsError when `<out_dir>/<ckpt_id>` exists, UsageError for a source that is not a
    full or delta checkpoint or rows int8 cannot hold (NaN / inf). A delta is exported as the merged
    state of its chain: compacted first into a local temporary directory (room for one full
    checkpoint), then exported from there. On failure the new directory is removed, and `out_dir`
    when it made it and nothing else is there."""
    where = "export_serving"
    argcheck.path(ckpt, "ckpt", where)
    argcheck.path(out_dir, "out_dir", where)
    check(dtype, str, "dtype", where)
    check(scale_dtype, str, "scale_dtype", where)
    check(ckpt_id, str, "ckpt_id", where, optional=True)
    toolargs.check_tables_arg(tables, where)
    if dtype not in SERVING_DTYPES:
        raise UsageError(f"dtype must be one of {list(SERVING_DTYPES)}, got {dtype!r}", key="dtype")
    if scale_dtype not in SCALE_DTYPES:
        raise UsageError(f"scale_dtype must be one of {list(SCALE_DTYPES)}, got {scale_dtype!r}",
                         key="scale_dtype")
    from recsave.load.sources import open_source, require_checkpoint  # not at import time: sources imports tools.export

    src = open_source(ckpt)
    require_checkpoint(src, ckpt, "export_serving")
    storage = get_storage(out_dir)
    toolargs.refuse_source_dirs(src, storage, out_dir, where, "a serving checkpoint")
    kind = getattr(src, "kind", "checkpoint")
    if kind != "chain" and (kind != "checkpoint" or src.index.kind != KIND_FULL):
        raise UsageError(f"{src.ckpt_dir} is not a full or delta recsave checkpoint (it is "
                         f"{getattr(src.index, 'kind', 'Parquet')}); export from a checkpoint a Saver wrote",
                         path=src.ckpt_dir)
    # Checked before a delta's chain is compacted (a full checkpoint's worth of temporary space):
    # errors name the source, not the temporary copy.
    names = toolargs.select_tables(tables, list(src.contents.tables), f"the checkpoint {src.ckpt_dir}", src.ckpt_dir)
    ckpt_id = ckptlist.validate_id(ckpt_id if ckpt_id is not None else storage.split(src.ckpt_dir)[1])
    if kind == "chain":  # a delta: export the merged state of its chain
        target = storage.join(out_dir, ckpt_id)
        if storage.exists(storage.join(target, index_mod.INDEX_FILE)):  # checked again under the lock
            raise CheckpointExistsError(f"{target} exists already; export to another out_dir or ckpt_id, "
                                        f"or delete it first", path=target)
        from recsave.tools.compact import compact
        with tempfile.TemporaryDirectory(prefix="recsave-serving-") as tmp:
            full = compact(src.ckpt_dir, tmp)  # (same id: the export keeps the delta's id)
            return export_serving(full, out_dir, dtype, names, scale_dtype=scale_dtype, ckpt_id=ckpt_id)
    created = toolargs.missing_dirs(storage, out_dir)  # removed again (when empty) on failure
    storage.makedirs(out_dir)
    try:
        return _export_locked(src, names, dtype, scale_dtype, storage, out_dir, ckpt_id)
    except BaseException:
        toolargs.undo_writes(storage, [], created)  # after the lock's release: its file is gone
        raise


def _export_locked(src: Any, names: List[str], dtype: str, scale_dtype: str, storage: Storage, out_dir: str,
                   ckpt_id: str) -> str:
    """export_serving's writes into `out_dir`, under its writer lock: the checkpoint `ckpt_id`,
    then the list naming it."""
    lock = hold_writer_lock(None, storage, out_dir)
    try:
        listed = list(ckptlist.committed(storage, out_dir, rewrite=True).ids)
        ckpt_dir = storage.join(out_dir, ckpt_id)
        if storage.exists(ckpt_dir):
            # A killed export's leftover (recsave's files, no index), found under the lock, goes;
            # anything else is refused.
            leftover = not storage.exists(storage.join(ckpt_dir, index_mod.INDEX_FILE)) and \
                ckptlist.looks_like_checkpoint(storage, out_dir, ckpt_id)  # a lone model.pt may be anyone's
            if not leftover:
                raise CheckpointExistsError(f"{ckpt_dir} exists already; export to another out_dir or ckpt_id, "
                                            f"or delete it first", path=ckpt_dir)
            storage.remove_tree(ckpt_dir)
        storage.makedirs(ckpt_dir)
        try:
            _write(src, names, SERVING_DTYPES[dtype], SCALE_DTYPES[scale_dtype], storage, ckpt_dir, lock)
        except BaseException:
            with contextlib.suppress(Exception):  # the export's own error is the one to report
                if still_owned(lock):  # else another writer may be writing this id now
                    storage.remove_tree(ckpt_dir)
            raise
        ckptlist.write(storage, out_dir, [i for i in listed if i != ckpt_id] + [ckpt_id])
    finally:
        if lock is not None:
            lock.release()
    return ckpt_dir


def _write(src: Any, names: List[str], dtype: Optional[torch.dtype], scale_dtype: torch.dtype,
           storage: Storage, ckpt_dir: str, lock: Optional[WriterLock]) -> None:
    """Shards of every table, model.pt, then the index (the commit point), checking `lock` before
    each table and renewing it before the index."""
    parts: Dict[int, IndexPart] = {}
    tables: Dict[str, TableMeta] = {}
    for name in names:
        check_held(lock)  # no table written into a directory another writer may own now
        info = src.contents.tables[name]
        rows = 0
        for k, part in enumerate(_table_parts(src, name, info.dim, dtype, scale_dtype, storage, ckpt_dir,
                                              {r: len(p.files) for r, p in parts.items()})):
            parts[k] = parts[k].joined(part) if k in parts else part
            rows += part.tensors[f"{name}@id"].shape[0]
        out_dtype = "float32" if dtype is None else str(dtype).replace("torch.", "")
        tables[name] = TableMeta(info.dim, out_dtype, (), rows, QUANT_INT8 if dtype is None else None)
    meta = src.index.meta
    files = {}
    if MODEL_FILE in src.index.files:
        files[MODEL_FILE] = torchio.save(storage, ckpt_dir, MODEL_FILE, src.read_pt(MODEL_FILE), 0)
    index = index_mod.merge_parts(list(parts.values()), step=src.index.step, partition=src.index.partition,
                                  meta=Meta(tables, dict(meta.dense), (), ()),
                                  world_size=max(src.index.world_size, len(parts), 1))
    index = dataclasses.replace(index, kind=KIND_SERVING,
                                format_version=version_for(KIND_SERVING, index.tensors)).with_files(files)
    renewed(lock)
    index_mod.write(ckpt_dir, index, storage=storage)


def _table_parts(src: Any, name: str, dim: int, dtype: Optional[torch.dtype], scale_dtype: torch.dtype,
                 storage: Storage, ckpt_dir: str, first_parts: Dict[int, int]) -> List[IndexPart]:
    """One index part per chunk of the source's `<name>@id` (one per source rank): the same rows
    and bucket ranges, written as rank k's files."""
    out = []
    emb = f"{name}@embedding"
    for k, chunk in enumerate(src.index.tensor(f"{name}@id").chunks):
        c0, c1 = chunk.rows or (0, 0)
        n = c1 - c0
        tensors: Dict[str, Any] = {f"{name}@id": _read(src, f"{name}@id", c0, c1)}
        if dtype is None:
            codes, scale, offset = _quantise(src, name, c0, c1, dim, scale_dtype)
            tensors.update({emb: codes, f"{name}@scale": scale, f"{name}@offset": offset})
        elif n == 0:
            tensors[emb] = torch.empty(0, dim, dtype=dtype)
        else:
            tensors[emb] = RowSource(dtype, (n, dim), _caster(src, name, c0, dtype))
        rules = {t: segment_rule(_row_bytes(v)) for t, v in tensors.items()}
        segments: Dict[str, Any]
        if chunk.buckets is not None:  # the index names the rule
            segments, chunk_meta = rules, {t: {"buckets": chunk.buckets} for t in tensors}
        else:  # no buckets to apply it to: the ends it gives the chunk as one bucket, listed
            segments = {t: list(bucket_rule.ends((0, n), _row_bytes(tensors[t]), rule)) for t, rule in rules.items()}
            chunk_meta = None
        out.append(write_shards(ckpt_dir, tensors, rank=k, storage=storage, first_part=first_parts.get(k, 0),
                                segments=segments, chunk_meta=chunk_meta))
    return out


def _read(src: Any, tensor: str, a: int, b: int) -> torch.Tensor:
    return read_tensors(src.ckpt_dir, [tensor], index=src.index, storage=src.storage,
                        rows={tensor: [(a, b)]})[tensor]


def _caster(src: Any, name: str, c0: int, dtype: torch.dtype) -> Any:
    """fetch(a, b) of a RowSource: embedding rows [c0 + a, c0 + b) of table `name`, cast to
    `dtype`; UsageError when a finite value does not fit it (fp16 tops out at 65504)."""
    def fetch(a: int, b: int) -> torch.Tensor:
        rows = _read(src, f"{name}@embedding", c0 + a, c0 + b)
        out = rows.to(dtype)
        # Only a cast to a narrower range can overflow; one pass over the result unless it did.
        narrows = rows.dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(rows.dtype).max
        if narrows and bool(torch.isinf(out).any()):
            overflow = torch.isinf(out) & torch.isfinite(rows)
            if bool(overflow.any()):
                row = c0 + a + int(overflow.any(dim=1).nonzero()[0, 0])
                largest = rows[overflow].abs().max()
                # only the wider serving dtypes that hold it (a float64 1e300 fits none)
                fits = [n for n, d in (("bf16", torch.bfloat16), ("fp32", torch.float32))
                        if torch.finfo(d).max > torch.finfo(dtype).max and bool(torch.isfinite(largest.to(d)))]
                hint = f"export it as {' or '.join(fits)}" if fits else "no serving dtype holds it"
                raise UsageError(f"table {name!r}: row {row} of the checkpoint holds values beyond what {dtype} "
                                 f"can hold (largest {float(largest):g}); {hint}", key=name)
        return out
    return fetch


def _quantise(src: Any, name: str, c0: int, c1: int, dim: int, scale_dtype: torch.dtype
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 codes, scale and offset of rows [c0, c1), read and quantised a block at a time (the
    source's float rows are never all in memory)."""
    n = c1 - c0
    codes = torch.empty(n, dim, dtype=torch.int8)
    scale = torch.empty(n, 1, dtype=scale_dtype)
    offset = torch.empty(n, 1, dtype=scale_dtype)
    block = max(1, knobs.get("write_block_bytes") // max(4 * dim, 1))
    for a in range(0, n, block):
        b = min(n, a + block)
        rows = _read(src, f"{name}@embedding", c0 + a, c0 + b)
        codes[a:b], scale[a:b], offset[a:b] = quantize_rows(rows, scale_dtype, what=f"table {name!r} of "
                                                            f"{src.ckpt_dir}, rows from {c0 + a}")
    return codes, scale, offset


def _row_bytes(t: Any) -> int:
    n = t.dtype.itemsize
    for d in t.shape[1:]:
        n *= d
    return n
