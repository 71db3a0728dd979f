"""Compaction: a delta checkpoint's merged state (its whole chain applied, docs/FORMAT.md section 10)
written as one full checkpoint, with the same id, into another output dir (``recsave compact``)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, List, Optional

import torch

from recsave import argcheck, knobs
from recsave.errors import CheckpointExistsError, UsageError
from recsave.format import ckptlist, torchio
from recsave.format import index as index_mod
from recsave.format.commits import DeferredCommits
from recsave.format.records import KIND_DELTA, KIND_FULL, FileEntry, IndexPart, Meta, TableMeta
from recsave.format.writer import write_shards
from recsave.load.sources import CheckpointSource, open_source, require_checkpoint
from recsave.save.layout import bucket_layout
from recsave.save.snapshot import TableState
from recsave.storage import Storage, get_storage
from recsave.storage.lock import WriterLock, check_held, renewed, still_owned
from recsave.storage.lock import hold as hold_writer_lock
from recsave.tables import partition
from recsave.tables.rows import META_COLUMNS
from recsave.tools import toolargs


def compact(ckpt: str, out_dir: str) -> str:
    """Writes checkpoint `ckpt` (a checkpoint directory, or an output dir: its latest) as a full
    checkpoint with the same id into `out_dir`, committed (listed in out_dir's `checkpoint` file);
    returns its path. A full checkpoint is copied as it merges: rows, row metadata, dense state,
    extras and io states (the .pt files byte for byte). Loads of the result equal loads of `ckpt`.
    CheckpointExistsError when out_dir has that checkpoint committed already."""
    argcheck.path(ckpt, "ckpt", "compact")
    argcheck.path(out_dir, "out_dir", "compact")
    src = open_source(ckpt)
    require_checkpoint(src, ckpt, "compact")
    assert isinstance(src, CheckpointSource)
    if src.index.kind not in (KIND_FULL, KIND_DELTA):
        raise UsageError(f"{src.ckpt_dir} is a {src.index.kind!r} checkpoint; compact takes full and delta "
                         f"checkpoints", path=src.ckpt_dir)
    ckpt_id = ckptlist.validate_id(src.storage.split(src.ckpt_dir)[1])  # not `checkpoint`, the lock, ...
    storage = get_storage(out_dir)
    toolargs.refuse_source_dirs(src, storage, out_dir, "compact", "the compacted checkpoint", output_dir=False)
    target = storage.join(out_dir, ckpt_id)

    def refuse_committed() -> None:
        if storage.exists(storage.join(target, index_mod.INDEX_FILE)):
            raise CheckpointExistsError(f"{target} exists already; compact into another output dir or remove it",
                                        path=target)
    refuse_committed()
    made = toolargs.missing_dirs(storage, out_dir)  # removed again (when empty) if the compaction fails
    storage.makedirs(out_dir)
    try:
        _compact_locked(src, storage, out_dir, target, refuse_committed)
    except BaseException:
        toolargs.undo_writes(storage, [], made)  # after the lock's release: its file is gone
        raise
    return target


def _compact_locked(src: CheckpointSource, storage: Storage, out_dir: str, target: str,
                    refuse_committed: Callable[[], None]) -> None:
    """compact's writes into `out_dir`, under its writer lock: the checkpoint `target`, then the list
    naming it; nothing of a failed compaction stays in `target`."""
    ckpt_id = storage.split(target)[1]
    lock = hold_writer_lock(None, storage, out_dir)
    created = committed = False
    try:
        refuse_committed()  # again under the lock: another compaction may have committed it meanwhile
        if storage.exists(target):  # no index: a leftover of an interrupted compaction, under our lock
            if ckptlist.holds_foreign_files(storage, out_dir, ckpt_id, own_dir=False):
                raise CheckpointExistsError(
                    f"{target} exists and is a file or holds files recsave did not write; compact into "
                    f"another output dir or move it away", path=target)
            storage.remove_tree(target)
        storage.makedirs(target)
        created = True
        index = _write(src, storage, target, lock)
        renewed(lock)
        index_mod.write(target, index, storage=storage)
        committed = True  # the index is the commit point (docs/FORMAT.md section 5)
        ids = [i for i in ckptlist.committed(storage, out_dir, rewrite=True, being_written=ckpt_id).ids
               if i != ckpt_id]
        ckptlist.write(storage, out_dir, ids + [ckpt_id])
    except BaseException:
        # Nothing of a failed compaction stays behind to block its retry, unless the lock is
        # another writer's now (it may be writing the same id).
        if created and not committed:
            with contextlib.suppress(Exception):
                if still_owned(lock):
                    storage.remove_tree(target)
        raise
    finally:
        if lock is not None:
            lock.release()


def _write(src: CheckpointSource, storage, target: str, lock: Optional[WriterLock]) -> index_mod.Index:
    meta = src.index.meta
    assert meta is not None  # open_source's contents need it
    num_buckets = src.index.partition.num_buckets if src.index.partition is not None else partition.DEFAULT_NUM_BUCKETS
    part = IndexPart(0, {}, {})
    tables: Dict[str, TableMeta] = {}
    threads = knobs.get("concurrency")
    with DeferredCommits() as commits:
        for name, info in meta.tables.items():
            check_held(lock)  # no table written into a directory another writer may own now
            columns = ["embedding", *info.slots]
            row_meta = [m for m in META_COLUMNS if f"{name}@{m}" in src.index.tensors]
            ids, data = src.read_table(name, columns + row_meta, 0, 1, threads)
            assert ids is not None
            state = TableState(info.dim, getattr(torch, info.dtype), {c: data[c].contiguous() for c in columns},
                               ids, torch.arange(ids.numel(), dtype=torch.int64),
                               meta={m: data[m].contiguous() for m in row_meta}, step=info.step)
            layout = bucket_layout(name, state, 0, 1, num_buckets)
            part = part.joined(write_shards(target, layout.tensors, rank=0, concurrency=threads, storage=storage,
                                            chunk_meta={t: layout.chunk_meta(t) for t in layout.tensors},
                                            first_part=len(part.files), segments=layout.segments,
                                            commits=commits))
            tables[name] = TableMeta(info.dim, info.dtype, info.slots, int(ids.numel()), step=info.step)
        check_held(lock)  # before the durable files' renames as the block exits
    files: Dict[str, FileEntry] = {}
    for fname in _small_files(src):
        entry = src.index.file(fname)
        raw = torchio.read_bytes(src.storage, src.ckpt_dir, fname, src.index)  # CRC checked
        files[fname] = torchio.save_bytes(storage, target, fname, raw, entry.rank)
    # The metrics describe the state, which is the same: keep_best in out_dir ranks it by them. The
    # retention record is the source dir's policy, not out_dir's: not carried.
    index = index_mod.merge_parts([part], step=src.index.step, world_size=1, partition=src.index.partition,
                                  meta=Meta(tables, meta.dense, meta.extras, meta.io_states, src.index.io_state_count),
                                  metrics=src.index.metrics)
    return dataclasses.replace(index.with_files(files), created_at=src.index.created_at)


def _small_files(src: CheckpointSource) -> List[str]:
    """The files of the checkpoint that are not shard files (.pt files, io_state_count): the io
    states first, as a save writes them, so that a compaction killed while uploading a later one
    leaves a directory gc recognises as recsave's (ckptlist.writes_there)."""
    return sorted((n for n in src.index.files if not n.endswith(".safetensors")),
                  key=lambda n: (not n.startswith("io_state"), n))
