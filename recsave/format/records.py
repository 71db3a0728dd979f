"""The checkpoint index as typed, immutable records (docs/FORMAT.md section 3).

`recsave.format.index.parse` validates an index once and builds these; every other module reads
attributes, never JSON keys. `to_json()` gives back the JSON object with the keys in the order
recsave writes them, so that parse -> dumps reproduces an index recsave wrote byte for byte.
Lists are tuples; mappings are plain dicts typed read-only (`Mapping`): records are pickled
between ranks, which a `MappingProxyType` would not allow.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import struct
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from recsave.errors import UsageError
from recsave.format import segments
from recsave.format.dtypes import BY_NAME, DType
from recsave.format.segments import BucketSegments

MAGIC = "recsave.index"
_LITTLE_ENDIAN = sys.byteorder == "little"

FORMAT_VERSION = 1           # a "full" checkpoint (docs/FORMAT.md section 3)
DELTA_FORMAT_VERSION = 2     # an index of another kind ("delta", "serving"): older readers refuse it
BUCKET_RANGES_VERSION = 3    # any kind: bucket ranges listed once in `bucket_ranges`, chunks refer to them; CRCs packed
BUCKET_SEGMENTS_VERSION = 4  # version 3, and chunks may name the rule of their segments (`bucket_segments`)
SHARED_RANGES_VERSIONS = (BUCKET_RANGES_VERSION, BUCKET_SEGMENTS_VERSION)  # with a top-level `bucket_ranges`
READABLE_FORMAT_VERSIONS = (FORMAT_VERSION, DELTA_FORMAT_VERSION, BUCKET_RANGES_VERSION, BUCKET_SEGMENTS_VERSION)
KIND_FULL = "full"
KIND_DELTA = "delta"         # changed rows + tombstones over a parent checkpoint (docs/FORMAT.md section 10)
KIND_SERVING = "serving"     # weights only, possibly quantised (docs/FORMAT.md section 8)
KINDS = (KIND_FULL, KIND_DELTA, KIND_SERVING)
QUANT_INT8 = "int8"          # TableMeta.quant: per-row affine int8 rows (recsave/format/quant.py)


def is_newer_index(index: Any) -> bool:
    """Whether a JSON-decoded index was written by a newer recsave: a format_version above 1 that
    this recsave does not read for its kind (version 2 is read only with a known kind other than
    "full", versions 3 and 4 with any known kind). Such a checkpoint is intact, only unreadable here."""
    if not isinstance(index, dict):
        return False
    version, kind = index.get("format_version"), index.get("kind", KIND_FULL)
    if type(version) is not int or version <= FORMAT_VERSION:
        return False
    return not readable_version(version, kind)


def readable_version(version: int, kind: str) -> bool:
    """Whether this recsave reads an index of `format_version` `version` and `kind`
    (docs/FORMAT.md section 3: 1 is "full" only, 2 every other kind, 3 and 4 any kind)."""
    if kind not in KINDS:
        return False
    if version in SHARED_RANGES_VERSIONS:
        return True
    return version == (FORMAT_VERSION if kind == KIND_FULL else DELTA_FORMAT_VERSION)


def version_for(kind: str, tensors: Mapping[str, "TensorEntry"]) -> int:
    """The format_version recsave writes an index of `kind` with: 4 when a chunk's segments follow
    the bucket rule, 3 when a chunk has bucket ranges (listed once, docs/FORMAT.md section 3), else
    the version readers of 1 and 2 know (1 for "full", 2 for the other kinds), so that a checkpoint
    without tables stays readable by them."""
    chunks = [c for t in tensors.values() for c in t.chunks]
    if any(c.bucket_segments is not None for c in chunks):
        return BUCKET_SEGMENTS_VERSION
    if any(c.buckets is not None for c in chunks):
        return BUCKET_RANGES_VERSION
    return FORMAT_VERSION if kind == KIND_FULL else DELTA_FORMAT_VERSION


if sys.version_info >= (3, 11):
    def _strict_b64decode(text: str) -> bytes:
        return binascii.a2b_base64(text, strict_mode=True)  # the check and the decode in one C pass
else:  # pragma: no cover (Python 3.9 and 3.10)
    def _strict_b64decode(text: str) -> bytes:
        return base64.b64decode(text, validate=True)


def pack_crcs(crcs: Sequence[int]) -> str:
    """A format_version 3 chunk's `crc32c`: base64 (RFC 4648, padded) of the values as consecutive
    little-endian uint32, about 5.3 bytes a segment where a JSON list takes about 11."""
    return base64.b64encode(struct.pack(f"<{len(crcs)}I", *crcs)).decode("ascii")


def unpack_crcs(text: str) -> Optional[Tuple[int, ...]]:
    """The CRC values of pack_crcs' text; None when it is not padded base64 of a multiple of 4 bytes.
    (Decoded in C, strictly: a 1000-rank index holds 78,000 of these strings.)"""
    try:
        raw = _strict_b64decode(text)
    except (ValueError, TypeError):  # binascii.Error is a ValueError; non-ASCII text too
        return None
    if len(raw) % 4:
        return None
    if _LITTLE_ENDIAN:
        return tuple(memoryview(raw).cast("I"))
    return struct.unpack(f"<{len(raw) // 4}I", raw)


@dataclass(frozen=True)
class Partition:
    """How sparse ids map to buckets: `{"scheme": "mix64", "num_buckets": B}`."""
    scheme: str
    num_buckets: int

    def to_json(self) -> Dict[str, Any]:
        return {"scheme": self.scheme, "num_buckets": self.num_buckets}


@dataclass(frozen=True)
class FileEntry:
    """A file of the checkpoint: its size, the rank that wrote it and, for files that are not
    shard files, the CRC32C of the whole file."""
    size: int
    rank: int
    crc32c: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"size": self.size, "rank": self.rank}
        if self.crc32c is not None:
            out["crc32c"] = self.crc32c
        return out


@dataclass(frozen=True)
class BucketRange:
    """Bucket `first + i` holds the chunk's rows `[row_starts[i], row_starts[i + 1])`."""
    first: int
    row_starts: Tuple[int, ...]

    def rows_of(self, lo: int, hi: int) -> Optional[Tuple[int, int]]:
        """Chunk-relative rows `[a, b)` of buckets `[lo, hi)`; None when the chunk has none of them."""
        first, starts = self.first, self.row_starts
        a, z = max(lo, first), min(hi, first + len(starts) - 1)
        if a < z and starts[a - first] < starts[z - first]:
            return starts[a - first], starts[z - first]
        return None

    def to_json(self) -> Dict[str, Any]:
        return {"first": self.first, "row_starts": self.row_starts}


@dataclass(frozen=True)
class Chunk:
    """Rows `[rows[0], rows[1])` of a tensor (`rows` is None for a 0-d tensor) stored at `offset`
    of `file`, checksummed per segment: uniform `segment_bytes` pieces, explicit `segments` ends,
    or `bucket_segments`, the rule that cuts them at the boundaries of `buckets` (format/segments.py;
    exactly one of the three is set)."""
    file: str
    offset: int
    length: int
    crc32c: Tuple[int, ...]
    segment_bytes: Optional[int] = None
    segments: Optional[Tuple[int, ...]] = None
    rows: Optional[Tuple[int, int]] = None
    buckets: Optional[BucketRange] = None
    bucket_segments: Optional[BucketSegments] = None

    @property
    def first_row(self) -> int:
        """The first logical row (0 for a 0-d tensor)."""
        return self.rows[0] if self.rows is not None else 0

    def segment_bounds(self) -> List[Tuple[int, int]]:
        """(begin, end) byte ranges of the checksum segments, relative to the chunk."""
        begins, ends = self._bound_arrays()
        return list(zip(begins.tolist(), ends.tolist()))

    def segment_ends(self) -> Tuple[int, ...]:
        """End offsets of the explicit or bucket-rule segments, relative to the chunk (() for
        uniform ones)."""
        return tuple(self._end_array().tolist())

    def _end_array(self) -> np.ndarray:
        """segment_ends as an int64 array (the bucket rule's straight from the engine)."""
        rule, buckets = self.bucket_segments, self.buckets
        if rule is None or buckets is None:
            return np.asarray(self.segments or (), dtype=np.int64)
        return segments.end_array(buckets.row_starts, segments.row_bytes_of(buckets.row_starts, self.length), rule)

    def _bound_arrays(self) -> Tuple[np.ndarray, np.ndarray]:
        """Begins and ends (uint64, relative to the chunk) of the checksum segments."""
        if self.segment_bytes is not None:  # a chunk of 0 bytes has one segment, (0, 0)
            begins = np.arange(0, max(self.length, 1), self.segment_bytes, dtype=np.uint64)
            return begins, np.minimum(begins + np.uint64(self.segment_bytes), np.uint64(self.length))
        ends = self._end_array().astype(np.uint64)
        return np.concatenate([np.zeros(min(len(ends), 1), dtype=np.uint64), ends[:-1]]), ends

    def segment_arrays(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """checked_segments as arrays: begins and ends (uint64, relative to the chunk) and CRC32Cs
        (uint32). A whole-tensor read plans thousands of bucket segments per tensor; a Python tuple
        per segment cost a 1 GB restore 13 ms of serial time (benchmarks/README.md)."""
        begins, ends = self._bound_arrays()
        crcs = np.asarray(self.crc32c, dtype=np.uint32)
        n = min(len(ends), len(crcs))  # as checked_segments' zip; the index parse checks they agree
        return begins[:n], ends[:n], crcs[:n]

    def checked_segments(self) -> Iterator[Tuple[int, int, int]]:
        """(begin, end, crc32c) of each segment, relative to the chunk."""
        for (b, e), crc in zip(self.segment_bounds(), self.crc32c):
            yield b, e, crc

    def shifted(self, base: int) -> "Chunk":
        """The chunk with its rows renumbered by `base` (merging parts of several ranks)."""
        if self.rows is None:
            return self
        return dataclasses.replace(self, rows=(self.rows[0] + base, self.rows[1] + base))

    def to_json(self, bucket_ids: Optional[Mapping["BucketRange", int]] = None) -> Dict[str, Any]:
        """The chunk entry; with `bucket_ids` (format_versions 3, 4), `buckets` is the position of its
        ranges in the index's `bucket_ranges` instead of the ranges themselves, and `crc32c` the
        CRCs packed (pack_crcs) instead of a list."""
        crcs = self.crc32c if bucket_ids is None else pack_crcs(self.crc32c)
        out: Dict[str, Any] = {"file": self.file, "offset": self.offset, "length": self.length, "crc32c": crcs}
        if self.segment_bytes is not None:
            out["segment_bytes"] = self.segment_bytes
        elif self.bucket_segments is not None:
            out["bucket_segments"] = self.bucket_segments.to_json()
        else:
            out["segments"] = self.segments
        if self.rows is not None:
            out["rows"] = self.rows
        if self.buckets is not None:
            out["buckets"] = self.buckets.to_json() if bucket_ids is None else bucket_ids[self.buckets]
        return out


@dataclass(frozen=True)
class TensorEntry:
    """A logical tensor, possibly split by rows over several chunks (in row order)."""
    dtype: str
    shape: Tuple[int, ...]
    chunks: Tuple[Chunk, ...]

    @property
    def dtype_info(self) -> DType:
        return BY_NAME[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return BY_NAME[self.dtype].torch_dtype

    @property
    def nbytes(self) -> int:
        return sum(c.length for c in self.chunks)

    def to_json(self, bucket_ids: Optional[Mapping["BucketRange", int]] = None) -> Dict[str, Any]:
        return {"dtype": self.dtype, "shape": self.shape, "chunks": [c.to_json(bucket_ids) for c in self.chunks]}


@dataclass(frozen=True)
class TableMeta:
    """A hash table of the checkpoint: embedding dim and dtype, optimizer slots, rows (of a full
    checkpoint: rows saved; of a delta: live rows of the table once the chain is applied), the table
    step (None in checkpoints without it) and, in a delta only, `cleared` (every row of the parent
    is dropped first) and the number of `tombstones` (ids removed since the parent)."""
    dim: int
    dtype: str
    slots: Tuple[str, ...]
    rows: int = 0
    quant: Optional[str] = None  # "int8": `<t>@embedding` holds codes, `<t>@scale` / `@offset` the rows' affine map
    step: Optional[int] = None
    cleared: Optional[bool] = None
    tombstones: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"dim": self.dim, "dtype": self.dtype, "slots": self.slots, "rows": self.rows}
        if self.quant is not None:
            out["quant"] = self.quant
        if self.step is not None:
            out["step"] = self.step
        if self.cleared is not None:
            out["cleared"] = self.cleared
        if self.tombstones is not None:
            out["tombstones"] = self.tombstones
        return out


@dataclass(frozen=True)
class DenseMeta:
    """A dense state_dict entry of model.pt: its shape and dtype."""
    shape: Tuple[int, ...]
    dtype: str

    def to_json(self) -> Dict[str, Any]:
        return {"shape": self.shape, "dtype": self.dtype}


@dataclass(frozen=True)
class Meta:
    """The index `meta` recsave writes: what the checkpoint holds, readable without its data.
    `io_state_count` is None in indexes that lack it (then it is the world size)."""
    tables: Mapping[str, TableMeta]
    dense: Mapping[str, DenseMeta]
    extras: Tuple[str, ...]
    io_states: Tuple[str, ...]
    io_state_count: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"tables": {n: t.to_json() for n, t in self.tables.items()},
                               "dense": {n: d.to_json() for n, d in self.dense.items()},
                               "extras": self.extras, "io_states": self.io_states}
        if self.io_state_count is not None:
            out["io_state_count"] = self.io_state_count
        return out


@dataclass(frozen=True)
class Retention:
    """The retention policy of the writer of an index (the optional top-level `retention`):
    which committed checkpoints its output dir keeps (recsave/format/retention.py)."""
    max_keep: Optional[int]
    keep_every_n_steps: Optional[int] = None
    keep_best: int = 0
    best_metric: Optional[str] = None
    best_mode: str = "max"

    @property
    def plain(self) -> bool:
        """Only max_keep: what every Saver did before retention policies (not written to indexes)."""
        return not self.keep_every_n_steps and not self.keep_best

    def to_json(self) -> Dict[str, Any]:
        return {"max_keep": self.max_keep, "keep_every_n_steps": self.keep_every_n_steps,
                "keep_best": self.keep_best, "best_metric": self.best_metric, "best_mode": self.best_mode}


def _files_json(files: Mapping[str, FileEntry]) -> Dict[str, Any]:
    return {n: f.to_json() for n, f in files.items()}


def _tensors_json(tensors: Mapping[str, TensorEntry],
                  bucket_ids: Optional[Mapping[BucketRange, int]] = None) -> Dict[str, Any]:
    return {n: t.to_json(bucket_ids) for n, t in tensors.items()}


def _bucket_ids(tensors: Mapping[str, TensorEntry]) -> Dict[BucketRange, int]:
    """Each distinct BucketRange of the chunks, numbered in order of first use: the tensors of a
    table (ids, embedding, slots, row metadata) share one per chunk, so the index lists it once."""
    ids: Dict[BucketRange, int] = {}
    for t in tensors.values():
        for c in t.chunks:
            if c.buckets is not None:
                ids.setdefault(c.buckets, len(ids))
    return ids


@dataclass(frozen=True)
class Parent:
    """The checkpoint a delta applies to: its id (a directory next to the delta's) and the CRC32C
    of its index bytes, so that a parent rewritten since is detected."""
    id: str
    crc32c: int

    def to_json(self) -> Dict[str, Any]:
        return {"id": self.id, "crc32c": self.crc32c}


@dataclass(frozen=True)
class IndexPart:
    """What one rank wrote (docs/FORMAT.md section 3, "Index parts"): write_shards returns one,
    merge_parts merges them into an Index."""
    rank: int
    files: Mapping[str, FileEntry]
    tensors: Mapping[str, TensorEntry]

    def joined(self, other: "IndexPart") -> "IndexPart":
        """This part plus `other`'s files and tensors (names must not repeat)."""
        _no_overlap(self.files, other.files, "file")
        _no_overlap(self.tensors, other.tensors, "tensor")
        return IndexPart(self.rank, {**self.files, **other.files}, {**self.tensors, **other.tensors})

    def with_files(self, files: Mapping[str, FileEntry]) -> "IndexPart":
        """This part plus `files` (e.g. the rank's io state)."""
        return self.joined(IndexPart(self.rank, files, {}))


@dataclass(frozen=True)
class Index:
    """A validated checkpoint index. `meta` is None when the index's meta is empty (an index not
    written by a Saver, e.g. by `write_shards` + `merge_parts` alone). `kind` is "full" (a Saver's
    checkpoint) or "serving" (recsave.export_serving: weights only)."""
    magic: str
    format_version: int
    recsave_version: str
    created_at: str
    step: Optional[int]
    world_size: int
    partition: Optional[Partition]
    files: Mapping[str, FileEntry]
    tensors: Mapping[str, TensorEntry]
    meta: Optional[Meta]
    kind: str = KIND_FULL
    parent: Optional[Parent] = None   # deltas only
    base: Optional[str] = None        # deltas only: id of the chain's full checkpoint

    @property
    def is_delta(self) -> bool:
        return self.kind == KIND_DELTA
    metrics: Optional[Mapping[str, float]] = None
    retention: Optional[Retention] = None
    # Whether the bytes this was parsed from ended with the seal (format/seal.py); False for an index
    # written before seals, or built in memory. Not part of the index's JSON or of equality.
    sealed: bool = dataclasses.field(default=False, compare=False)

    def tensor(self, name: str) -> TensorEntry:
        """The entry of tensor `name` (KeyError when the index has none)."""
        return self.tensors[name]

    def file(self, name: str) -> FileEntry:
        """The entry of file `name` (KeyError when the index lists none)."""
        return self.files[name]

    def table_names(self) -> List[str]:
        """Names of the hash tables the meta describes, in index order."""
        return list(self.meta.tables) if self.meta is not None else []

    @property
    def io_state_count(self) -> int:
        """How many workers saved io states (the world size when the meta does not say)."""
        if self.meta is None or self.meta.io_state_count is None:
            return self.world_size
        return self.meta.io_state_count

    @property
    def total_bytes(self) -> int:
        """Bytes of every file the index lists."""
        return sum(f.size for f in self.files.values())

    def with_files(self, files: Mapping[str, FileEntry]) -> "Index":
        """This index plus `files` (rank 0's model.pt, extra.pt, ...); names must not repeat."""
        _no_overlap(self.files, files, "file")
        return dataclasses.replace(self, files={**self.files, **files})

    def to_json(self) -> Dict[str, Any]:
        """The JSON object, keys in the order recsave writes them (`kind` only when it is not
        "full", so that full indexes read as they always did; a delta's `parent` and `base`, then
        `metrics` and `retention` only when set, last)."""
        out: Dict[str, Any] = {"magic": self.magic, "format_version": self.format_version}
        if self.kind != KIND_FULL:  # absent means "full": indexes of earlier releases stay byte-identical
            out["kind"] = self.kind
        out.update({
            "recsave_version": self.recsave_version,
            "created_at": self.created_at,
            "step": self.step,
            "world_size": self.world_size,
            "partition": self.partition.to_json() if self.partition is not None else None,
            "files": _files_json(self.files),
        })
        bucket_ids = None
        if self.format_version in SHARED_RANGES_VERSIONS:
            bucket_ids = _bucket_ids(self.tensors)
            out["bucket_ranges"] = [b.to_json() for b in bucket_ids]
        out["tensors"] = _tensors_json(self.tensors, bucket_ids)
        out["meta"] = self.meta.to_json() if self.meta is not None else {}
        if self.parent is not None:
            out["parent"] = self.parent.to_json()
        if self.base is not None:
            out["base"] = self.base
        if self.metrics is not None:
            out["metrics"] = dict(self.metrics)
        if self.retention is not None:
            out["retention"] = self.retention.to_json()
        return out


def _no_overlap(a: Mapping[str, Any], b: Mapping[str, Any], what: str) -> None:
    both = sorted(set(a) & set(b))
    if both:
        raise UsageError(f"{what}(s) {both[:5]} are described twice in one index part; give each "
                         f"file and tensor its own name", key=both[0])
