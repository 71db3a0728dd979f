"""Reads tensors of a checkpoint: a plan of checksummed byte ranges per file, executed by the
storage's shard reader (on local disk the C++ engine's parallel positional reads straight into the
output tensors, elsewhere bounded ranged requests)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from recsave import knobs
from recsave.errors import CheckpointNotFoundError, ConfigError, IncompleteCheckpointError, UsageError
from recsave.format import checks, header
from recsave.format import index as index_mod
from recsave.format.records import Chunk, Index, TensorEntry
from recsave.storage import Storage, get_storage


@dataclass
class FileReads:
    """Byte ranges to read from one shard file into raw destination addresses: single ranges
    (`add`) and arrays of them (`add_array`, a whole chunk's segments at once)."""
    offsets: List[int] = field(default_factory=list)
    addresses: List[int] = field(default_factory=list)
    lengths: List[int] = field(default_factory=list)
    crcs: List[int] = field(default_factory=list)
    arrays: List[Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)

    def add(self, offset: int, address: int, length: int, crc: int) -> None:
        self.offsets.append(offset)
        self.addresses.append(address)
        self.lengths.append(length)
        self.crcs.append(crc)

    def add_array(self, offsets: np.ndarray, addresses: np.ndarray, lengths: np.ndarray, crcs: np.ndarray) -> None:
        """Ranges as uint64 offsets, addresses and lengths and uint32 CRCs of equal length."""
        self.arrays.append((offsets, addresses, lengths, crcs))

    def columns(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(offsets, addresses, lengths, crcs) of every range, as the shard reader takes them."""
        single = (np.asarray(self.offsets, dtype=np.uint64), np.asarray(self.addresses, dtype=np.uint64),
                  np.asarray(self.lengths, dtype=np.uint64), np.asarray(self.crcs, dtype=np.uint32))
        if not self.arrays:
            return single
        parts = [single, *self.arrays]
        return cast(Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                    tuple(np.concatenate([p[k] for p in parts]) for k in range(4)))

    @property
    def nbytes(self) -> int:
        return sum(self.lengths) + sum(int(a[2].sum()) for a in self.arrays)


def check_listed_file(ckpt_dir: str, fname: str, index: Index,
                      storage: Optional[Storage] = None) -> str:
    """Path of a file listed in the index, after checking it exists with exactly the recorded size
    (and, on local disk, is a regular file, not a symbolic link)."""
    checks.as_plain_name(fname, "file name", ckpt_dir)
    expected = index.files[fname].size
    storage = storage or get_storage(ckpt_dir)
    path = storage.join(ckpt_dir, fname)
    try:
        actual = storage.regular_file_size(path)
    except CheckpointNotFoundError:
        raise _missing(path) from None
    if actual is None:
        raise checks.corrupt(path, "listed file is not a regular file (symbolic links are refused)")
    if actual != expected:
        raise checks.corrupt(path, f"file is {actual} bytes, the index records {expected}")
    return path


def _missing(path: str) -> IncompleteCheckpointError:
    # Damage of a checkpoint that exists, not an absent one: its own class tells the two apart
    # (the command line exits 1 for it, 2 for "no such checkpoint").
    return IncompleteCheckpointError(f"{path}: file listed in the index is missing; the checkpoint is "
                                     f"incomplete — restore from another checkpoint", path=path)


def read_tensors(ckpt_dir: str, names: Optional[Iterable[str]] = None, *,
                 index: Optional[Index] = None, verify: bool = True,
                 concurrency: Optional[int] = None, storage: Optional[Storage] = None,
                 rows: Optional[Dict[str, List[tuple]]] = None,
                 stats: Optional[Dict[str, Any]] = None,
                 out: Optional[Dict[str, torch.Tensor]] = None,
                 checked: Optional[Dict[str, "CheckedHeader"]] = None) -> Dict[str, torch.Tensor]:
    """Reads the named tensors (all when `names` is None) of the checkpoint in `ckpt_dir`.

    Every segment read is checked against its CRC32C unless `verify` is False. `rows` optionally
    restricts a tensor to row ranges ``[(start, stop), ...]`` of its logical rows (concatenated in
    the given order); only the checksum segments covering them are read. `stats`, when given,
    receives ``bytes_read`` and, per tensor, ``tensors[name]`` (what `bytes_to_read` predicts). `out`
    gives destination tensors (contiguous CPU, exact dtype and shape of the result) to read into
    instead of allocating — e.g. a table's own storage. `checked`, shared by calls reading one
    checkpoint with the same `index`, keeps the files whose size and header were checked, so a
    later call reads neither again (on object stores a HEAD and two ranged GETs per file). Raises
    CheckpointNotFoundError (IncompleteCheckpointError for a file the index lists that is missing),
    CorruptCheckpointError (incl. FormatVersionError) or ConfigError for a
    name the checkpoint does not have.
    """
    storage = storage or get_storage(ckpt_dir)
    if index is None:
        index = index_mod.read(ckpt_dir, storage)
    wanted = list(index.tensors) if names is None else list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in index.tensors]
    if missing:
        raise ConfigError(f"{ckpt_dir}: the checkpoint has no tensor(s) {missing}; it has "
                          f"{sorted(index.tensors)[:20]}", path=ckpt_dir, key=missing[0])
    rows = rows or {}
    threads = concurrency or knobs.get("concurrency")
    given = out or {}
    out = {}
    scratch: List[torch.Tensor] = []  # segment-aligned buffers of partial reads, kept alive
    plans: Dict[str, FileReads] = {}
    copies: List[tuple] = []  # (dest tensor bytes view, dest offset, scratch view, scratch offset, n)
    for name in wanted:
        entry = index.tensors[name]
        dtype = entry.torch_dtype
        if name not in rows:
            out[name] = _destination(given.get(name), entry.shape, dtype, name)
            _plan_whole(name, entry, out[name], plans)
        else:
            out[name] = _plan_rows(name, entry, dtype, rows[name], plans, scratch, copies, ckpt_dir,
                                   given.get(name))
    total = 0
    for fname, reads in plans.items():
        known = None if checked is None else checked.get(fname)
        path = check_listed_file(ckpt_dir, fname, index, storage) if known is None else storage.join(ckpt_dir, fname)
        shard = storage.open_shard(path, index.files[fname].size)
        try:
            if known is None:
                raw = shard.read_header(knobs.get("max_header_bytes"))
                known = CheckedHeader(*header.parse(raw, shard.size, path))
                if checked is not None:
                    checked[fname] = known
            _check_header(known, path, fname, index, wanted)
            offsets, addresses, lengths, crcs = reads.columns()
            shard.read(offsets, addresses, lengths, crcs if verify else None, threads)
        finally:
            shard.close()
        total += reads.nbytes
    for dest, d_off, src, s_off, n in copies:
        dest[d_off:d_off + n] = src[s_off:s_off + n]
    if stats is not None:
        stats["bytes_read"] = stats.get("bytes_read", 0) + total
        per = stats.setdefault("tensors", {})
        for name in wanted:
            per[name] = per.get(name, 0) + bytes_to_read(index, name, rows.get(name))
    return out


@dataclass(frozen=True)
class _Covering:
    """The checksum segments of one chunk that cover rows of one wanted range: their begins and ends
    (uint64, bytes relative to the chunk) and CRC32Cs, the wanted bytes [want_b, want_e) of the
    chunk, and the output byte offset where want_b lands."""
    chunk: Chunk
    begins: np.ndarray
    ends: np.ndarray
    crcs: np.ndarray
    want_b: int
    want_e: int
    dest_off: int


def _coverings(entry: TensorEntry, ranges: List[tuple], row_bytes: int) -> Iterator[_Covering]:
    """A _Covering for each row range and each chunk it touches, in output order. The covering
    segments are found by bisection: a chunk holds thousands of bucket segments, a reader of
    another world size wants a slice of them."""
    dest_row = 0
    for start, stop in ranges:
        for chunk in entry.chunks:
            c0, c1 = chunk.rows or (0, 0)
            lo, hi = max(start, c0), min(stop, c1)
            if lo >= hi:
                continue
            want_b, want_e = (lo - c0) * row_bytes, (hi - c0) * row_bytes
            begins, ends, crcs = chunk.segment_arrays()
            first = int(np.searchsorted(ends, want_b, side="right"))  # the first segment ending past want_b
            stop_at = int(np.searchsorted(begins, want_e, side="left"))  # the first beginning at want_e or later
            yield _Covering(chunk, begins[first:stop_at], ends[first:stop_at], crcs[first:stop_at], want_b, want_e,
                            (dest_row + lo - start) * row_bytes)
        dest_row += stop - start


def _plan_whole(name: str, entry: TensorEntry, out: torch.Tensor, plans: Dict[str, FileReads]) -> None:
    row_bytes = _row_bytes(out)
    for chunk in entry.chunks:
        dest = out.data_ptr() + chunk.first_row * row_bytes
        begins, ends, crcs = chunk.segment_arrays()
        plans.setdefault(chunk.file, FileReads()).add_array(
            begins + np.uint64(chunk.offset), begins + np.uint64(dest), ends - begins, crcs)


def _destination(given: Optional[torch.Tensor], shape: Sequence[int], dtype: torch.dtype, name: str) -> torch.Tensor:
    if given is None:
        return torch.empty(shape, dtype=dtype)
    if (given.dtype != dtype or list(given.shape) != list(shape) or given.device.type != "cpu"
            or not given.is_contiguous()):
        raise UsageError(f"destination for {name!r} must be a contiguous CPU {dtype} tensor of shape "
                         f"{list(shape)}, got {given.dtype} {list(given.shape)} on {given.device}", key=name)
    return given


def _plan_rows(name: str, entry: TensorEntry, dtype: torch.dtype, ranges: List[tuple],
               plans: Dict[str, FileReads], scratch: List[torch.Tensor], copies: List[tuple],
               ckpt_dir: str, given: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plans reading only `ranges` of rows. Whole segments are read (they carry the checksums); a
    segment that also holds rows outside the range goes to a scratch buffer and is copied after."""
    shape = entry.shape
    if not shape:
        raise ConfigError(f"{ckpt_dir}: tensor {name!r} is 0-d; it has no rows to select", key=name)
    for start, stop in ranges:
        if not 0 <= start <= stop <= shape[0]:
            raise ConfigError(f"{ckpt_dir}: rows [{start}, {stop}) of {name!r} are outside its "
                              f"{shape[0]} rows", key=name)
    total_rows = sum(stop - start for start, stop in ranges)
    out = _destination(given, [total_rows, *shape[1:]], dtype, name)
    row_bytes = _row_bytes(out) if total_rows else 0
    if row_bytes == 0:
        return out
    out_bytes = out.reshape(-1).view(torch.uint8)
    for cov in _coverings(entry, ranges, row_bytes):
        reads = plans.setdefault(cov.chunk.file, FileReads())
        inside = (cov.begins >= cov.want_b) & (cov.ends <= cov.want_e)  # wanted whole: read in place
        begins, ends = cov.begins[inside], cov.ends[inside]
        if len(begins):
            reads.add_array(begins + np.uint64(cov.chunk.offset),
                            (begins - np.uint64(cov.want_b)) + np.uint64(out.data_ptr() + cov.dest_off),
                            ends - begins, cov.crcs[inside])
        for k in np.flatnonzero(~inside).tolist():  # at most the two at the range's ends
            b, e, crc = int(cov.begins[k]), int(cov.ends[k]), int(cov.crcs[k])
            buf = torch.empty(e - b, dtype=torch.uint8)
            scratch.append(buf)
            reads.add(cov.chunk.offset + b, buf.data_ptr(), e - b, crc)
            s, t = max(b, cov.want_b), min(e, cov.want_e)
            copies.append((out_bytes, cov.dest_off + s - cov.want_b, buf, s - b, t - s))
    return out


def bytes_to_read(index: Index, name: str, ranges: Optional[List[tuple]] = None) -> int:
    """Bytes read_tensors fetches for `name` (whole, or the segments covering row `ranges`) — what a
    dry-run plan reports without reading anything."""
    entry = index.tensors[name]
    if ranges is None:
        return entry.nbytes
    shape = entry.shape
    row_bytes = entry.dtype_info.itemsize
    for d in shape[1:]:
        row_bytes *= d
    if not shape or row_bytes == 0:
        return 0
    return sum(int((cov.ends - cov.begins).sum()) for cov in _coverings(entry, ranges, row_bytes))


def _row_bytes(t: torch.Tensor) -> int:
    if t.dim() == 0:
        return 0
    n = t.element_size()
    for d in t.shape[1:]:
        n *= d
    return n


@dataclass(frozen=True)
class CheckedHeader:
    """A shard file's parsed header (its size checked against the index)."""
    data_start: int
    entries: Dict[str, header.HeaderEntry]


def check_shard_header(ckpt_dir: str, fname: str, index: Index, storage: Storage) -> str:
    """Parses shard file `fname`'s own header and checks it against the index for every tensor the
    index places in it, as a read does (CorruptCheckpointError otherwise): what `verify` checks
    beyond the data's checksums. Returns the file's path (its listing checked)."""
    path = check_listed_file(ckpt_dir, fname, index, storage)
    shard = storage.open_shard(path, index.files[fname].size)
    try:
        known = CheckedHeader(*header.parse(shard.read_header(knobs.get("max_header_bytes")), shard.size, path))
    finally:
        shard.close()
    inside = [n for n, e in index.tensors.items() if any(c.file == fname for c in e.chunks)]
    _check_header(known, path, fname, index, inside)
    return path


def _check_header(known: CheckedHeader, path: str, fname: str, index: Index, wanted: List[str]) -> None:
    """The shard's own header must agree with the index for every chunk we read from it."""
    data_start, entries = known.data_start, known.entries
    for name in wanted:
        entry = index.tensors[name]
        for chunk in entry.chunks:
            if chunk.file == fname:
                _check_against_header(chunk, entries.get(name), data_start, entry.dtype, entry.shape,
                                      path, name)


def _check_against_header(chunk: Chunk, entry: Optional[header.HeaderEntry], data_start: int,
                          dtype_name: str, shape: Sequence[int], path: str, name: str) -> None:
    if entry is None:
        raise checks.corrupt(path, "the index places this tensor in the file but its header lacks it", name)
    chunk_shape = [chunk.rows[1] - chunk.rows[0], *shape[1:]] if chunk.rows is not None else []
    stored_shape = [chunk.length] if entry.dtype.st_code is None else chunk_shape
    if (data_start + entry.begin != chunk.offset or entry.end - entry.begin != chunk.length
            or entry.dtype.name != dtype_name or list(entry.shape) != stored_shape):
        raise checks.corrupt(path, f"index entry (offset {chunk.offset}, length {chunk.length}, "
                             f"{dtype_name}, shape {stored_shape}) disagrees with the file header (offset "
                             f"{data_start + entry.begin}, length {entry.end - entry.begin}, "
                             f"{entry.dtype.name}, shape {list(entry.shape)})", name)
