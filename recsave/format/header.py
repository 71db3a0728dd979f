"""The safetensors-layout header of a shard file (docs/FORMAT.md section 2): build and validate."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from recsave.format import checks
from recsave.format.dtypes import BY_CODE, BY_NAME, DType

SHARD_FORMAT = "recsave.shard"
ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})  # a header entry's keys: any other is corrupt
_DTYPES_KEY = "recsave.dtypes"


@dataclass(frozen=True)
class HeaderEntry:
    dtype: DType
    shape: Tuple[int, ...]   # the chunk's shape as recsave means it (not the U8 stand-in)
    begin: int               # offsets relative to the data buffer
    end: int


# Writers pad the header so that most of the data starts on this boundary in the file. The kernel's
# copy of a buffered write (`rep movsb`) runs slower when source and page cache are not aligned
# alike: tensors start 64-byte aligned in memory, and a save of 2 GB written at file offsets 16
# bytes past a 64-byte boundary took 360 ms against 290 aligned (benchmarks/README.md, the
# alignment session). Readers accept any amount of padding, as safetensors does.
DATA_ALIGN = 64


def _padding(text_len: int, tensors: Sequence[Tuple[int, int]]) -> int:
    """Spaces to append to a header of `text_len` bytes: a multiple-of-8 total (the format's rule)
    chosen among the DATA_ALIGN // 8 candidates so that the most bytes of `tensors` ((offset in the
    data buffer, nbytes)) start DATA_ALIGN-aligned in the file; the least padding on a tie."""
    base = -text_len % 8
    best, best_bytes = base, -1
    for pad in range(base, base + DATA_ALIGN, 8):
        start = 8 + text_len + pad
        aligned = sum(n for begin, n in tensors if (start + begin) % DATA_ALIGN == 0)
        if aligned > best_bytes:
            best, best_bytes = pad, aligned
    return best


def build(entries: Sequence[Tuple[str, DType, Sequence[int]]], format_version: int) -> Tuple[bytes, List[int]]:
    """Header bytes (length prefix included, JSON padded with spaces to a multiple of 8, chosen by
    _padding to align the data) for tensors stored back to back, and each tensor's absolute byte
    offset in the file."""
    header: Dict[str, object] = {}
    foreign: Dict[str, str] = {}
    extents: List[Tuple[int, int]] = []  # (offset in the data buffer, nbytes) of each tensor
    begin = 0
    for name, dtype, shape in entries:
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if dtype.st_code is None:
            foreign[name] = dtype.name
            st_code, st_shape = "U8", [nbytes]
        else:
            st_code, st_shape = dtype.st_code, list(shape)
        header[name] = {"dtype": st_code, "shape": st_shape, "data_offsets": [begin, begin + nbytes]}
        extents.append((begin, nbytes))
        begin += nbytes
    metadata = {"format": SHARD_FORMAT, "format_version": str(format_version)}
    if foreign:
        metadata[_DTYPES_KEY] = json.dumps(foreign, sort_keys=True)
    text = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    text += b" " * _padding(len(text), extents)
    data_start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, [data_start + offset for offset, _ in extents]


def parse(raw: bytes, file_size: int, path: str) -> Tuple[int, Dict[str, HeaderEntry]]:
    """Validates header bytes (without the length prefix) of a file of `file_size` bytes.
    Returns the data buffer's start offset and the entries. Raises CorruptCheckpointError."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise checks.corrupt(path, f"shard header is not UTF-8 JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise checks.corrupt(path, "shard header is not a JSON object")
    data_start = 8 + len(raw)
    data_size = file_size - data_start
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise checks.corrupt(path, "shard header __metadata__ is not an object")
    foreign = _foreign_dtypes(metadata, path)

    entries: Dict[str, HeaderEntry] = {}
    for name, spec in obj.items():
        if not isinstance(spec, dict):
            raise checks.corrupt(path, "header entry is not an object", name)
        checks.only_keys(spec, ENTRY_KEYS, "header entry", path, name)  # the padding leaves room for edits
        code = spec.get("dtype")
        if name in foreign:
            if code != "U8":
                raise checks.corrupt(path, f"stand-in dtype must be U8, found {code!r}", name)
            dtype = foreign[name]
        elif isinstance(code, str) and code in BY_CODE:
            dtype = BY_CODE[code]
        else:
            raise checks.corrupt(path, f"unknown safetensors dtype {code!r}", name)
        shape = checks.as_shape(spec.get("shape"), path, name)
        offsets = spec.get("data_offsets")
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise checks.corrupt(path, f"data_offsets must be [begin, end], found {offsets!r}", name)
        begin = checks.as_int(offsets[0], "data_offsets begin", path, name, hi=max(data_size, 0))
        end = checks.as_int(offsets[1], "data_offsets end", path, name, lo=begin, hi=max(data_size, 0))
        if checks.byte_size(shape, 1 if name in foreign else dtype.itemsize, path, name) != end - begin:
            raise checks.corrupt(path, f"shape {shape} of {dtype.name} does not fill data_offsets "
                                 f"[{begin}, {end}]", name)
        entries[name] = HeaderEntry(dtype, tuple(shape), begin, end)

    spans = sorted((e.begin, e.end, n) for n, e in entries.items())
    for (_b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise checks.corrupt(path, f"data of {n0!r} and {n1!r} overlap")
    return data_start, entries


def _foreign_dtypes(metadata: dict, path: str) -> Dict[str, DType]:
    raw = metadata.get(_DTYPES_KEY)
    if raw is None:
        return {}
    try:
        mapping = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        mapping = None
    if not isinstance(mapping, dict):
        raise checks.corrupt(path, f"__metadata__[{_DTYPES_KEY!r}] is not a JSON object")
    out = {}
    for name, dtype_name in mapping.items():
        if not isinstance(dtype_name, str) or dtype_name not in BY_NAME:
            raise checks.corrupt(path, f"unknown dtype {dtype_name!r}", name)
        out[name] = BY_NAME[dtype_name]
    return out



__all__ = ["HeaderEntry", "build", "parse", "SHARD_FORMAT"]
