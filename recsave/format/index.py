"""The checkpoint index (docs/FORMAT.md section 3): build parts, merge them, parse and validate into
the typed records of recsave.format.records (its `meta` object in format/meta.py), read, write."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import json
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from recsave import gcpause, knobs
from recsave.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    OverLimitError,
    UsageError,
)
from recsave.format import checks, seal
from recsave.format import segments as bucket_rule
from recsave.format.dtypes import from_name
from recsave.format.meta import parse_meta
from recsave.format.parsecache import ParseCache
from recsave.format.records import (
    BUCKET_RANGES_VERSION,
    BUCKET_SEGMENTS_VERSION,
    DELTA_FORMAT_VERSION,
    FORMAT_VERSION,
    KIND_DELTA,
    KIND_FULL,
    KINDS,
    MAGIC,
    READABLE_FORMAT_VERSIONS,
    SHARED_RANGES_VERSIONS,
    BucketRange,
    Chunk,
    FileEntry,
    Index,
    IndexPart,
    Meta,
    Parent,
    Partition,
    Retention,
    TensorEntry,
    unpack_crcs,
    version_for,
)
from recsave.format.segments import BucketSegments
from recsave.storage import Storage, get_storage
from recsave.version import __version__

INDEX_FILE = "index"
REQUIRED_KEYS = ("magic", "format_version", "recsave_version", "created_at", "step", "world_size",
                 "partition", "files", "tensors", "meta")
# The keys a file entry and a chunk entry may have (docs/FORMAT.md section 3): unlike the top
# level, any other key is corrupt (checks.only_keys).
FILE_KEYS = frozenset({"size", "rank", "crc32c"})
CHUNK_KEYS = frozenset({"file", "offset", "length", "rows", "crc32c", "segment_bytes", "segments",
                        "bucket_segments", "buckets"})


def new_part(rank: int) -> IndexPart:
    """An empty index part for one rank."""
    return IndexPart(rank, {}, {})


def merge_parts(parts: Sequence[IndexPart], *, step: Optional[int] = None,
                partition: Optional[Partition] = None, meta: Optional[Meta] = None,
                world_size: Optional[int] = None, metrics: Optional[Mapping[str, float]] = None,
                retention: Optional[Retention] = None) -> Index:
    """Merges per-rank parts into one index: files united, chunks of a tensor concatenated in rank
    order with their rows renumbered."""
    with gcpause.paused():  # a record per chunk of every rank: no cycles to collect
        return _merge(sorted(parts, key=lambda p: p.rank), step, partition, meta, world_size, metrics, retention)


def _merge(ordered: Sequence[IndexPart], step: Optional[int], partition: Optional[Partition],
           meta: Optional[Meta], world_size: Optional[int], metrics: Optional[Mapping[str, float]],
           retention: Optional[Retention]) -> Index:
    files: Dict[str, FileEntry] = {}
    tensors: Dict[str, TensorEntry] = {}  # first part's entry; rows and chunks of all are gathered below
    rows: Dict[str, int] = {}
    chunks: Dict[str, List[Chunk]] = {}
    several: Set[str] = set()
    for part in ordered:
        for name, file in part.files.items():
            if name in files:
                raise UsageError(f"file {name!r} is described by two index parts (ranks "
                                 f"{files[name].rank} and {part.rank}); give each rank its own "
                                 f"file names")
            files[name] = file
        for name, entry in part.tensors.items():
            merged = tensors.get(name)
            if merged is None:
                tensors[name], chunks[name] = entry, list(entry.chunks)
                rows[name] = entry.shape[0] if entry.shape else 0
                continue
            if merged.dtype != entry.dtype or merged.shape[1:] != entry.shape[1:] or not entry.shape \
                    or not merged.shape:
                raise UsageError(f"tensor {name!r} differs between ranks: {merged.dtype} "
                                 f"{[rows[name], *merged.shape[1:]]} vs {entry.dtype} {list(entry.shape)}; "
                                 f"every rank must hold the table with the same dim and dtype", key=name)
            several.add(name)
            chunks[name] += [c.shifted(rows[name]) for c in entry.chunks]
            rows[name] += entry.shape[0]
    for name in several:
        first = tensors[name]
        tensors[name] = TensorEntry(first.dtype, (rows[name], *first.shape[1:]), tuple(chunks[name]))
    return Index(
        magic=MAGIC,
        format_version=version_for(KIND_FULL, tensors),
        recsave_version=__version__,
        created_at=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        step=step,
        world_size=world_size if world_size is not None else max(len(ordered), 1),
        partition=partition,
        files=files,
        tensors=tensors,
        meta=meta,
        metrics=None if metrics is None else dict(metrics),
        retention=retention,
    )


def validate(index: Any, path: str) -> Index:
    """Checks every rule of docs/FORMAT.md section 3 that needs no file access on a JSON-decoded
    index and builds its records."""
    if not isinstance(index, dict):
        raise checks.corrupt(path, "index is not a JSON object")
    if index.get("magic") != MAGIC:
        raise checks.corrupt(path, f"bad magic {index.get('magic')!r} (expected {MAGIC!r})")
    version = index.get("format_version")
    if type(version) is not int:
        raise checks.corrupt(path, f"format_version must be an integer, found {version!r}")
    if version < FORMAT_VERSION:  # no recsave ever wrote it: damage, not a newer writer's index
        raise checks.corrupt(path, f"format_version {version} is no version any recsave writes (the first "
                                   f"is {FORMAT_VERSION})")
    if version not in READABLE_FORMAT_VERSIONS:
        raise FormatVersionError(
            f"{path}: format_version {version!r} is not supported by recsave {__version__} (reads "
            f"versions {list(READABLE_FORMAT_VERSIONS)}); upgrade recsave to read this checkpoint", path=path)
    kind = index.get("kind", KIND_FULL)
    if not isinstance(kind, str):
        raise checks.corrupt(path, f"kind must be a string, found {kind!r}")
    if kind not in KINDS and version <= FORMAT_VERSION:  # a new kind comes with a new version: damage
        raise checks.corrupt(path, f"checkpoint kind {kind!r} with format_version {version}: every kind but "
                                   f"'full' has a higher version")
    if kind not in KINDS:
        raise FormatVersionError(f"{path}: checkpoint kind {kind!r} is not supported by recsave {__version__} "
                                 f"(reads {list(KINDS)}); upgrade recsave to read this checkpoint", path=path)
    if kind != KIND_FULL and version == FORMAT_VERSION:
        raise checks.corrupt(path, f"a {kind!r} index must have format_version > {FORMAT_VERSION}, found {version}")
    if kind == KIND_FULL and version == DELTA_FORMAT_VERSION:  # version 2 is only defined for the other kinds
        raise FormatVersionError(
            f"{path}: format_version {version} of a full checkpoint is not supported by recsave {__version__} "
            f"(reads versions {FORMAT_VERSION}, {BUCKET_RANGES_VERSION} and {BUCKET_SEGMENTS_VERSION} for full "
            f"checkpoints); upgrade "
            f"recsave to read it", path=path)
    absent = [k for k in REQUIRED_KEYS if k not in index]
    if absent:
        raise checks.corrupt(path, f"index lacks required key(s) {absent}")
    world_size = checks.as_int(index.get("world_size"), "world_size", path, lo=1, hi=1 << 24)
    partition = _parse_partition(index.get("partition"), path)
    if not isinstance(index.get("meta"), dict):
        raise checks.corrupt(path, "index 'meta' must be an object")
    raw_files = index.get("files")
    raw_tensors = index.get("tensors")
    if not isinstance(raw_files, dict) or not isinstance(raw_tensors, dict):
        raise checks.corrupt(path, "index needs 'files' and 'tensors' objects")
    files: Dict[str, FileEntry] = {}
    for name, entry in raw_files.items():
        checks.as_plain_name(name, "file name", path)
        if not isinstance(entry, dict):
            raise checks.corrupt(path, f"entry of file {name!r} is not an object")
        checks.only_keys(entry, FILE_KEYS, f"entry of file {name!r}", path)
        size = checks.as_int(entry.get("size"), f"size of {name!r}", path)
        crc = None
        if "crc32c" in entry:
            crc = checks.as_int(entry["crc32c"], f"crc32c of {name!r}", path, hi=0xFFFFFFFF)
        rank = checks.as_int(entry.get("rank"), f"rank of {name!r}", path, hi=1 << 24)
        files[name] = FileEntry(size, rank, crc)
    shared = None
    if version in SHARED_RANGES_VERSIONS:
        shared = _SharedRanges(_parse_bucket_ranges(index.get("bucket_ranges"), version, path),
                               rules=version == BUCKET_SEGMENTS_VERSION)
    spans: Dict[str, List[Tuple[int, int, str]]] = {}
    tensors = {name: _parse_tensor(name, entry, files, spans, shared, path) for name, entry in raw_tensors.items()}
    for fname, ranges in spans.items():
        ranges.sort()
        for (_b0, e0, n0), (b1, _e1, n1) in zip(ranges, ranges[1:]):
            if b1 < e0:
                raise checks.corrupt(path, f"chunks of {n0!r} and {n1!r} overlap in {fname!r}")
    step = index["step"]
    if step is not None and type(step) is not int:
        raise checks.corrupt(path, f"step must be an integer or null, found {step!r}")
    for key in ("recsave_version", "created_at"):
        if not isinstance(index[key], str):
            raise checks.corrupt(path, f"{key} must be a string, found {index[key]!r}")
    parent, base = _parse_chain(index, kind, version, path)
    meta = parse_meta(index["meta"], tensors, path)
    if kind == KIND_DELTA:
        for name, t in (meta.tables if meta is not None else {}).items():
            if t.cleared is None or t.tombstones is None or f"{name}@tombstone" not in tensors:
                raise checks.corrupt(path, f"delta table {name!r} needs 'cleared', 'tombstones' and "
                                     f"its tensor {name}@tombstone")
            if tensors[f"{name}@tombstone"].shape[:1] != (t.tombstones,):
                raise checks.corrupt(path, f"table {name!r} records {t.tombstones} tombstones, its "
                                     f"tensor {name}@tombstone holds {tensors[f'{name}@tombstone'].shape}")
    return Index(magic=MAGIC, format_version=version, recsave_version=index["recsave_version"],
                 created_at=index["created_at"], step=step, world_size=world_size, partition=partition,
                 files=files, tensors=tensors, meta=meta, kind=kind, parent=parent, base=base,
                 metrics=_parse_metrics(index.get("metrics"), path),
                 retention=_parse_retention(index.get("retention"), path))


def _parse_chain(index: Dict[str, Any], kind: str, version: int, path: str) -> Tuple[Optional[Parent], Optional[str]]:
    """(parent, base) of an index (docs/FORMAT.md section 10): a delta needs format_version 2 or
    above, a parent {"id", "crc32c"} and the id of its chain's base; other kinds have neither."""
    if kind != KIND_DELTA:
        if "parent" in index or "base" in index:
            raise checks.corrupt(path, f"a {kind!r} checkpoint's index must not have 'parent' or 'base'")
        return None, None
    if version not in (DELTA_FORMAT_VERSION, *SHARED_RANGES_VERSIONS):
        raise checks.corrupt(path, f"a delta index must have format_version {DELTA_FORMAT_VERSION}, "
                             f"{BUCKET_RANGES_VERSION} or {BUCKET_SEGMENTS_VERSION}, found {version}")
    raw = index.get("parent")
    if not isinstance(raw, dict):
        raise checks.corrupt(path, f"a delta index needs 'parent': {{'id', 'crc32c'}}, found {raw!r}")
    parent = Parent(checks.as_plain_name(raw.get("id"), "parent id", path),
                    checks.as_int(raw.get("crc32c"), "parent crc32c", path, hi=0xFFFFFFFF))
    base = checks.as_plain_name(index.get("base"), "base id", path)
    return parent, base


def _parse_metrics(metrics: Any, path: str) -> Optional[Dict[str, float]]:
    """The optional `metrics` object: metric name -> finite number (absent: None)."""
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        raise checks.corrupt(path, f"index 'metrics' must be an object of name -> number, found {metrics!r}")
    for name, value in metrics.items():
        if not checks.is_finite_number(value):
            raise checks.corrupt(path, f"metric {name!r} must be a finite number, found {value!r}")
    return dict(metrics)


def _parse_retention(retention: Any, path: str) -> Optional[Retention]:
    """The optional `retention` object: the writer's retention policy (absent: None)."""
    if retention is None:
        return None

    def bad(detail: str) -> Exception:
        return checks.corrupt(path, f"index 'retention' is not a retention policy ({detail})")

    if not isinstance(retention, dict):
        raise bad("not an object")
    max_keep, every = retention.get("max_keep"), retention.get("keep_every_n_steps")
    best, metric, mode = retention.get("keep_best", 0), retention.get("best_metric"), retention.get("best_mode", "max")
    for name, value in (("max_keep", max_keep), ("keep_every_n_steps", every)):
        if value is not None and (type(value) is not int or value < 1):
            raise bad(f"{name} must be an int >= 1 or null, found {value!r}")
    if type(best) is not int or best < 0:
        raise bad(f"keep_best must be an int >= 0, found {best!r}")
    if metric is not None and not isinstance(metric, str):
        raise bad(f"best_metric must be a string or null, found {metric!r}")
    if mode not in ("max", "min"):
        raise bad(f"best_mode must be 'max' or 'min', found {mode!r}")
    return Retention(max_keep, every, best, metric, mode)


def _parse_partition(partition: Any, path: str) -> Optional[Partition]:
    if partition is None:
        return None
    if not isinstance(partition, dict) or partition.get("scheme") != "mix64":
        raise checks.corrupt(path, f"unknown partition {partition!r} (this recsave knows scheme 'mix64')")
    return Partition("mix64", checks.as_int(partition.get("num_buckets"), "num_buckets", path, lo=1, hi=1 << 30))


class _SharedRanges:
    """The `bucket_ranges` of a format_version 3 or 4 index and, in version 4 (`rules`), the segment
    count of each (range, row size, rule) its chunks name: a table's tensors share them, so each is
    counted once however many tensors name it."""

    def __init__(self, ranges: List[BucketRange], rules: bool) -> None:
        self.ranges, self.rules = ranges, rules
        self._counts: Dict[Tuple[int, int, int, int], int] = {}
        self._rules: Dict[Tuple[int, int], BucketSegments] = {}

    def rule(self, raw: Any, path: str, name: str) -> BucketSegments:
        """A chunk's `bucket_segments`, checked once per distinct value (a save uses one per row size)."""
        if isinstance(raw, dict) and len(raw) == 2:
            step, least = raw.get("step"), raw.get("min")
            if type(step) is int and type(least) is int:  # not bool: True would match 1
                rule = self._rules.get((step, least))
                if rule is None:
                    rule = self._rules[(step, least)] = _parse_rule(raw, path, name)
                return rule
        return _parse_rule(raw, path, name)  # refuses it, saying why

    def segment_count(self, ref: int, row_bytes: int, rule: BucketSegments) -> int:
        key = (ref, row_bytes, rule.step, rule.min_bytes)  # ints hash in C; the dataclass's hash is Python
        n = self._counts.get(key)
        if n is None:
            n = self._counts[key] = bucket_rule.count(self.ranges[ref].row_starts, row_bytes, rule)
        return n


def _parse_bucket_ranges(raw: Any, version: int, path: str) -> List[BucketRange]:
    """The `bucket_ranges` list of a format_version 3 or 4 index: each entry checked once here (rows
    from 0, never decreasing); a chunk referring to one checks that it ends at the chunk's rows."""
    if not isinstance(raw, list):
        raise checks.corrupt(path, f"a format_version {version} index needs a 'bucket_ranges' "
                             f"list, found {type(raw).__name__}")
    out = []
    for i, entry in enumerate(raw):
        where = f"bucket_ranges[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("row_starts"), list):
            raise checks.corrupt(path, f"{where} must be {{'first': int, 'row_starts': [...]}}")
        first = checks.as_int(entry.get("first"), f"{where} first bucket", path)
        starts = checks.as_ints(entry["row_starts"], f"{where} row start", path, increasing="weakly")
        if not starts or starts[0] != 0:
            raise checks.corrupt(path, f"{where} row_starts must begin at 0")
        out.append(BucketRange(first, tuple(starts)))
    return out


def _parse_tensor(name: str, entry: Any, files: Dict[str, FileEntry],
                  spans: Dict[str, List[Tuple[int, int, str]]], shared: Optional[_SharedRanges],
                  path: str) -> TensorEntry:
    if not isinstance(entry, dict) or not isinstance(entry.get("chunks"), list):
        raise checks.corrupt(path, "tensor entry needs 'dtype', 'shape' and a 'chunks' list", name)
    dtype = from_name(entry.get("dtype"), path=path, key=name)
    shape = checks.as_shape(entry.get("shape"), path, name)
    checks.byte_size(shape, dtype.itemsize, path, name)
    raw_chunks = entry["chunks"]
    if not shape and len(raw_chunks) != 1:
        raise checks.corrupt(path, "a 0-d tensor must have exactly one chunk", name)
    next_row = 0
    chunks: List[Chunk] = []
    for chunk in raw_chunks:
        if not isinstance(chunk, dict):
            raise checks.corrupt(path, "chunk is not an object", name)
        checks.only_keys(chunk, CHUNK_KEYS, "chunk", path, name)
        fname = chunk.get("file")
        if type(fname) is not str or fname not in files:  # the names in 'files' were checked plain
            fname = checks.as_plain_name(fname, "chunk file", path)
            raise checks.corrupt(path, f"chunk refers to file {fname!r} missing from 'files'", name)
        offset = checks.as_int(chunk.get("offset"), "chunk offset", path, name)
        length = checks.as_int(chunk.get("length"), "chunk length", path, name)
        if offset + length > files[fname].size:
            raise checks.corrupt(path, f"chunk [{offset}, {offset + length}) lies beyond the "
                                 f"{files[fname].size}-byte file {fname!r}", name)
        rows: Optional[Tuple[int, int]] = None
        if shape:
            raw_rows = chunk.get("rows")
            if not isinstance(raw_rows, list) or len(raw_rows) != 2:
                raise checks.corrupt(path, f"chunk rows must be [start, stop], found {raw_rows!r}", name)
            start = checks.as_int(raw_rows[0], "chunk row start", path, name)
            stop = checks.as_int(raw_rows[1], "chunk row stop", path, name, lo=start)
            if start != next_row:
                raise checks.corrupt(path, f"chunk rows start at {start}, expected {next_row}", name)
            next_row = stop
            rows = (start, stop)
            chunk_shape = [stop - start] + shape[1:]
        else:
            if "rows" in chunk:
                raise checks.corrupt(path, "a 0-d tensor's chunk must not have rows", name)
            chunk_shape = []
        if checks.byte_size(chunk_shape, dtype.itemsize, path, name) != length:
            raise checks.corrupt(path, f"chunk length {length} does not match shape {chunk_shape} "
                                 f"of {dtype.name}", name)
        chunks.append(_parse_segments(chunk, fname, offset, length, rows, shared, path, name))
        spans.setdefault(fname, []).append((offset, offset + length, name))
    if shape and next_row != shape[0]:
        raise checks.corrupt(path, f"chunks cover {next_row} rows of {shape[0]}", name)
    return TensorEntry(dtype.name, tuple(shape), tuple(chunks))


def _parse_segments(chunk: Dict[str, Any], fname: str, offset: int, length: int,
                    rows: Optional[Tuple[int, int]], shared: Optional[_SharedRanges], path: str,
                    name: str) -> Chunk:
    crcs: Sequence[int]
    if shared is None:
        crcs = checks.as_ints(chunk.get("crc32c"), "crc32c value", path, name, hi=0xFFFFFFFF)
    else:  # format_version 3 or 4: packed
        crcs = _packed_crcs(chunk.get("crc32c"), path, name)
    buckets = chunk.get("buckets")
    ref: Optional[int] = None
    if buckets is None:
        ranges = None
    elif shared is None:
        ranges = _parse_buckets(buckets, rows, path, name)
    else:
        ref = _shared_bucket_ref(buckets, shared.ranges, rows, path, name)
        ranges = shared.ranges[ref]
    forms = [k for k in ("segment_bytes", "segments", "bucket_segments") if k in chunk]
    if len(forms) != 1:
        raise checks.corrupt(path, "chunk needs exactly one of segment_bytes, segments and bucket_segments "
                             f"(bucket_segments only in format_version {BUCKET_SEGMENTS_VERSION}), found "
                             f"{forms or 'none'}", name)
    step: Optional[int] = None
    ends: Optional[List[int]] = None
    rule: Optional[BucketSegments] = None
    if forms[0] == "segment_bytes":
        step = checks.as_int(chunk["segment_bytes"], "segment_bytes", path, name, lo=1)
        expected = max(1, -(-length // step))
    elif forms[0] == "segments":
        ends = checks.as_ints(chunk["segments"], "segment end", path, name, hi=length, increasing="strictly")
        if not ends:
            raise checks.corrupt(path, "segments must be a non-empty list", name)
        if length and ends[0] == 0:
            raise checks.corrupt(path, "segment ends must be strictly increasing from 0", name)
        if ends[-1] != length or (length == 0 and len(ends) != 1):
            raise checks.corrupt(path, f"segments end at {ends[-1]}, chunk length is {length}", name)
        expected = len(ends)
    else:
        if shared is None or not shared.rules or ref is None or rows is None:
            raise checks.corrupt(path, f"bucket_segments needs format_version {BUCKET_SEGMENTS_VERSION} and "
                                 f"the chunk's 'buckets'", name)
        rule = shared.rule(chunk["bucket_segments"], path, name)
        expected = shared.segment_count(ref, bucket_rule.row_bytes_of(shared.ranges[ref].row_starts, length), rule)
    if len(crcs) != expected:
        raise checks.corrupt(path, f"{len(crcs)} crc32c values for {expected} segments", name)
    return Chunk(fname, offset, length, tuple(crcs), step, None if ends is None else tuple(ends), rows, ranges,
                 rule)


def _parse_rule(raw: Any, path: str, name: str) -> BucketSegments:
    """A format_version 4 chunk's `bucket_segments`: {"step": int >= 1, "min": int >= 0}."""
    if not isinstance(raw, dict) or set(raw) != {"step", "min"}:
        raise checks.corrupt(path, f"bucket_segments must be {{'step': int, 'min': int}}, found {raw!r:.80}", name)
    return BucketSegments(checks.as_int(raw["step"], "bucket_segments step", path, name, lo=1),
                          checks.as_int(raw["min"], "bucket_segments min", path, name))


def _packed_crcs(text: Any, path: str, name: str) -> Tuple[int, ...]:
    """A format_version 3 or 4 chunk's `crc32c`: base64 of little-endian uint32 values."""
    crcs = unpack_crcs(text) if isinstance(text, str) else None
    if crcs is None:
        raise checks.corrupt(path, f"crc32c must be base64 of 4-byte little-endian values in a format_version "
                             f"{BUCKET_RANGES_VERSION} or {BUCKET_SEGMENTS_VERSION} index, found {text!r:.80}", name)
    return crcs


def _shared_bucket_ref(ref: Any, shared: List[BucketRange], rows: Optional[Tuple[int, int]], path: str,
                       name: str) -> int:
    """A format_version 3 or 4 chunk's `buckets`: the position of its ranges in `bucket_ranges`."""
    if type(ref) is not int or not 0 <= ref < len(shared):
        raise checks.corrupt(path, f"chunk buckets must be a position in 'bucket_ranges' (0 to "
                             f"{len(shared) - 1}), found {ref!r}", name)
    nrows = rows[1] - rows[0] if rows else 0
    if shared[ref].row_starts[-1] != nrows:
        raise checks.corrupt(path, f"bucket_ranges[{ref}] ends at row {shared[ref].row_starts[-1]}, the "
                             f"chunk has {nrows} rows", name)
    return ref


def _parse_buckets(buckets: Any, rows: Optional[Tuple[int, int]], path: str, name: str) -> BucketRange:
    if not isinstance(buckets, dict) or not isinstance(buckets.get("row_starts"), list):
        raise checks.corrupt(path, "chunk buckets must be {'first': int, 'row_starts': [...]}", name)
    first = checks.as_int(buckets.get("first"), "first bucket", path, name)
    nrows = rows[1] - rows[0] if rows else 0
    starts = checks.as_ints(buckets["row_starts"], "bucket row start", path, name, hi=nrows, increasing="weakly")
    if starts and starts[0] != 0:
        raise checks.corrupt(path, "bucket row_starts must begin at 0", name)
    if not starts or starts[-1] != nrows:
        raise checks.corrupt(path, f"bucket row_starts must end at the chunk's {nrows} rows", name)
    return BucketRange(first, tuple(starts))


def dumps(index: Index) -> bytes:
    """The index bytes recsave writes: compact JSON, keys in the records' order, sealed with the CRC32C
    of its bytes (format/seal.py)."""
    with gcpause.paused():  # to_json builds a dict per chunk
        return seal.seal(json.dumps(index.to_json(), separators=(",", ":"), sort_keys=False).encode())


def write(directory: str, index: Index, *, durable: Optional[bool] = None,
          storage: Optional[Storage] = None) -> str:
    """Writes `index` into `directory` atomically (temporary name + fsync + rename locally, one put
    on object stores). Returns its path."""
    return write_bytes(directory, dumps(index), durable=durable, storage=storage)


def write_bytes(directory: str, data: bytes, *, durable: Optional[bool] = None,
                storage: Optional[Storage] = None) -> str:
    """write() of index bytes made by dumps() (a caller that keeps what it wrote, e.g. their CRC32C)."""
    storage = storage or get_storage(directory)
    path = storage.join(directory, INDEX_FILE)
    if durable is None:
        storage.write_atomic(path, data)
    else:
        with knobs.override(fsync=durable):
            storage.write_atomic(path, data)
    return path


_PARSED: ParseCache[Index] = ParseCache()


def parse(data: bytes, path: str) -> Index:
    """Parses and validates index bytes read from `path` into an Index (the same bytes parsed
    before give the same, immutable, Index: format/parsecache.py)."""
    return _PARSED.get(data, lambda raw: _parse(raw, path))


def _parse(data: bytes, path: str) -> Index:
    with gcpause.paused():  # a record per chunk: at a thousand ranks most of the time was collection
        try:
            index = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise checks.corrupt(path, f"index is not UTF-8 JSON ({exc})") from None
        if isinstance(index, dict):  # the seal first: damage reads as damage, not as a newer version
            seal.check(data, index, path)
        result = validate(index, path)
        return dataclasses.replace(result, sealed=True) if seal.KEY in index else result


# How index bytes are fetched: Storage.read_bytes, unless a load installed another reader
# (load/shared_reads.py: rank 0 reads each index once and the other ranks take its bytes).
IndexBytesReader = Callable[[Storage, str, int], bytes]
_reader: "contextvars.ContextVar[Optional[IndexBytesReader]]" = contextvars.ContextVar("recsave_index_reader",
                                                                                      default=None)


@contextlib.contextmanager
def reading_through(reader: IndexBytesReader) -> Iterator[None]:
    """Within the block (this thread / task), read_bytes fetches index bytes through
    `reader(storage, path, limit)`, which must behave as Storage.read_bytes does."""
    token = _reader.set(reader)
    try:
        yield
    finally:
        _reader.reset(token)


def read_bytes(storage: Storage, path: str) -> bytes:
    """The bytes of the index file at `path`, refusing one over the ``max_index_bytes`` knob before
    reading it (CorruptCheckpointError); CheckpointNotFoundError when it is missing."""
    limit = knobs.get("max_index_bytes")
    reader = _reader.get()
    try:
        return storage.read_bytes(path, limit) if reader is None else reader(storage, path, limit)
    except OverLimitError as exc:
        raise OverLimitError(f"{exc} (the knob max_index_bytes): the index may be intact, written by a job "
                             f"that raised the knob; raise it here to read it", path=path) from None


def read(directory: str, storage: Optional[Storage] = None) -> Index:
    """Reads and validates `<directory>/index` (through `storage`, by default the one of
    `directory`), refusing one over the ``max_index_bytes`` knob before reading it."""
    return parse(*read_raw(directory, storage))


def read_for_retention(directory: str, storage: Optional[Storage] = None) -> Optional[Index]:
    """`read`, None when the index is gone, damaged or a newer recsave's: a checkpoint retention
    knows no step or metrics of (kept by its other rules). An index over the knob max_index_bytes
    here (OverLimitError, maybe intact) or a failed read (StorageError) raises: no answer, which
    taken as "no metrics" would drop a best or every-n checkpoint from the selection."""
    try:
        return read(directory, storage)
    except OverLimitError:
        raise
    except (CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError):
        return None


def read_raw(directory: str, storage: Optional[Storage] = None) -> Tuple[bytes, str]:
    """The bytes of `<directory>/index` and their path, unparsed (read's first half: a caller
    that needs their CRC32C too); CheckpointNotFoundError naming the directory without one."""
    storage = storage or get_storage(directory)
    path = storage.join(directory, INDEX_FILE)
    try:
        return read_bytes(storage, path), path
    except CheckpointNotFoundError:
        raise _no_index(directory, path) from None


def _no_index(directory: str, path: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"{path} does not exist: {directory!r} is not a committed recsave checkpoint (no index); "
        f"check the path or pick a checkpoint listed in the output dir's 'checkpoint' file", path=path)
