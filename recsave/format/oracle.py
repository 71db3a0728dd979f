"""An independent, pure-Python reader of the recsave checkpoint format (docs/FORMAT.md: format_version
1, full checkpoints, 2, delta and serving checkpoints, 3, any kind with shared bucket ranges, and 4,
version 3 with segments given by the bucket rule).

This module is the test oracle: it was written from the specification only and shares no code with
recsave's own writer and reader (``recsave.format.*``, ``recsave._C``). It is slow and simple on
purpose; every MUST of the spec that concerns reading tensors is enforced here, so that a disagreement
with the engine-backed reader points at a bug in one of the two. Its CRC32C is the numpy one in
``recsave.format.pycrc32c`` (used by nothing else); it imports only recsave's own dependencies.

Every size, offset and count read from disk is validated before it is used to allocate or seek, and
no exception other than the ones in :mod:`recsave.errors` escapes for any file content.

Its job is one checkpoint directory's tensors. Of a delta (section 10) it reads the delta's own
tensors as stored: the changed rows, ``<table>@tombstone`` and the rest, after checking `kind`,
`parent`, `base` and the tables' `cleared` / `tombstones`; it does not merge a chain into the
state a load restores (:func:`check_parent` checks one link: the parent's index CRC32C). Of an
int8 serving table (section 8) it returns the codes, ``@scale`` and ``@offset`` as plain tensors;
:func:`dequantize_int8` applies the spec's formula to them.
"""
from __future__ import annotations

import base64
import binascii
import errno
import os
import re
import stat
import struct
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from recsave.errors import (
    CheckpointNotFoundError,
    ConfigError,
    FormatVersionError,
    IncompleteCheckpointError,
    OverLimitError,
    StorageError,
)
from recsave.format.oracle_checks import (
    CODE_ITEMSIZE,
    DTYPE_TABLE,
    FORMAT_VERSION,
    INDEX_MAGIC,
    INDEX_VERSIONS,
    MAX_HEADER_BYTES,
    MAX_INDEX_BYTES,
    RULE_VERSION,
    SHARED_RANGES_VERSION,
    as_int,
    as_obj,
    as_shape,
    check_kind,
    check_kind_tensors,
    corrupt,
    dequantize_int8,
    is_int,
    parse_json,
    plain_name,
)
from recsave.format.pycrc32c import crc32c

__all__ = ["read_index", "read_tensors", "read_shard_header", "dequantize_int8", "check_parent"]

def _segment_ends(chunk: dict, length: int, path: str, key: str) -> List[int]:
    """Returns the end offsets of the chunk's checksum segments (section 3)."""
    if ("segment_bytes" in chunk) == ("segments" in chunk):
        raise corrupt(path, "a chunk must have exactly one of segment_bytes and segments", key)
    if "segment_bytes" in chunk:
        s = as_int(chunk["segment_bytes"], "segment_bytes", path, key, lo=1)
        count = max(1, -(-length // s))  # computed before building the list: it is bounded by the crc list
        if count != len(chunk["crc32c"]):
            raise corrupt(path, f"{count} segments of {s} bytes but {len(chunk['crc32c'])} crc32c values", key)
        return [min(length, (i + 1) * s) for i in range(count)]
    ends = chunk["segments"]
    if not isinstance(ends, list) or not ends or len(ends) != len(chunk["crc32c"]):
        raise corrupt(path, "segments must be a non-empty list as long as the crc32c list", key)
    prev = -1 if length == 0 else 0  # a zero-length chunk has the single segment [0]
    for e in ends:
        if not is_int(e) or e <= prev:
            raise corrupt(path, f"segments {ends!r:.80} are not increasing integers", key)
        prev = e
    if prev != length:
        raise corrupt(path, f"the last segment ends at {prev}, not at the chunk length {length}", key)
    return list(ends)


def _rule_ends(rule: Any, row_starts: List[int], row_bytes: int, crcs: int, path: str, key: str) -> List[int]:
    """The segment ends of a version 4 chunk's `bucket_segments` {"step", "min"} (section 3), walked
    as the spec words it: a segment closes at a bucket boundary once it holds `min` bytes (or at
    the chunk's end), and inside a stretch longer than `step` every `step` bytes. Stops with an
    error as soon as there are more ends than the chunk's `crcs` CRC values."""
    rule = as_obj(rule, "bucket_segments", path, key)
    if sorted(rule) != ["min", "step"]:
        raise corrupt(path, f"bucket_segments must have exactly 'step' and 'min', got {sorted(rule)!r:.80}", key)
    step = as_int(rule["step"], "bucket_segments.step", path, key, lo=1)
    least = as_int(rule["min"], "bucket_segments.min", path, key)
    length = row_starts[-1] * row_bytes
    if length == 0:
        ends = [0]
    else:
        ends, last = [], 0
        for boundary in (r * row_bytes for r in row_starts[1:]):
            while boundary - last > step or (boundary > last and (boundary - last >= least or boundary == length)):
                last = last + step if boundary - last > step else boundary
                ends.append(last)
                if len(ends) > crcs:
                    raise corrupt(path, f"bucket_segments give more segments than the {crcs} crc32c values", key)
        if ends[-1:] != [length]:
            ends.append(length)
    if len(ends) != crcs:
        raise corrupt(path, f"bucket_segments give {len(ends)} segments but there are {crcs} crc32c values", key)
    return ends


def _bucket_ranges(idx: dict, path: str) -> Optional[List[Any]]:
    """The `bucket_ranges` list of a version 3 or 4 index (each entry checked: an int `first` and
    `row_starts` of ints rising from 0); None for versions 1 and 2, whose chunks hold their own."""
    if idx["format_version"] not in (SHARED_RANGES_VERSION, RULE_VERSION):
        return None
    ranges = idx.get("bucket_ranges")
    if not isinstance(ranges, list):
        raise corrupt(path, f"a version {idx['format_version']} index must have a bucket_ranges list")
    for i, b in enumerate(ranges):
        b = as_obj(b, f"bucket_ranges[{i}]", path)
        as_int(b.get("first"), f"bucket_ranges[{i}].first", path)
        rs = b.get("row_starts")
        if (not isinstance(rs, list) or not rs or not all(map(is_int, rs)) or rs[0] != 0
                or any(x > y for x, y in zip(rs, rs[1:]))):
            raise corrupt(path, f"bucket_ranges[{i}].row_starts {rs!r:.80} must rise from 0")
    return ranges


def _chunk_crcs(crcs: Any, i: int, packed: bool, path: str, name: str) -> List[int]:
    """A chunk's CRC32C values: a list of 32-bit unsigned integers (versions 1, 2), or (version 3)
    padded base64 text of their little-endian 4-byte forms, one after another."""
    if not packed:
        if not isinstance(crcs, list) or not all(is_int(x) and 0 <= x < 1 << 32 for x in crcs):
            raise corrupt(path, f"chunk {i} crc32c must be a list of 32-bit unsigned integers", name)
        return crcs
    try:
        raw = base64.b64decode(crcs, validate=True) if isinstance(crcs, str) else None
    except binascii.Error:
        raw = None
    if raw is None or len(raw) % 4:
        raise corrupt(path, f"chunk {i} crc32c {crcs!r:.80} is not base64 of 4-byte little-endian values", name)
    return [int.from_bytes(raw[k:k + 4], "little") for k in range(0, len(raw), 4)]


def _chunk_row_starts(c: dict, i: int, shared: Optional[List[Any]], path: str, name: str) -> Any:
    """A chunk's bucket row starts: its own `buckets` object (versions 1, 2), or the entry of
    `bucket_ranges` its `buckets` integer names (versions 3, 4)."""
    if shared is None:
        b = as_obj(c["buckets"], f"chunk {i} buckets", path, name)
        as_int(b.get("first"), "buckets.first", path, name)
        return b.get("row_starts")
    ref = c["buckets"]
    if not is_int(ref) or not 0 <= ref < len(shared):
        raise corrupt(path, f"chunk {i} buckets {ref!r:.80} is not a position in bucket_ranges", name)
    return shared[ref]["row_starts"]


def _check_chunks(name: str, t: dict, itemsize: int, files: dict, world: dict, shared: Optional[List[Any]],
                  rules: bool, path: str) -> None:
    shape, _ = as_shape(t.get("shape"), "logical", path, name, itemsize)
    chunks = t.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise corrupt(path, "chunks must be a non-empty list", name)
    if not shape and len(chunks) != 1:
        raise corrupt(path, "a 0-d tensor must have exactly one chunk", name)
    row_bytes = itemsize
    for d in shape[1:]:
        row_bytes *= d
    next_row, seen_files = 0, set()
    for i, c in enumerate(chunks):
        c = as_obj(c, f"chunk {i}", path, name)
        extra = set(c) - {"file", "offset", "length", "rows", "crc32c", "segment_bytes", "segments",
                          "bucket_segments", "buckets"}
        if extra:
            raise corrupt(path, f"chunk {i} has unknown keys {sorted(extra)!r:.120}", name)
        fname = c.get("file")
        if not isinstance(fname, str) or fname not in files:
            raise corrupt(path, f"chunk {i} refers to file {fname!r:.120}, which is not in 'files'", name)
        if fname in seen_files:  # the shard header stores a chunk under the tensor name: one per file
            raise corrupt(path, f"two chunks in file {fname!r}", name)
        seen_files.add(fname)
        if shape:
            rows = c.get("rows")
            if (not isinstance(rows, list) or len(rows) != 2 or not all(map(is_int, rows))
                    or rows[0] != next_row or not rows[0] <= rows[1] <= shape[0]):
                raise corrupt(path, f"chunk {i} rows {rows!r:.80} do not continue at row {next_row}", name)
            next_row, nrows = rows[1], rows[1] - rows[0]
        elif "rows" in c:
            raise corrupt(path, "the chunk of a 0-d tensor must not have rows", name)
        else:
            nrows = 1
        length = as_int(c.get("length"), f"chunk {i} length", path, name)
        if length != nrows * row_bytes:
            raise corrupt(path, f"chunk {i} length {length} != {nrows * row_bytes} (chunk shape x itemsize)", name)
        offset = as_int(c.get("offset"), f"chunk {i} offset", path, name)
        if offset + length > files[fname]["size"]:
            raise corrupt(path, f"chunk {i} at offset {offset} length {length} ends beyond file {fname!r} "
                                 f"of size {files[fname]['size']}", name)
        c["crc32c"] = _chunk_crcs(c.get("crc32c"), i, shared is not None, path, name)  # version 3: decoded
        rs = None
        if "buckets" in c:
            rs = _chunk_row_starts(c, i, shared, path, name)
            if (not shape or not isinstance(rs, list) or len(rs) < 1 or not all(map(is_int, rs))
                    or rs[0] != 0 or rs[-1] != nrows or any(x > y for x, y in zip(rs, rs[1:]))):
                raise corrupt(path, f"chunk {i} buckets.row_starts {rs!r:.80} must rise from 0 to {nrows}", name)
        if "bucket_segments" in c:  # version 4: listed here as the explicit ends they stand for
            if not rules or rs is None or "segment_bytes" in c or "segments" in c:
                raise corrupt(path, f"chunk {i} bucket_segments needs format_version {RULE_VERSION}, the chunk's "
                                    f"buckets, and no segment_bytes or segments", name)
            c["segments"] = _rule_ends(c.pop("bucket_segments"), rs, row_bytes, len(c["crc32c"]), path, name)
        _segment_ends(c, length, path, name)
        world.setdefault(fname, []).append((offset, offset + length, name))
    if shape and next_row != shape[0]:
        raise corrupt(path, f"chunk rows stop at {next_row}, not at shape[0] = {shape[0]}", name)


def _index_bytes(path: str, what: str, missing: str) -> bytes:
    with _open_regular(path, what, missing) as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_INDEX_BYTES:  # size limit first: never read a huge file into memory
            raise OverLimitError(f"{path}: {what} is {size} bytes, over the 256 MiB limit (MAX_INDEX_BYTES)",
                                 path=path)
        raw = _read(f, MAX_INDEX_BYTES + 1, path)
    if len(raw) > MAX_INDEX_BYTES:
        raise corrupt(path, f"{what} grew past the size limit while being read")
    return raw


_SEAL_TAIL = re.compile(rb',"index_crc32c":(0|[1-9][0-9]{0,9})}\Z')


def _check_seal(raw: bytes, idx: dict, path: str) -> None:
    """Section 3, "The seal": when the index has `index_crc32c`, it is the last key, written as
    ``,"index_crc32c":N}`` at the very end, and N is the CRC32C of the bytes before that text."""
    if "index_crc32c" not in idx:
        return
    value = idx["index_crc32c"]
    if not is_int(value) or not 0 <= value < 1 << 32:
        raise corrupt(path, f"index_crc32c must be an integer in [0, 2^32), found {value!r:.80}")
    tail = _SEAL_TAIL.search(raw[-40:])
    if tail is None or int(tail.group(1)) != value:
        raise corrupt(path, "index_crc32c is not the last key of the index, written without spaces")
    body = raw[:len(raw) - (tail.end() - tail.start())]
    if crc32c(body) != value:
        raise corrupt(path, f"the index's bytes have CRC32C {crc32c(body)}, but it records {value}")


def read_index(ckpt_dir: str) -> dict:
    """Loads ``<ckpt_dir>/index`` and validates it against FORMAT.md section 3; returns the parsed JSON
    (a version 3 or 4 chunk's packed `crc32c` decoded into the list versions 1 and 2 hold, and a
    version 4 chunk's `bucket_segments` into the `segments` ends it stands for)."""
    path = os.path.join(ckpt_dir, "index")
    raw = _index_bytes(path, "the index", f"no index: {ckpt_dir} is not a committed checkpoint")
    idx = as_obj(parse_json(raw, "the index", path), "the index", path)
    _check_seal(raw, idx, path)
    if idx.get("magic") != INDEX_MAGIC:
        raise corrupt(path, f"magic is {idx.get('magic')!r:.80}, not {INDEX_MAGIC!r}: not a recsave index")
    if "format_version" not in idx:
        raise corrupt(path, "the index has no format_version")
    version = idx["format_version"]
    if is_int(version) and version < min(INDEX_VERSIONS):
        raise corrupt(path, f"format_version {version} is below every version a writer uses: damage")
    if not is_int(version) or version not in INDEX_VERSIONS:
        raise FormatVersionError(f"{path}: unknown format_version {version!r:.80} (this reader knows versions "
                                 f"{INDEX_VERSIONS}); upgrade recsave to read it", path=path)
    kind = check_kind(idx, path)
    for k in ("recsave_version", "created_at"):
        if not isinstance(idx.get(k), str):
            raise corrupt(path, f"{k} must be a string")
    if not idx["created_at"].endswith("Z"):
        raise corrupt(path, f"created_at {idx['created_at']!r:.80} is not a UTC ISO-8601 time ending in Z")
    if idx.get("step") is not None:
        as_int(idx["step"], "step", path, lo=-(1 << 63), hi=1 << 63)
    as_int(idx.get("world_size"), "world_size", path, lo=1, hi=1 << 31)
    if idx.get("partition") is not None:
        p = as_obj(idx["partition"], "partition", path)
        if p.get("scheme") != "mix64":
            raise corrupt(path, f"unknown partition scheme {p.get('scheme')!r:.80}")
        as_int(p.get("num_buckets"), "partition.num_buckets", path, lo=1)
    as_obj(idx.get("meta"), "meta", path)
    files = as_obj(idx.get("files"), "files", path)
    for fname, entry in files.items():
        plain_name(fname, path)
        entry = as_obj(entry, f"file entry {fname!r}", path)
        if set(entry) - {"size", "rank", "crc32c"}:
            raise corrupt(path, f"file entry {fname!r} has unknown keys "
                                f"{sorted(set(entry) - {'size', 'rank', 'crc32c'})!r:.120}")
        as_int(entry.get("size"), f"size of file {fname!r}", path)
        as_int(entry.get("rank"), f"rank of file {fname!r}", path, hi=idx["world_size"])
        if "crc32c" in entry:
            as_int(entry["crc32c"], f"crc32c of file {fname!r}", path, hi=1 << 32)
    world: Dict[str, List[Tuple[int, int, str]]] = {}
    shared = _bucket_ranges(idx, path)
    for name, t in as_obj(idx.get("tensors"), "tensors", path).items():
        t = as_obj(t, "tensor entry", path, name)
        if name == "__metadata__":  # cannot be stored in a safetensors header
            raise corrupt(path, "'__metadata__' is not a valid tensor name", name)
        if not isinstance(t.get("dtype"), str) or t["dtype"] not in DTYPE_TABLE:
            raise corrupt(path, f"unknown dtype {t.get('dtype')!r:.80}", name)
        _check_chunks(name, t, DTYPE_TABLE[t["dtype"]][0], files, world, shared, version == RULE_VERSION, path)
    for fname, ranges in world.items():  # chunk ranges of one file must not overlap (empty ones cannot)
        ranges = sorted(r for r in ranges if r[1] > r[0])
        for (b0, e0, n0), (b1, _, n1) in zip(ranges, ranges[1:]):
            if b1 < e0:
                raise corrupt(path, f"chunks of {n0!r} [{b0}, {e0}) and {n1!r} (at {b1}) overlap in file "
                                     f"{fname!r}")
    check_kind_tensors(idx, kind, path)
    return idx


def _read_exact(f: Any, n: int, path: str, what: str) -> bytes:
    data = _read(f, n, path)
    if len(data) != n:
        raise corrupt(path, f"file truncated: {what} wants {n} bytes, got {len(data)}")
    return data


def _parse_header(f: Any, size: int, path: str) -> Tuple[dict, int, dict]:
    """Reads and validates the safetensors header (section 2); returns it, the data buffer start and the
    ``recsave.dtypes`` map (tensor name -> torch dtype name of entries stored as U8)."""
    if size < 8:
        raise corrupt(path, f"the file is {size} bytes, too short for the 8-byte header length")
    f.seek(0)
    (n,) = struct.unpack("<Q", _read_exact(f, 8, path, "the header length"))
    if n > MAX_HEADER_BYTES:
        raise corrupt(path, f"header length {n} exceeds the 100 MiB limit (MAX_HEADER_BYTES)")
    if 8 + n > size:
        raise corrupt(path, f"header length {n} runs past the end of the {size} byte file")
    header = as_obj(parse_json(_read_exact(f, n, path, "the header"), "the header", path), "the header", path)
    data_size = size - 8 - n
    meta = as_obj(header.get("__metadata__", {}), "header __metadata__", path)
    if not all(isinstance(v, str) for v in meta.values()):
        raise corrupt(path, "header __metadata__ values must be strings")
    if meta.get("format") == "recsave.shard" and meta.get("format_version", "1") != str(FORMAT_VERSION):
        raise FormatVersionError(f"{path}: unknown shard format_version {meta['format_version']!r:.80}; "
                                 f"upgrade recsave", path=path)
    extra = as_obj(parse_json(meta.get("recsave.dtypes", "{}").encode("utf-8", "surrogatepass"),
                             "header recsave.dtypes", path), "header recsave.dtypes", path)
    ranges = []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        e = as_obj(e, "header entry", path, name)
        if set(e) - {"dtype", "shape", "data_offsets"}:
            raise corrupt(path, "header entry has keys other than dtype, shape and data_offsets", name)
        code = e.get("dtype")
        if not isinstance(code, str) or code not in CODE_ITEMSIZE:
            raise corrupt(path, f"header has unknown dtype code {code!r:.80}", name)
        _, nbytes = as_shape(e.get("shape"), "header", path, name, CODE_ITEMSIZE[code])
        offs = e.get("data_offsets")
        if not isinstance(offs, list) or len(offs) != 2 or not all(map(is_int, offs)) \
                or not 0 <= offs[0] <= offs[1] <= data_size:
            raise corrupt(path, f"data_offsets {offs!r:.80} out of range of the {data_size} byte data buffer", name)
        if offs[1] - offs[0] != nbytes:
            raise corrupt(path, f"data_offsets length {offs[1] - offs[0]} != shape {e['shape']!r:.80} x "
                                 f"itemsize {CODE_ITEMSIZE[code]}", name)
        if offs[1] > offs[0]:
            ranges.append((offs[0], offs[1], name))
    ranges.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise corrupt(path, f"header entries {n0!r:.80} and {n1!r:.80} overlap (data_offsets {b0}-{e0} "
                                 f"and {b1}-)")
    for name, dt in extra.items():  # entries were validated above; "__metadata__" is not one
        e = header.get(name) if name != "__metadata__" else None
        if (e is None or e["dtype"] != "U8" or len(e["shape"]) != 1 or not isinstance(dt, str)
                or dt not in DTYPE_TABLE or e["shape"][0] % DTYPE_TABLE[dt][0]):
            raise corrupt(path, f"recsave.dtypes maps it to {dt!r:.80} but it is not a matching U8 [nbytes] "
                                 f"entry", name)
    return header, 8 + n, extra


def read_shard_header(path: str) -> dict:
    """Returns the parsed and validated safetensors header of the shard file at ``path``."""
    with _open_regular(path, "the shard file", "no such shard file") as f:
        return _parse_header(f, os.fstat(f.fileno()).st_size, path)[0]


def _open_regular(path: str, what: str, missing: str, nofollow: bool = False,
                  missing_error: type = CheckpointNotFoundError) -> Any:
    """Opens a regular file for reading (a missing one is `missing_error`). Refuses directories,
    FIFOs and devices, which could block or never end, and with ``nofollow`` symbolic links."""
    try:
        st = os.lstat(path) if nofollow else os.stat(path)
        if stat.S_ISLNK(st.st_mode):
            raise corrupt(path, f"{what} is a symbolic link; refusing to follow it")
        if not stat.S_ISREG(st.st_mode):
            raise corrupt(path, f"{what} is not a regular file")
        # O_NOFOLLOW / O_NONBLOCK: a symlink or FIFO swapped in after the stat fails instead of being
        # followed or blocking.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (getattr(os, "O_NOFOLLOW", 0) * nofollow))
    except FileNotFoundError:
        raise missing_error(f"{path}: {missing}", path=path) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise corrupt(path, f"{what} is a symbolic link; refusing to follow it") from None
        raise StorageError(f"{path}: cannot open {what}: {e.strerror}", path=path, errno=e.errno) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise corrupt(path, f"{what} is not a regular file")
    return os.fdopen(fd, "rb")


def _read(f: Any, n: int, path: str) -> bytes:
    try:
        return f.read(n)
    except OSError as e:
        raise StorageError(f"{path}: read failed: {e.strerror}", path=path, errno=e.errno) from None


def _open_listed(ckpt_dir: str, fname: str, size: int) -> Any:
    """Opens a file named in the index, refusing symlinks and files whose size is not the indexed one."""
    path = os.path.join(ckpt_dir, fname)
    # A file the index lists that is gone is damage of a checkpoint that exists (docs/API.md, errors)
    f = _open_regular(path, f"listed file {fname!r}", f"file {fname!r} listed in the index does not exist",
                      nofollow=True, missing_error=IncompleteCheckpointError)
    actual = os.fstat(f.fileno()).st_size
    if actual != size:
        f.close()
        raise corrupt(path, f"listed file {fname!r} has size {actual} bytes, but the index says size {size}")
    return f


def _dtype_agrees(hentry: dict, dtype: str, hmeta: dict, key: str) -> bool:
    code = DTYPE_TABLE[dtype][1]
    if code is not None:
        return hentry["dtype"] == code and key not in hmeta
    return hentry["dtype"] == "U8" and hmeta.get(key) == dtype


def read_tensors(ckpt_dir: str, names: Optional[Iterable[str]] = None, *,
                 verify: bool = True) -> Dict[str, torch.Tensor]:
    """Reads tensors of the checkpoint in ``ckpt_dir`` (all of them when ``names`` is None).

    Returns CPU tensors with the index's dtype and logical shape. With ``verify`` the CRC32C of every
    segment read is checked (the spec requires it; ``verify=False`` exists only for tests/tools).
    """
    idx = read_index(ckpt_dir)
    ipath = os.path.join(ckpt_dir, "index")
    tensors = idx["tensors"]
    wanted = list(tensors) if names is None else [names] if isinstance(names, str) else list(names)
    for n in wanted:
        if n not in tensors:
            raise ConfigError(f"tensor {n!r} is not in the checkpoint {ipath}", path=ipath, key=n)
    handles: Dict[str, Tuple[Any, dict, dict, int]] = {}
    out: Dict[str, torch.Tensor] = {}
    try:
        for name in wanted:
            t = tensors[name]
            shape = t["shape"]
            # Lengths were checked against the index sizes, and the files against the real sizes below,
            # so this allocation is bounded by bytes actually on disk.
            buf = torch.empty(sum(c["length"] for c in t["chunks"]), dtype=torch.uint8)
            view, pos = memoryview(buf.numpy()), 0  # type: ignore[arg-type]  # numpy arrays are buffers
            for i, c in enumerate(t["chunks"]):
                fname, offset, length = c["file"], c["offset"], c["length"]
                fpath = os.path.join(ckpt_dir, fname)
                if fname not in handles:
                    f = _open_listed(ckpt_dir, fname, idx["files"][fname]["size"])
                    handles[fname] = (f, {}, {}, 0)
                    fentry = idx["files"][fname]
                    if verify and "crc32c" in fentry:  # SHOULD: whole-file checksum of files that carry one
                        whole = crc32c(_read_exact(f, fentry["size"], fpath, "the file"))
                        if whole != fentry["crc32c"]:
                            raise corrupt(fpath, f"crc32c of file {fname!r} is {whole:#010x}, index says "
                                                  f"{fentry['crc32c']:#010x}")
                    header, data_start, hmeta = _parse_header(f, fentry["size"], fpath)
                    handles[fname] = (f, header, hmeta, data_start)
                f, header, hmeta, data_start = handles[fname]
                h = header.get(name) if name != "__metadata__" else None
                if h is None:
                    raise corrupt(fpath, f"chunk {i} is not in the shard header", name)
                chunk_shape = ([c["rows"][1] - c["rows"][0]] + shape[1:]) if shape else []
                want_shape = [length] if DTYPE_TABLE[t["dtype"]][1] is None else chunk_shape
                if (data_start + h["data_offsets"][0] != offset or h["data_offsets"][1] - h["data_offsets"][0]
                        != length or not _dtype_agrees(h, t["dtype"], hmeta, name) or h["shape"] != want_shape):
                    raise corrupt(fpath, f"chunk {i} (offset {offset}, length {length}, dtype {t['dtype']}) "
                                          f"disagrees with the shard header entry {h!r:.200}", name)
                f.seek(offset)
                try:
                    got = f.readinto(view[pos:pos + length]) if length else 0
                except OSError as e:
                    raise StorageError(f"{fpath}: read failed: {e.strerror}", path=fpath, errno=e.errno) from None
                if got != length:
                    raise corrupt(fpath, f"chunk {i} truncated: read {got} of {length} bytes", name)
                if verify:
                    start = 0
                    for s, (end, crc) in enumerate(zip(_segment_ends(c, length, ipath, name), c["crc32c"])):
                        actual = crc32c(bytes(view[pos + start:pos + end]))
                        if actual != crc:
                            raise corrupt(fpath, f"crc32c mismatch in chunk {i} segment {s} (bytes {start}-{end}): "
                                                  f"computed {actual:#010x}, index says {crc:#010x}", name)
                        start = end
                pos += length
            del view
            out[name] = buf.view(getattr(torch, t["dtype"])).reshape(shape)
    finally:
        for f, *_ in handles.values():
            f.close()
    return out


def check_parent(ckpt_dir: str) -> Optional[str]:
    """For a delta, checks that its parent ``<output_dir>/<parent.id>/index`` exists with the CRC32C
    the delta recorded (section 10) and returns the parent's directory; None for other kinds. Only
    this one link is checked: following the chain is the caller's loop."""
    idx = read_index(ckpt_dir)
    if idx.get("kind", "full") != "delta":
        return None
    parent = os.path.join(os.path.dirname(os.path.normpath(ckpt_dir)), idx["parent"]["id"])
    path = os.path.join(parent, "index")
    raw = _index_bytes(path, "the parent's index", f"the parent of delta {ckpt_dir} is missing")
    if crc32c(raw) != idx["parent"]["crc32c"]:
        raise corrupt(path, f"the parent's index has crc32c {crc32c(raw):#010x}, but delta {ckpt_dir} recorded "
                            f"{idx['parent']['crc32c']:#010x}: the parent was rewritten or damaged")
    return parent
