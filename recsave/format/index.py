"""The checkpoint index (docs/FORMAT.md section 3): build parts, merge them, validate, read, write."""
from __future__ import annotations

import datetime
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from recsave import knobs
from recsave.errors import CheckpointNotFoundError, FormatVersionError, UsageError
from recsave.version import __version__
from recsave.format import checks
from recsave.format.dtypes import from_name
from recsave.storage import Storage, get_storage

MAGIC = "recsave.index"
FORMAT_VERSION = 1
INDEX_FILE = "index"
REQUIRED_KEYS = ("magic", "format_version", "recsave_version", "created_at", "step", "world_size",
                 "partition", "files", "tensors", "meta")


def new_part(rank: int) -> Dict[str, Any]:
    """An empty index part for one rank."""
    return {"magic": MAGIC, "format_version": FORMAT_VERSION, "rank": rank, "files": {}, "tensors": {}}


def merge_parts(parts: Sequence[Dict[str, Any]], *, step: Optional[int] = None,
                partition: Optional[Dict[str, Any]] = None, meta: Optional[Dict[str, Any]] = None,
                world_size: Optional[int] = None) -> Dict[str, Any]:
    """Merges per-rank parts into one index: files united, chunks of a tensor concatenated in rank
    order with their rows renumbered. Parts are not modified."""
    ordered = sorted(parts, key=lambda p: p["rank"])
    files: Dict[str, Any] = {}
    tensors: Dict[str, Any] = {}
    for part in ordered:
        for name, entry in part["files"].items():
            if name in files:
                raise UsageError(f"file {name!r} is described by two index parts (ranks "
                                 f"{files[name].get('rank')} and {part['rank']}); give each rank its own "
                                 f"file names")
            files[name] = dict(entry)
        for name, entry in part["tensors"].items():
            merged = tensors.get(name)
            if merged is None:
                tensors[name] = {"dtype": entry["dtype"], "shape": list(entry["shape"]),
                                 "chunks": [dict(c) for c in entry["chunks"]]}
                continue
            if merged["dtype"] != entry["dtype"] or merged["shape"][1:] != entry["shape"][1:] \
                    or not entry["shape"]:
                raise UsageError(f"tensor {name!r} differs between ranks: {merged['dtype']} "
                                 f"{merged['shape']} vs {entry['dtype']} {entry['shape']}; every rank "
                                 f"must hold the table with the same dim and dtype", key=name)
            base = merged["shape"][0]
            for chunk in entry["chunks"]:
                c = dict(chunk)
                c["rows"] = [chunk["rows"][0] + base, chunk["rows"][1] + base]
                merged["chunks"].append(c)
            merged["shape"][0] += entry["shape"][0]
    return {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "recsave_version": __version__,
        "created_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "step": step,
        "world_size": world_size if world_size is not None else max(len(ordered), 1),
        "partition": partition,
        "files": files,
        "tensors": tensors,
        "meta": meta or {},
    }


def segment_bounds(chunk: Dict[str, Any]) -> List[Tuple[int, int]]:
    """(begin, end) byte ranges of a chunk's checksum segments, relative to the chunk."""
    length = chunk["length"]
    if "segment_bytes" in chunk:
        step = chunk["segment_bytes"]
        if length == 0:
            return [(0, 0)]
        return [(b, min(b + step, length)) for b in range(0, length, step)]
    bounds, begin = [], 0
    for end in chunk["segments"]:
        bounds.append((begin, end))
        begin = end
    return bounds


def validate(index: Any, path: str) -> Dict[str, Any]:
    """Checks every rule of docs/FORMAT.md section 3 that needs no file access. Returns the index."""
    if not isinstance(index, dict):
        raise checks.corrupt(path, "index is not a JSON object")
    if index.get("magic") != MAGIC:
        raise checks.corrupt(path, f"bad magic {index.get('magic')!r} (expected {MAGIC!r})")
    version = index.get("format_version")
    if type(version) is not int:
        raise checks.corrupt(path, f"format_version must be an integer, found {version!r}")
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"{path}: format_version {version!r} is not supported by recsave {__version__} (reads "
            f"version {FORMAT_VERSION}); upgrade recsave to read this checkpoint", path=path)
    absent = [k for k in REQUIRED_KEYS if k not in index]
    if absent:
        raise checks.corrupt(path, f"index lacks required key(s) {absent}")
    checks.as_int(index.get("world_size"), "world_size", path, lo=1, hi=1 << 24)
    _validate_partition(index.get("partition"), path)
    if not isinstance(index.get("meta"), dict):
        raise checks.corrupt(path, "index 'meta' must be an object")
    files = index.get("files")
    tensors = index.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        raise checks.corrupt(path, "index needs 'files' and 'tensors' objects")
    for name, entry in files.items():
        checks.as_plain_name(name, "file name", path)
        if not isinstance(entry, dict):
            raise checks.corrupt(path, f"entry of file {name!r} is not an object")
        checks.as_int(entry.get("size"), f"size of {name!r}", path)
        if "crc32c" in entry:
            checks.as_int(entry["crc32c"], f"crc32c of {name!r}", path, hi=0xFFFFFFFF)
    spans: Dict[str, List[Tuple[int, int, str]]] = {}
    for name, entry in tensors.items():
        _validate_tensor(name, entry, files, spans, path)
    for fname, ranges in spans.items():
        ranges.sort()
        for (b0, e0, n0), (b1, _e1, n1) in zip(ranges, ranges[1:]):
            if b1 < e0:
                raise checks.corrupt(path, f"chunks of {n0!r} and {n1!r} overlap in {fname!r}")
    return index


def _validate_partition(partition: Any, path: str) -> None:
    if partition is None:
        return
    if not isinstance(partition, dict) or partition.get("scheme") != "mix64":
        raise checks.corrupt(path, f"unknown partition {partition!r} (this recsave knows scheme 'mix64')")
    checks.as_int(partition.get("num_buckets"), "num_buckets", path, lo=1, hi=1 << 30)


def _validate_tensor(name: str, entry: Any, files: Dict[str, Any],
                     spans: Dict[str, List[Tuple[int, int, str]]], path: str) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("chunks"), list):
        raise checks.corrupt(path, "tensor entry needs 'dtype', 'shape' and a 'chunks' list", name)
    dtype = from_name(entry.get("dtype"), path=path, key=name)
    shape = checks.as_shape(entry.get("shape"), path, name)
    checks.byte_size(shape, dtype.itemsize, path, name)
    chunks = entry["chunks"]
    if not shape and len(chunks) != 1:
        raise checks.corrupt(path, "a 0-d tensor must have exactly one chunk", name)
    next_row = 0
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise checks.corrupt(path, "chunk is not an object", name)
        fname = checks.as_plain_name(chunk.get("file"), "chunk file", path)
        if fname not in files:
            raise checks.corrupt(path, f"chunk refers to file {fname!r} missing from 'files'", name)
        offset = checks.as_int(chunk.get("offset"), "chunk offset", path, name)
        length = checks.as_int(chunk.get("length"), "chunk length", path, name)
        if offset + length > files[fname]["size"]:
            raise checks.corrupt(path, f"chunk [{offset}, {offset + length}) lies beyond the "
                                 f"{files[fname]['size']}-byte file {fname!r}", name)
        if shape:
            rows = chunk.get("rows")
            if not isinstance(rows, list) or len(rows) != 2:
                raise checks.corrupt(path, f"chunk rows must be [start, stop], found {rows!r}", name)
            start = checks.as_int(rows[0], "chunk row start", path, name)
            stop = checks.as_int(rows[1], "chunk row stop", path, name, lo=start)
            if start != next_row:
                raise checks.corrupt(path, f"chunk rows start at {start}, expected {next_row}", name)
            next_row = stop
            chunk_shape = [stop - start] + shape[1:]
        else:
            if "rows" in chunk:
                raise checks.corrupt(path, "a 0-d tensor's chunk must not have rows", name)
            chunk_shape = []
        if checks.byte_size(chunk_shape, dtype.itemsize, path, name) != length:
            raise checks.corrupt(path, f"chunk length {length} does not match shape {chunk_shape} "
                                 f"of {dtype.name}", name)
        _validate_segments(chunk, length, path, name)
        spans.setdefault(fname, []).append((offset, offset + length, name))
    if shape and next_row != shape[0]:
        raise checks.corrupt(path, f"chunks cover {next_row} rows of {shape[0]}", name)


def _validate_segments(chunk: Dict[str, Any], length: int, path: str, name: str) -> None:
    crcs = checks.as_ints(chunk.get("crc32c"), "crc32c value", path, name, hi=0xFFFFFFFF)
    has_uniform, has_explicit = "segment_bytes" in chunk, "segments" in chunk
    if has_uniform == has_explicit:
        raise checks.corrupt(path, "chunk needs exactly one of segment_bytes and segments", name)
    if has_uniform:
        step = checks.as_int(chunk["segment_bytes"], "segment_bytes", path, name, lo=1)
        expected = max(1, -(-length // step))
    else:
        ends = checks.as_ints(chunk["segments"], "segment end", path, name, hi=length, increasing="strictly")
        if not ends:
            raise checks.corrupt(path, "segments must be a non-empty list", name)
        if length and ends[0] == 0:
            raise checks.corrupt(path, "segment ends must be strictly increasing from 0", name)
        if ends[-1] != length or (length == 0 and len(ends) != 1):
            raise checks.corrupt(path, f"segments end at {ends[-1]}, chunk length is {length}", name)
        expected = len(ends)
    if len(crcs) != expected:
        raise checks.corrupt(path, f"{len(crcs)} crc32c values for {expected} segments", name)
    buckets = chunk.get("buckets")
    if buckets is not None:
        _validate_buckets(buckets, chunk, path, name)


def _validate_buckets(buckets: Any, chunk: Dict[str, Any], path: str, name: str) -> None:
    if not isinstance(buckets, dict) or not isinstance(buckets.get("row_starts"), list):
        raise checks.corrupt(path, "chunk buckets must be {'first': int, 'row_starts': [...]}", name)
    checks.as_int(buckets.get("first"), "first bucket", path, name)
    rows = chunk.get("rows")
    nrows = rows[1] - rows[0] if rows else 0
    starts = checks.as_ints(buckets["row_starts"], "bucket row start", path, name, hi=nrows, increasing="weakly")
    if starts and starts[0] != 0:
        raise checks.corrupt(path, "bucket row_starts must begin at 0", name)
    if not starts or starts[-1] != nrows:
        raise checks.corrupt(path, f"bucket row_starts must end at the chunk's {nrows} rows", name)


def dumps(index: Dict[str, Any]) -> bytes:
    return json.dumps(index, separators=(",", ":"), sort_keys=False).encode()


def write(directory: str, index: Dict[str, Any], *, durable: Optional[bool] = None,
          storage: Optional[Storage] = None) -> str:
    """Writes `index` into `directory` atomically (temporary name + fsync + rename locally, one put
    on object stores). Returns its path."""
    storage = storage or get_storage(directory)
    path = storage.join(directory, INDEX_FILE)
    if durable is None:
        storage.write_atomic(path, dumps(index))
    else:
        with knobs.override(fsync=durable):
            storage.write_atomic(path, dumps(index))
    return path


def parse(data: bytes, path: str) -> Dict[str, Any]:
    """Parses and validates index bytes read from `path`."""
    try:
        index = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise checks.corrupt(path, f"index is not UTF-8 JSON ({exc})") from None
    return validate(index, path)


def read(directory: str, storage: Optional[Storage] = None) -> Dict[str, Any]:
    """Reads and validates `<directory>/index` (through `storage`, by default the one of
    `directory`), refusing one over the ``max_index_bytes`` knob before reading it."""
    storage = storage or get_storage(directory)
    path = storage.join(directory, INDEX_FILE)
    try:
        data = storage.read_bytes(path, knobs.get("max_index_bytes"))
    except CheckpointNotFoundError:
        raise _no_index(directory, path) from None
    return parse(data, path)


def _no_index(directory: str, path: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"{path} does not exist: {directory!r} is not a committed recsave checkpoint (no index); "
        f"check the path or pick a checkpoint listed in the output dir's 'checkpoint' file", path=path)
