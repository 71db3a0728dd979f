"""Writes named tensors into shard files through the C++ engine and describes them in an index part."""
from __future__ import annotations

import contextlib
import dataclasses
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union, cast

import numpy as np
import torch

from recsave import _C, knobs, threads
from recsave.errors import UsageError
from recsave.format import header
from recsave.format import segments as bucket_rule
from recsave.format.commits import DeferredCommits
from recsave.format.dtypes import DType, from_torch
from recsave.format.records import FORMAT_VERSION, BucketRange, Chunk, FileEntry, IndexPart, TensorEntry
from recsave.format.segments import BucketSegments
from recsave.storage import Storage, get_storage


@dataclass
class RowSource:
    """A tensor whose rows are taken from another one on demand, e.g. a table's rows in bucket order,
    so a save never holds a second copy of the whole tensor.

    ``RowSource.take(storage, rows)`` (CPU) is ``storage[rows]``: the engine gathers the rows itself
    on its writer threads, each through a buffer of up to 1 MiB it checksums and writes. Any
    other source gives ``fetch(a, b)``, rows [a, b) as a CPU tensor; the writer then holds at most
    two blocks of ``write_block_bytes`` (one written, one being fetched)."""

    dtype: torch.dtype
    shape: Tuple[int, ...]
    fetch: Callable[[int, int], torch.Tensor]
    storage: Optional[torch.Tensor] = None  # set by take(): the matrix `rows` index
    rows: Optional[torch.Tensor] = None

    @classmethod
    def take(cls, storage: torch.Tensor, rows: torch.Tensor) -> "RowSource":
        """``storage[rows]`` for a contiguous CPU matrix and int64 row indexes, without the copy."""
        if storage.device.type != "cpu" or storage.dim() < 1 or not storage.is_contiguous():
            raise UsageError("RowSource.take needs a contiguous CPU tensor with at least one dimension")
        rows = rows.to(torch.int64).contiguous()
        if rows.dim() != 1 or rows.device.type != "cpu":
            raise UsageError("RowSource.take needs a 1-D CPU tensor of row indexes")
        return cls(storage.dtype, (rows.numel(),) + tuple(storage.shape[1:]),
                   lambda a, b: storage.index_select(0, rows[a:b]), storage, rows)

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.row_bytes * (self.shape[0] if self.shape else 1)

    def dim(self) -> int:
        return len(self.shape)


Source = Union[torch.Tensor, RowSource]


def shard_file_name(prefix: str, rank: int, part: int) -> str:
    return f"{prefix}-{rank}-{part}.safetensors"


@dataclass
class _PartBuilder:
    """The files and tensors of an index part while write_shards fills them in."""
    rank: int
    files: Dict[str, FileEntry] = field(default_factory=dict)
    tensors: Dict[str, TensorEntry] = field(default_factory=dict)

    def build(self) -> IndexPart:
        return IndexPart(self.rank, self.files, self.tensors)


def _prepare(name: Any, tensor: Any) -> Tuple[str, Source, DType]:
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise UsageError(f"tensor name {name!r} is not usable: names are non-empty strings other "
                         f"than '__metadata__'", key=str(name))
    if isinstance(tensor, RowSource):
        if not tensor.shape:
            raise UsageError(f"{name!r}: a RowSource needs at least one dimension", key=name)
        return name, tensor, from_torch(tensor.dtype, key=name)
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor", key=name)
    dtype = from_torch(tensor.dtype, key=name)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return name, t.contiguous(), dtype


def _group(items: List[Tuple[str, Source, DType]], max_bytes: int) -> List[List[Tuple[str, Source, DType]]]:
    """Consecutive tensors into files of at most max_bytes (a larger tensor gets a file of its own)."""
    groups: List[List[Tuple[str, Source, DType]]] = [[]]
    size = 0
    for item in items:
        nbytes = item[1].nbytes
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups if groups[0] else []


def write_shards(directory: str, tensors: Mapping[str, torch.Tensor], *, rank: int = 0,
                 prefix: str = "sparse", concurrency: Optional[int] = None,
                 max_shard_bytes: Optional[int] = None, segment_bytes: Optional[int] = None,
                 durable: Optional[bool] = None,
                 chunk_meta: Optional[Mapping[str, Dict[str, Any]]] = None,
                 storage: Optional[Storage] = None, first_part: int = 0,
                 segments: Optional[Mapping[str, Union[Sequence[int], BucketSegments]]] = None,
                 commits: Optional[DeferredCommits] = None) -> IndexPart:
    """Writes `tensors` into `<directory>/<prefix>-<rank>-<part>.safetensors` files and returns the
    index part describing them (docs/FORMAT.md section 3). Each file appears atomically; if anything
    fails, every file this call created is removed before the error propagates.

    `chunk_meta` adds extra keys (e.g. ``buckets``) to a tensor's chunk entry; part numbers start at
    `first_part` (several calls of one rank write distinct files). `segments` gives, per tensor,
    explicit checksum segment ends (byte offsets) or a BucketSegments rule (the ends at the
    boundaries of the tensor's `buckets` in `chunk_meta`, format/segments.py) instead of uniform
    `segment_bytes` pieces. The files are written by `storage` (by default the one of `directory`):
    on local disk through the engine's positional writes, elsewhere streamed
    (``Storage.write_shard``).

    With `commits`, durable local files are queued there instead of committed (fsync, rename): they
    are in place and durable only after ``commits.wait()`` (format/commits.py).
    """
    concurrency = concurrency or knobs.get("concurrency")
    max_shard_bytes = max_shard_bytes or knobs.get("max_shard_bytes")
    segment_bytes = segment_bytes or knobs.get("segment_bytes")
    durable = knobs.get("fsync") if durable is None else durable
    if segment_bytes < 1:
        raise UsageError(f"segment_bytes must be >= 1, got {segment_bytes}")
    items = [_prepare(n, t) for n, t in tensors.items()]
    fields_of = {name: _chunk_fields(name, extra) for name, extra in (chunk_meta or {}).items()}
    layout = {n: _segment_layout(n, t, segment_bytes, (segments or {}).get(n), fields_of.get(n, {}).get("buckets"))
              for n, t, _ in items}
    storage = storage or get_storage(directory)
    part = _PartBuilder(rank)
    written: List[str] = []
    try:
        for part_no, group in enumerate(_group(items, max_shard_bytes), start=first_part):
            fname = shard_file_name(prefix, rank, part_no)
            path = storage.join(directory, fname)
            shard = _ShardFile(group, layout, concurrency)
            storage.write_shard(path, shard, durable=durable, commits=commits)
            written.append(path)
            for i, item in enumerate(group):
                _describe(part, item, fname, shard.starts[i], shard.crc_of[i], layout[item[0]][1])
            part.files[fname] = FileEntry(shard.size, rank)
    except BaseException:
        for path in written:  # best effort: the error being raised is the one to report
            with contextlib.suppress(OSError):
                storage.remove_file(path)
        raise
    for name, fields in fields_of.items():
        entry = part.tensors[name]
        part.tensors[name] = dataclasses.replace(
            entry, chunks=tuple(dataclasses.replace(c, **fields) for c in entry.chunks))
    return part.build()


def _chunk_fields(name: str, extra: Mapping[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(extra) - {"buckets"})
    if unknown:
        raise UsageError(f"chunk_meta of {name!r} has unknown key(s) {unknown}; chunks take only "
                         f"'buckets'", key=name)
    buckets = extra.get("buckets")
    if buckets is not None and not isinstance(buckets, BucketRange):
        buckets = BucketRange(int(buckets["first"]), tuple(buckets["row_starts"]))
    return {"buckets": buckets}


Layout = Tuple[List[Tuple[int, int]], Dict[str, Any]]  # segment (begin, end) pairs, chunk fields


def _segment_layout(name: str, t: Source, segment_bytes: int, spec: Union[None, Sequence[int], BucketSegments],
                    buckets: Optional[BucketRange]) -> Layout:
    """Checksum segments of a tensor's bytes and how the chunk entry describes them."""
    nbytes = t.nbytes
    if spec is None:
        bounds = [(b, min(b + segment_bytes, nbytes)) for b in range(0, nbytes, segment_bytes)] or [(0, 0)]
        return bounds, {"segment_bytes": segment_bytes}
    if isinstance(spec, BucketSegments):
        rows = t.shape[0] if len(t.shape) else 0
        if buckets is None or buckets.row_starts[-1] != rows:
            raise UsageError(f"{name!r}: bucket segments need the tensor's buckets in chunk_meta, ending at its "
                             f"{rows} rows", key=name)
        cuts = bucket_rule.ends(buckets.row_starts, bucket_rule.row_bytes_of(buckets.row_starts, nbytes), spec)
        return list(zip((0,) + cuts[:-1], cuts)) if nbytes else [(0, 0)], {"bucket_segments": spec}
    ends = [int(e) for e in spec]
    increasing = all(b < e for b, e in zip([0] + ends, ends))
    if not ends or ends[-1] != nbytes or (nbytes and not increasing):
        raise UsageError(f"segment ends {ends[:8]}... must increase strictly and end at {nbytes}")
    bounds = list(zip([0] + ends[:-1], ends)) if nbytes else [(0, 0)]
    return bounds, {"segments": ends if nbytes else [0]}


class _ShardFile:
    """The bytes of one shard file (header, then each tensor's segments), written by the storage
    positionally through the engine or as a stream (recsave.storage.base.ShardContent); either
    way the CRC32C of every segment ends up in `crc_of` (per position in `group`)."""

    def __init__(self, group: Sequence[Tuple[str, Source, DType]], layout: Dict[str, Layout], concurrency: int):
        self.group, self.layout, self.concurrency = group, layout, concurrency
        self.head, self.starts = header.build([(n, d, tuple(t.shape)) for n, t, d in group], FORMAT_VERSION)
        self.size = len(self.head) + sum(t.nbytes for _, t, _ in group)
        self.crc_of: Dict[int, List[int]] = {}

    def write_positional(self, writer: Any) -> None:
        """Engine calls: the header, every plain tensor's segments in one parallel call, the
        RowSource.take sources gathered on the engine's threads in another, then the other
        RowSources block by block."""
        group, layout, starts, concurrency, crc_of = self.group, self.layout, self.starts, self.concurrency, self.crc_of
        crc_of.clear()
        offsets: List[int] = []
        addresses: List[int] = []
        lengths: List[int] = []
        plain: List[int] = []
        for i, (name, t, _d) in enumerate(group):
            if isinstance(t, RowSource):
                continue
            plain.append(i)
            base = t.data_ptr()
            for b, e in layout[name][0]:
                offsets.append(starts[i] + b)
                addresses.append(base + b)
                lengths.append(e - b)

        taken = [i for i, (_n, t, _d) in enumerate(group) if isinstance(t, RowSource) and t.storage is not None]
        writer.write_bytes(0, self.head)
        crcs = writer.write(np.asarray(offsets, dtype=np.uint64), np.asarray(addresses, dtype=np.uint64),
                            np.asarray(lengths, dtype=np.uint64), concurrency)
        _split_crcs(crc_of, crcs, plain, [len(layout[group[i][0]][0]) for i in plain])
        if taken:
            sources = [(group[i][0], cast(RowSource, group[i][1]), starts[i]) for i in taken]
            crcs = _write_taken(writer, sources, layout, concurrency)
            _split_crcs(crc_of, crcs, taken, [len(layout[group[i][0]][0]) for i in taken])
        for i, (name, t, _d) in enumerate(group):
            if isinstance(t, RowSource) and t.storage is None:
                crc_of[i] = []
                for block, bounds in _blocks(name, t, layout[name][0]):
                    base, first = block.data_ptr(), bounds[0][0]
                    got = writer.write(np.asarray([starts[i] + b for b, _ in bounds], dtype=np.uint64),
                                       np.asarray([base + b - first for b, _ in bounds], dtype=np.uint64),
                                       np.asarray([e - b for b, e in bounds], dtype=np.uint64), concurrency)
                    crc_of[i] += [int(c) for c in got]

    def write_stream(self, f: Any) -> None:
        """Sequentially: the file system buffers at most one upload part, and the tensors are
        handed over as views, never copied whole. A rerun (retried upload) gathers the rows again
        (nothing written is kept for a replay)."""
        self.crc_of.clear()
        f.write(self.head)
        for i, item in enumerate(self.group):
            crcs = self.crc_of[i] = []
            bounds = self.layout[item[0]][0]
            blocks = _blocks(item[0], item[1], bounds) if isinstance(item[1], RowSource) else [(item[1], bounds)]
            for block, segs in blocks:
                data, first = tensor_bytes(block), segs[0][0]
                for b, e in segs:
                    piece = data[b - first:e - first]
                    crcs.append(_C.crc32c(piece))
                    if len(piece):
                        f.write(memoryview(piece))  # type: ignore[arg-type]  # numpy arrays are buffers


def _split_crcs(crc_of: Dict[int, List[int]], crcs: np.ndarray, which: List[int], counts: List[int]) -> None:
    """Hands the CRCs of one engine call back to the tensors (positions `which`, counts[k] each)."""
    k = 0
    for i, n in zip(which, counts):
        crc_of[i] = crcs[k:k + n].tolist()  # Python ints; a save hands back thousands a table
        k += n


def _check_row_aligned(name: str, row_bytes: int, seg: np.ndarray) -> None:
    """`seg`: [n, 2] segment (begin, end) byte offsets; empty segments may lie anywhere."""
    taken = seg[seg[:, 1] > seg[:, 0]]
    if bool((taken % np.uint64(row_bytes)).any()):
        raise UsageError(f"{name!r}: checksum segments must end on row boundaries ({row_bytes} bytes) "
                         f"when its rows are taken from another tensor", key=name)


def _write_taken(writer: Any, sources: List[Tuple[str, RowSource, int]], layout: Dict[str, Layout],
                 concurrency: int) -> np.ndarray:
    """One engine call writing every segment of the RowSource.take sources, gathered on its threads."""
    cols: List[List[np.ndarray]] = [[] for _ in range(6)]  # offset, base, base rows, row bytes, rows at, rows
    for name, src, start in sources:
        storage, rows = src.storage, src.rows
        assert storage is not None and rows is not None  # only RowSource.take sources come here
        rb = src.row_bytes
        seg = np.asarray(layout[name][0], dtype=np.uint64).reshape(-1, 2)
        _check_row_aligned(name, rb, seg)
        first_row, count = seg[:, 0] // rb, (seg[:, 1] - seg[:, 0]) // rb
        same = np.ones(len(seg), dtype=np.uint64)
        values = (start + seg[:, 0], same * storage.data_ptr(), same * storage.shape[0], same * rb,
                  rows.data_ptr() + first_row * 8, count)
        for col, v in zip(cols, values):
            col.append(v)
    return writer.write_gathered(*(np.concatenate(c) for c in cols), concurrency)


def _blocks(name: str, src: RowSource, bounds: List[Tuple[int, int]]
            ) -> Iterator[Tuple[torch.Tensor, List[Tuple[int, int]]]]:
    """(rows as a tensor, the segments they hold) for consecutive blocks of about write_block_bytes,
    cut at segment ends; the next block is gathered while the caller writes the current one."""
    row_bytes = src.row_bytes
    _check_row_aligned(name, row_bytes, np.asarray(bounds, dtype=np.uint64).reshape(-1, 2))
    limit = max(knobs.get("write_block_bytes"), row_bytes)
    plan: List[List[Tuple[int, int]]] = [[]]
    for b, e in bounds:
        if plan[-1] and e - plan[-1][0][0] > limit:
            plan.append([])
        plan[-1].append((b, e))

    def fetch(segs: List[Tuple[int, int]]) -> torch.Tensor:
        a, z = segs[0][0] // row_bytes, segs[-1][1] // row_bytes
        block = src.fetch(a, z).detach()
        if block.device.type != "cpu":
            block = block.cpu()
        block = block.contiguous()
        if block.dtype != src.dtype or tuple(block.shape) != (z - a,) + tuple(src.shape[1:]):
            raise UsageError(f"{name!r}: fetch({a}, {z}) returned {block.dtype}{list(block.shape)}, expected "
                             f"{src.dtype}{[z - a] + list(src.shape[1:])}", key=name)
        return block

    fetch = knobs.carried(fetch)  # knob overrides are per thread: the gather thread sees this one's
    # A thread per block (threads.start), not an executor: an async save still writing when the
    # script ends must go on, and executors refuse work once the interpreter shuts down.
    pending = threads.start(fetch, plan[0], name="recsave-gather")
    try:
        for k, segs in enumerate(plan):
            block = pending.result()
            if k + 1 < len(plan):
                pending = threads.start(fetch, plan[k + 1], name="recsave-gather")
            yield block, segs
    finally:
        futures_wait([pending])  # an abandoned write: the gather under way ends before this returns


def _describe(part: _PartBuilder, item: Tuple[str, Source, DType], fname: str, start: int,
              crcs: List[int], fields: Dict[str, Any]) -> None:
    """Adds the tensor entry of one written chunk to the index part."""
    name, t, dtype = item
    chunk = Chunk(fname, start, t.nbytes, tuple(crcs), rows=(0, t.shape[0]) if t.dim() else None, **fields)
    part.tensors[name] = TensorEntry(dtype.name, tuple(t.shape), (chunk,))


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A zero-copy uint8 numpy view of a contiguous CPU tensor's bytes."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()
