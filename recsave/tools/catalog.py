"""Looking at checkpoints without loading them: list, describe, verify every checksum, collect
garbage, repair a lost `checkpoint` file. Used by the `recsave` command line (ls, inspect, verify,
gc, repair)."""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from recsave import _C, argcheck, knobs
from recsave.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FormatVersionError,
    OverLimitError,
    RecsaveError,
    UsageError,
)
from recsave.format import chain, ckptlist, retention, torchio
from recsave.format import index as index_mod
from recsave.format.reader import check_shard_header
from recsave.format.readonce import ReadOnce
from recsave.format.records import KIND_FULL
from recsave.load.sources import ChainSource, CheckpointSource, open_source, require_checkpoint
from recsave.storage import Storage, get_storage
from recsave.storage.lock import WriterLock, check_held
from recsave.storage.lock import hold as hold_writer_lock
from recsave.tables.rows import META_COLUMNS, TOMBSTONE_COLUMN


@dataclass(frozen=True)
class OutputDirListing:
    """What `recsave ls` shows of an output dir: its committed checkpoints (list_checkpoints'
    dicts) and the directories that a rebuilt `checkpoint` list left out, because their index does
    not validate (dicts with id, path, problem, and damaged: False where the index may be intact,
    over the knob max_index_bytes here)."""
    checkpoints: List[Dict[str, Any]]
    left_out: List[Dict[str, Any]]

    @property
    def damaged(self) -> bool:
        """Whether damage was found: a listed checkpoint or a left-out directory that is damaged."""
        return any(e["damaged"] for e in (*self.checkpoints, *self.left_out))


def list_checkpoints(output_dir: str) -> List[Dict[str, Any]]:
    """Committed checkpoints, oldest first: id, path, step, bytes, created_at, age in seconds,
    metrics (None when the save recorded none), kept (why retention keeps it: "latest",
    "every_n_steps", "best", "needed by <id>"; format/retention.py), and problem: None, or why a
    listed id's index cannot be read (gone or damaged: `damaged` True, `recsave repair` drops or
    names it; written by a newer recsave: `damaged` False), its other fields then None; or why a
    listed delta cannot be restored: its chain needs a member that is gone or damaged (`damaged`
    True, its other fields from its index; `recsave repair` drops and names it). Raises
    CheckpointNotFoundError when `output_dir` does not exist ([] when it holds none)."""
    return list_output_dir(output_dir, "list_checkpoints").checkpoints


def list_output_dir(output_dir: str, tool: str = "list_output_dir") -> OutputDirListing:
    """list_checkpoints, and the directories a rebuilt `checkpoint` list left out (`recsave ls`).
    `tool`: the function named in an argument error."""
    argcheck.path(output_dir, "output_dir", tool)
    storage = get_storage(output_dir)
    _require_dir(storage, output_dir)
    if storage.exists(storage.join(output_dir, index_mod.INDEX_FILE)) \
            and not storage.exists(storage.join(output_dir, ckptlist.LIST_FILE)):
        raise UsageError(f"{output_dir} is a checkpoint directory, not an output dir: list its output dir "
                         f"{storage.split(output_dir.rstrip('/'))[0]}, or describe it with `recsave inspect`",
                         path=output_dir)
    now = datetime.datetime.now(datetime.timezone.utc)
    out = []
    listing = ckptlist.committed(storage, output_dir)  # rebuilt (warning) if the list is lost
    ids = listing.ids
    gone = set()  # listed ids whose directory or index is gone
    parents: Dict[str, List[str]] = {}  # what each checkpoint needs, from the index read below
    parents_of = _parents(storage, output_dir, parents)  # others: their index read as JSON
    states: Dict[str, chain.MemberState] = {}  # what the chains need of the indexes read below
    for ckpt_id in ids:
        path = storage.join(output_dir, ckpt_id)
        entry: Dict[str, Any] = {"id": ckpt_id, "path": path, "step": None, "created_at": None, "age_s": None,
                                 "bytes": None, "metrics": None, "kept": [], "problem": None, "damaged": False}
        out.append(entry)
        try:  # one listed id gone or unreadable here is reported on its line, not for the whole listing
            index, states[ckpt_id] = chain.read_state(storage, path)
        except (CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError) as exc:
            # Not read whole here (a newer recsave's, one over max_index_bytes) is unknown, not
            # damage: repair leaves such a checkpoint listed.
            entry.update(problem=" ".join(str(exc).split()),
                         damaged=not isinstance(exc, (FormatVersionError, OverLimitError)))
            if isinstance(exc, CheckpointNotFoundError):
                gone.add(ckpt_id)
            continue
        parents[ckpt_id] = chain.needs_of(index)
        created = ckptlist.commit_time(index.created_at)  # any ISO-8601 UTC form (-inf: not one)
        age = now.timestamp() - created if created != float("-inf") else None
        entry.update(step=index.step, created_at=index.created_at, age_s=age, bytes=_own_bytes(storage, path, index),
                     metrics=None if index.metrics is None else dict(index.metrics))
    # A listed delta whose chain lost a member cannot be restored: damage, as a damaged index is
    # (repair unlists it). The listed ids whose index was just read whole are no lost member.
    readable = [e["id"] for e in out if e["problem"] is None]
    broken = _broken_chains(storage, output_dir, readable, states)
    # What gc keeps, as gc decides it: without the listed ids whose directory or index is gone
    # (gc drops them from the list first).
    present = [i for i in ids if i not in gone]
    try:
        reasons = retention.recorded(storage, output_dir, present, parents_of)
    except OverLimitError:  # an index over max_index_bytes here: gc refuses to select, and keeps all
        reasons = {i: [retention.LATEST] for i in present}
    for entry in out:
        entry["kept"] = reasons.get(entry["id"], [])
        if entry["id"] in broken:
            entry.update(problem=broken[entry["id"]], damaged=True)
    return OutputDirListing(out, _left_out(storage, output_dir, listing))


def _left_out(storage: Storage, output_dir: str, listing: ckptlist.Listing) -> List[Dict[str, Any]]:
    """What a rebuilt list left out, as ls reports it (repair exits 1 for the same): directories
    whose index does not validate, damaged where the index's bytes prove it (one over the knob
    max_index_bytes here may be intact: named, not called damage, as a listed one is), and ids
    the lost file listed whose directory or index is gone. A list used as it is leaves nothing
    out: its ids are all entries, gone or damaged ones included."""
    dirs = [{"id": name, "path": storage.join(output_dir, name), "problem": " ".join(why.split()),
             "damaged": name in listing.broken or ckptlist.proven_damaged(storage, output_dir, name) is not None}
            for name, why in sorted(listing.left_out.items())]
    gone = [{"id": i, "path": storage.join(output_dir, i), "damaged": True,
             "problem": f"listed in the {ckptlist.LIST_FILE!r} file, but its directory or index is gone"}
            for i in (listing.stale if listing.rebuilt else [])]
    return dirs + gone


def describe(ckpt: str, tool: str = "describe") -> Dict[str, Any]:
    """What a checkpoint holds, from its index, and `missing`: the files its index (or a chain
    member's) lists that are not there (one listing per directory). `tool`: the command named when
    `ckpt` is no checkpoint (a CLI command describing its source first)."""
    argcheck.path(ckpt, "ckpt", tool)
    src = open_source(ckpt)
    require_checkpoint(src, ckpt, tool)
    assert isinstance(src, CheckpointSource)
    index = src.index
    shards = {n: f for n, f in index.files.items() if n.endswith(".safetensors")}
    tables = {}
    for name, t in (index.meta.tables if index.meta is not None else {}).items():
        quantised = ("scale", "offset") if t.quant is not None else ()  # int8 serving tables
        stored = [c for c in ("id", "embedding", *t.slots, *quantised, *META_COLUMNS, TOMBSTONE_COLUMN)
                  if f"{name}@{c}" in index.tensors]
        nbytes = sum(index.tensor(f"{name}@{c}").nbytes for c in stored)
        tables[name] = {"rows": t.rows, "dim": t.dim, "dtype": t.dtype, "slots": list(t.slots), "bytes": nbytes,
                        "tombstones": t.tombstones or 0}
        if index.is_delta:  # rows of a delta: live rows once applied; changed: rows it stores
            tables[name].update(changed=index.tensor(f"{name}@id").shape[0], cleared=bool(t.cleared))
    chain_ids = src.chain_ids if isinstance(src, ChainSource) else [src.storage.split(src.ckpt_dir)[1]]
    return {
        "path": src.ckpt_dir, "step": index.step, "created_at": index.created_at,
        "kind": index.kind, "parent": index.parent.to_json() if index.parent is not None else None,
        "base": index.base if index.is_delta else chain_ids[0] if index.kind == KIND_FULL else None,
        "chain": chain_ids,
        "format_version": index.format_version, "sealed": index.sealed, "recsave_version": index.recsave_version,
        "world_size": index.world_size,
        "partition": index.partition.to_json() if index.partition is not None else None, "tables": tables,
        "shards": {"files": len(shards), "bytes": sum(f.size for f in shards.values())},
        "dense": sorted(index.meta.dense) if index.meta is not None else [],
        "extras": list(index.meta.extras) if index.meta is not None else [],
        "io_states": list(index.meta.io_states) if index.meta is not None else [],
        "bytes": _own_bytes(src.storage, src.ckpt_dir, index),
        "missing": _missing_files(src),
    }


def _missing_files(src: CheckpointSource) -> List[str]:
    """Paths of the files that the index of `src` or of a member of its chain lists and that are
    not there, base first: such a checkpoint is damaged (incomplete). Names only, from one listing
    per directory: sizes and checksums are verify's."""
    members = [src.member_source(m) for m in src.members] if isinstance(src, ChainSource) else [src]
    missing: List[str] = []
    for member in members:
        present = set(member.storage.listdir(member.ckpt_dir))
        missing += [member.storage.join(member.ckpt_dir, f) for f in sorted(member.index.files) if f not in present]
    return missing


def _own_bytes(storage: Storage, ckpt_dir: str, index: index_mod.Index) -> int:
    """Bytes of a checkpoint's own files: those its index lists, and the index itself (tens of MB
    with many ranks, so `du` and this agree)."""
    return index.total_bytes + storage.size(storage.join(ckpt_dir, index_mod.INDEX_FILE))


def verify(ckpt: str, progress: Optional[Callable[[int], None]] = None,
           on_start: Optional[Callable[[int], None]] = None) -> List[str]:
    """Checks every file and every checksum of a checkpoint, reading in bounded chunks. Returns the
    problems found (empty: the checkpoint is intact). `on_start(total_bytes)` and `progress(bytes)`
    report progress. A path that holds no checkpoint at all (missing, or no index, `checkpoint` file
    or checkpoint file in it) raises CheckpointNotFoundError, a Parquet export UsageError, one (or
    a chain member) written by a newer recsave FormatVersionError, one whose index is over the knob
    max_index_bytes here OverLimitError: none of them is damage (a script
    deleting what verify finds damaged must not delete an intact checkpoint it cannot read). An
    unreadable index, or a checkpoint directory without one, is a problem found."""
    argcheck.path(ckpt, "ckpt", "verify")
    argcheck.callback(progress, "progress", "verify")
    argcheck.callback(on_start, "on_start", "verify")
    storage = get_storage(ckpt)
    try:
        src = open_source(ckpt)
    except (CheckpointNotFoundError, ConfigError) as exc:  # nothing of recsave there: a usage error
        if not _recsave_files_at(storage, ckpt):
            raise
        return [str(exc)]
    except (FormatVersionError, OverLimitError):  # a newer writer's, or an index over the knob
        raise  # max_index_bytes here: maybe intact (a version no recsave writes is damage)
    except RecsaveError as exc:
        return [str(exc)]
    require_checkpoint(src, ckpt, "verify")
    assert isinstance(src, CheckpointSource)
    problems: List[str] = []
    # A delta is intact when its whole chain is: every member's files are checked (base first).
    members = [src.member_source(m) for m in src.members] if isinstance(src, ChainSource) else [src]
    if on_start is not None:
        on_start(sum(m.index.total_bytes for m in members))
    for member in members:
        for fname, entry in sorted(member.index.files.items()):
            try:
                if fname.endswith(".safetensors"):
                    _verify_shard(member, fname)
                else:
                    torchio.read_bytes(member.storage, member.ckpt_dir, fname, member.index)
            except RecsaveError as exc:
                problems.append(str(exc))
            if progress is not None:
                progress(entry.size)
    return problems


def _verify_shard(src: CheckpointSource, fname: str) -> None:
    path = check_shard_header(src.ckpt_dir, fname, src.index, src.storage)  # as a load checks it
    limit = knobs.get("io_chunk_bytes")
    for name, entry in src.index.tensors.items():
        for chunk in entry.chunks:
            if chunk.file != fname:
                continue
            for b, e, crc in chunk.checked_segments():
                value, pos = 0, b
                while pos < e:  # a segment is read in pieces of at most io_chunk_bytes
                    n = min(limit, e - pos)
                    value = _C.crc32c(np.frombuffer(src.storage.read_range(path, chunk.offset + pos, n),
                                                    dtype=np.uint8), value)
                    pos += n
                if value != crc:
                    raise CorruptCheckpointError(f"{path}: tensor {name!r}: CRC32C mismatch in bytes "
                                                 f"[{chunk.offset + b}, {chunk.offset + e})",
                                                 path=path, key=name)


def collect_garbage(output_dir: str, *, remove_broken: bool = False) -> List[str]:
    """Removes uncommitted leftovers (and pruned checkpoints) of an output dir; returns their names.
    Also removes stray temporary files (see clean_output_dir, which returns both lists, and what
    `remove_broken` does).

    Takes the output dir's writer lock first (knob ``writer_lock``): a save in progress looks like
    a leftover, so while a Saver holds the lock this raises WriterLockedError and removes nothing."""
    return clean_output_dir(output_dir, remove_broken=remove_broken)["removed_checkpoints"]


def clean_output_dir(output_dir: str, *, remove_broken: bool = False) -> Dict[str, Any]:
    """What ``recsave gc`` does, under the writer lock: removes uncommitted leftovers and pruned
    checkpoint directories (``removed_checkpoints``: their names), then the temporary files that
    interrupted writes leave in output_dir and its checkpoint directories (``removed_temp_files``:
    paths relative to output_dir), then, on S3, the multipart uploads a killed writer left
    unfinished under output_dir, begun before this call took the lock (``aborted_uploads``: keys
    relative to output_dir; a later writer's uploads are never touched). An unlisted delta whose
    own index validates but whose chain is broken (a member gone, damaged or saved again: what
    `repair` leaves out) is kept and named (``kept_broken``: id -> why) unless `remove_broken`
    (``recsave gc --remove-broken``), which removes it. Raises
    CheckpointNotFoundError when output_dir does not exist or is no output dir (neither a
    `checkpoint` file nor a committed checkpoint: removing nothing), WriterLockedError (removing
    nothing) while a Saver holds it."""
    argcheck.path(output_dir, "output_dir", "clean_output_dir")
    argcheck.check(remove_broken, bool, "remove_broken", "clean_output_dir")
    storage = get_storage(output_dir)
    _require_dir(storage, output_dir)  # before the lock, which would create the directory
    lock = hold_writer_lock(None, storage, output_dir)
    try:
        return _clean_locked(storage, output_dir, lock, remove_broken)
    finally:
        if lock is not None:
            lock.release()


def _clean_locked(storage: Storage, output_dir: str, lock: Optional[WriterLock],
                  remove_broken: bool) -> Dict[str, Any]:
    """clean_output_dir's work under the writer lock `lock` (None: the knob writer_lock off)."""
    # A lost or garbled `checkpoint` file is rebuilt from the indexes first (with a warning):
    # every committed checkpoint is kept (collect_garbage keeps damaged directories itself).
    listing = ckptlist.committed(storage, output_dir, rewrite=True)
    _require_output_dir(listing, output_dir, "it is not a recsave output dir; nothing removed")
    # Then the retention policy recorded in the latest index selects, as the Saver's rotation
    # does (a save interrupted before it pruned leaves more listed than the policy keeps); a
    # rebuilt list keeps every committed checkpoint.
    kept = listing.ids if listing.rebuilt else retention.recorded(storage, output_dir, listing.ids,
                                                                  _parents(storage, output_dir))
    keep = [i for i in listing.ids
            if i in kept or ckptlist.newer_format_version(storage, output_dir, i) is not None]
    if keep != listing.ids:
        ckptlist.write(storage, output_dir, keep)

    def remove(path: str) -> None:  # a directory another writer may be saving into is not ours
        check_held(lock)
        storage.remove_tree(path)
    broken: Dict[str, str] = {}
    dirs = ckptlist.collect_garbage(storage, output_dir, keep, remove=remove,
                                    pruned=[i for i in listing.ids if i not in keep],
                                    remove_broken=remove_broken, kept_broken=broken)
    check_held(lock)
    temps = ckptlist.remove_temp_files(storage, output_dir)
    # By the store's clock: uploads begun before the lock file was written are dead writers'.
    # Only recsave's own names: another program may be uploading into the output dir, or a job
    # saving into an output dir below it (gc of a bucket root).
    uploads = storage.abort_stale_uploads(output_dir, lock.path,
                                         ckptlist.writes_there(storage, output_dir, dirs)) if lock is not None else []
    return {"removed_checkpoints": dirs, "removed_temp_files": temps, "aborted_uploads": uploads,
            "kept_broken": broken}


def _require_output_dir(listing: ckptlist.Listing, output_dir: str, consequence: str) -> None:
    """CheckpointNotFoundError unless `listing` found a `checkpoint` file or a committed checkpoint
    (else output_dir is no output dir: its folders are someone else's)."""
    if not listing.found:
        raise CheckpointNotFoundError(f"{output_dir}: no 'checkpoint' file and no committed checkpoint (no "
                                      f"directory with a valid index); {consequence}", path=output_dir)


def _parents(storage: Storage, output_dir: str,
             known: Optional[Dict[str, List[str]]] = None) -> Callable[[str], List[str]]:
    """retention's depends_on: a delta checkpoint needs its parent (format/chain.py), each
    checkpoint's index read once; `known` (id -> parent_ids, filled from indexes the caller read)
    is taken as it is and completed."""
    parents = {} if known is None else known

    def parents_of(ckpt_id: str) -> List[str]:
        if ckpt_id not in parents:
            parents[ckpt_id] = chain.parent_ids(storage, output_dir, ckpt_id)
        return parents[ckpt_id]
    return parents_of


def _require_dir(storage: Storage, path: str) -> None:
    """An output dir must be a directory: a file there is a wrong argument, not an empty run."""
    if not storage.exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist; check the path", path=path)
    if not storage.isdir(path, follow_links=True):
        raise CheckpointNotFoundError(f"{path} is not a directory; give a Saver's output_dir", path=path)


def _recsave_files_at(storage: Storage, path: str) -> bool:
    """Whether `path` holds anything of recsave: an index, a `checkpoint` list, or checkpoint files
    (a checkpoint directory that lost its index)."""
    if storage.exists(storage.join(path, index_mod.INDEX_FILE)) or \
            storage.exists(storage.join(path, ckptlist.LIST_FILE)):
        return True
    parent, name = storage.split(path)
    return bool(name) and ckptlist.looks_like_checkpoint(storage, parent, name)


def _broken_chains(storage: Storage, output_dir: str, ids: List[str],
                   known: Optional[Dict[str, chain.MemberState]] = None) -> Dict[str, str]:
    """The delta checkpoints among `ids` whose chain is proven broken -> why (chain.broken_chains,
    the rule a rebuilt list and gc follow too). `known` (id -> MemberState of indexes the caller
    just read whole) spares reading those again; repair reads each index once in all
    (format/readonce.py)."""
    return chain.broken_chains(ids, ckptlist.member_lookup(storage, output_dir, dict(known or {})))


def repair(output_dir: str) -> Dict[str, Any]:
    """Rebuilds a lost, empty or garbled `checkpoint` file of output_dir from the committed
    checkpoints' indexes (docs/FORMAT.md section 1) and drops listed ids whose directory or index
    is gone, whose index is damaged, or whose chain of deltas lost a member (gone or damaged: the
    delta cannot be loaded); deletes nothing. Takes the writer lock like collect_garbage.

    Returns {"output_dir", "file", "problem" (None: the file was fine and is left as it is), "ids"
    (committed, oldest first), "stale" (listed ids dropped), "left_out" (directories holding an
    index that is not valid, or a delta whose chain is broken -> why), "rebuilt" (from the
    indexes), "rewritten"}.
    CheckpointNotFoundError when output_dir holds neither a `checkpoint` file nor a committed
    checkpoint."""
    argcheck.path(output_dir, "output_dir", "repair")
    storage = get_storage(output_dir)
    _require_dir(storage, output_dir)
    lock = hold_writer_lock(None, storage, output_dir)
    try:
        # Each index is read once: whether it validates (the list, damage), what it needs and its
        # CRC32C (_broken_chains) all come from those bytes; none changes under the lock.
        with index_mod.reading_through(ReadOnce().read):
            listing, ids, left_out, rewritten, problem = _repair_locked(storage, output_dir)
    finally:
        if lock is not None:
            lock.release()
    _require_output_dir(listing, output_dir, "nothing to repair")
    return {"output_dir": output_dir, "file": storage.join(output_dir, ckptlist.LIST_FILE),
            "problem": problem, "ids": ids, "stale": list(listing.stale),
            "left_out": left_out, "rebuilt": listing.rebuilt, "rewritten": rewritten}


def _repair_locked(storage: Storage, output_dir: str
                   ) -> Tuple[ckptlist.Listing, List[str], Dict[str, str], bool, Optional[str]]:
    """repair's work under the writer lock: (listing, ids, left_out, rewritten, problem)."""
    listing = ckptlist.committed(storage, output_dir, rewrite=True, warn=False)
    # A list that reads fine may still name a checkpoint whose index no longer validates (ls
    # says so): it leaves the list, its directory stays (rotation and gc never delete it).
    ids, left_out, rewritten = list(listing.ids), dict(listing.left_out), listing.rewritten
    problem = listing.problem
    damaged = {i: why for i in ids if (why := ckptlist.proven_damaged(storage, output_dir, i)) is not None}
    # A delta whose chain lost a member cannot be loaded either: it leaves the list too.
    broken = _broken_chains(storage, output_dir, [i for i in ids if i not in damaged])
    if damaged or broken:
        ids = [i for i in ids if i not in damaged and i not in broken]
        ckptlist.write(storage, output_dir, ids)
        left_out.update(damaged)
        left_out.update(broken)
        rewritten = True
        found = ([f"it lists {', '.join(damaged)}, whose index is damaged"] if damaged else []) + \
            ([f"it lists {', '.join(broken)}, whose chain of deltas is broken"] if broken else [])
        problem = problem or "; ".join(found)
    return listing, ids, left_out, rewritten, problem
