"""One read of each index and dense file for a load on many ranks: rank 0 opens the sources of a
load's entries, then broadcasts the index bytes it read and the checkpoint each entry resolved to;
every other rank takes those bytes instead of reading (and parsing a list to find) them itself,
where its own storage holds the same file. The dense files every rank loads whole (model.pt,
extra.pt) go the same way when the load stages them (docs/ARCHITECTURE.md, "A load").

At a thousand ranks on an object store every rank used to GET the whole index (49 MB in the scale
model, benchmarks/README.md): 49 GB of requests for one restore, though a rank needs its share of
it. A broadcast sends the bytes down a tree instead. It also makes the ranks agree on the checkpoint
an output dir's "latest" names: a commit between two ranks' reads of the list can no longer hand
them different checkpoints.

Whether a rank reads the same index as rank 0 is decided per file from `Storage.ukey` (size, mtime
and inode on a local disk, the ETag on an object store), never from the path string alone: per-rank
local output dirs can give every rank the same path for different files. A dense file is taken when
its size and CRC32C are those this rank's own index records. A rank whose file differs, or that was
given other entries, reads for itself, as every rank did before.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Set, Tuple

from recsave.errors import RecsaveError
from recsave.format import index as index_mod
from recsave.load.sources import CheckpointSource, open_source
from recsave.storage import Storage, dist, get_storage

Opening = Tuple[str, Optional[str], bool]  # open_source's (path, ckpt_id, direct_path)


@dataclass(frozen=True)
class SharedIndex:
    """Index bytes rank 0 read, and the token its file had before and after the read."""
    ukey: str
    data: bytes


@dataclass(frozen=True)
class SharedReads:
    """What rank 0 broadcasts: per entry it opened, the entry and the checkpoint directory it
    resolved to (None for a source without an index, e.g. Parquet), and every index it read."""
    entries: List[Tuple[Opening, Optional[str]]]
    indexes: Dict[str, SharedIndex]


@dataclass
class IndexRecorder:
    """Rank 0's index reader: reads as Storage.read_bytes does and keeps what it read, when the
    file's token was the same before and after the read (a file replaced meanwhile is not kept)."""
    indexes: Dict[str, SharedIndex] = field(default_factory=dict)

    def read(self, storage: Storage, path: str, limit: int) -> bytes:
        try:
            before: Optional[str] = storage.ukey(path)
        except RecsaveError:  # missing or unreadable: the read below raises what a load reports
            before = None
        data = storage.read_bytes(path, limit)
        if before is not None and storage.ukey(path) == before:
            self.indexes[path] = SharedIndex(before, data)
        return data


class SharedIndexReader:
    """Another rank's index reader: rank 0's bytes for a file whose token is the same here,
    else a read of its own. `taken` counts the reads it saved."""

    def __init__(self, shared: SharedReads):
        self.shared = shared
        self.taken = 0
        self._checked: Set[str] = set()  # files found the same by opening(): one stat each, not two

    def read(self, storage: Storage, path: str, limit: int) -> bytes:
        known = self.shared.indexes.get(path)
        if known is not None and len(known.data) <= limit and (
                path in self._checked or self._same_file(storage, path, known)):
            self.taken += 1
            return known.data
        return storage.read_bytes(path, limit)

    def opening(self, entry: Opening) -> Opening:
        """How to open `entry`: as the directory rank 0 resolved it to, where this rank was given
        the same entry and sees the same index there; else as given."""
        for given, ckpt_dir in self.shared.entries:
            if given != entry or ckpt_dir is None:
                continue
            storage = get_storage(ckpt_dir)
            path = storage.join(ckpt_dir, index_mod.INDEX_FILE)
            known = self.shared.indexes.get(path)
            if known is not None and self._same_file(storage, path, known):
                self._checked.add(path)
                return ckpt_dir, None, True
        return entry

    @staticmethod
    def _same_file(storage: Storage, path: str, known: SharedIndex) -> bool:
        try:
            return storage.ukey(path) == known.ukey
        except RecsaveError:
            return False


def _run_then_send(work: Callable[[], None], message: Callable[[], Any], world: int) -> None:
    """Rank 0's side of a shared read: runs `work`, then broadcasts `message()` (what the work got
    done, a part of it if it failed) and re-raises the work's error. The broadcast goes out either
    way, since the other ranks wait for it."""
    failure: Optional[BaseException] = None
    try:
        work()
    except BaseException as exc:
        failure = exc
    dist.broadcast_from_rank0(message(), world)
    if failure is not None:
        raise failure


def fail_before_sharing(error: BaseException, world: int) -> NoReturn:
    """For a rank whose planning failed before open_sources (a malformed entry only it was given,
    its model refused): takes part in that broadcast all the same (rank 0 sends that it shares
    nothing, another rank receives and drops what rank 0 shares), then raises `error`. Every rank
    thus makes the same collective calls and meets the others at the planning's outcome exchange,
    where they learn of `error` at once instead of at the collective timeout."""
    if dist.collective(world):
        try:
            dist.broadcast_from_rank0(SharedReads([], {}) if dist.group_rank() == 0 else None, world)
        except Exception:  # a broken group: `error` is still the one to report
            pass
    raise error


def open_sources(entries: Sequence[Opening], world: int) -> List[Any]:
    """open_source for every entry, in order; with several ranks in a process group, each index
    read once on rank 0 and broadcast (one collective per call on every rank, also when rank 0
    fails: it sends what it read before the failure, then raises)."""
    if not dist.collective(world):
        return [open_source(*e) for e in entries]
    if dist.group_rank() != 0:
        reader = SharedIndexReader(dist.broadcast_from_rank0(None, world))
        with index_mod.reading_through(reader.read):
            return [open_source(*reader.opening(e)) for e in entries]
    recorder = IndexRecorder()
    sources: List[Any] = []

    def open_all() -> None:
        with index_mod.reading_through(recorder.read):
            for e in entries:
                sources.append(open_source(*e))

    _run_then_send(open_all, lambda: SharedReads(
        [(e, s.ckpt_dir if isinstance(s, CheckpointSource) else None) for e, s in zip(entries, sources)],
        recorder.indexes), world)
    return sources


def read_pt_files(sources: Sequence[Any], wanted: Sequence[Sequence[str]], world: int) -> List[Dict[str, Any]]:
    """Per source, its .pt files named in `wanted` (fname -> read_pt's object). With several ranks
    in a process group rank 0 reads the files of recsave checkpoints and broadcasts their bytes (one
    collective per call on every rank, also when rank 0 fails); another rank decodes the bytes
    that match its own index's record of the file, and reads the rest itself."""
    if not dist.collective(world):
        return [{f: src.read_pt(f) for f in names} for src, names in zip(sources, wanted)]
    blobs: Dict[Tuple[int, str], bytes] = {}
    own = dist.group_rank() == 0  # rank 0's bytes were checked by its own read: no second CRC

    def read_all() -> None:
        for k, (src, names) in enumerate(zip(sources, wanted)):
            if isinstance(src, CheckpointSource):
                for f in names:
                    blobs[k, f] = src.read_pt_bytes(f)

    if own:
        _run_then_send(read_all, lambda: blobs, world)
    else:
        blobs = dist.broadcast_from_rank0(None, world)
    out: List[Dict[str, Any]] = []
    for k, (src, names) in enumerate(zip(sources, wanted)):
        files = {}
        for f in names:
            data = blobs.get((k, f))
            if data is not None and isinstance(src, CheckpointSource) and (own or src.pt_matches(f, data)):
                files[f] = src.decode_pt(f, data)
            else:
                files[f] = src.read_pt(f)
        out.append(files)
    return out
