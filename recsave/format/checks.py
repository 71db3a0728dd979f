"""Small validators for values read from disk. Each raises CorruptCheckpointError naming the file."""
from __future__ import annotations

import math
import re
from typing import AbstractSet, Any, List, Mapping, Optional, Sequence, TypeGuard

import numpy as np

from recsave.errors import CorruptCheckpointError

MAX_NDIM = 32
MAX_ELEMENT_BYTES = 1 << 62  # largest tensor byte size accepted, far above any real file

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def corrupt(path: Optional[str], message: str, key: Optional[str] = None) -> CorruptCheckpointError:
    where = f"{path}: " if path else ""
    what = f"tensor {key!r}: " if key else ""
    return CorruptCheckpointError(
        f"{where}{what}{message}; the checkpoint is damaged or was not written by recsave — "
        f"restore from another checkpoint", path=path, key=key)


def only_keys(obj: Mapping[str, Any], allowed: AbstractSet[str], what: str, path: Optional[str],
              key: Optional[str] = None) -> None:
    """Refuses an entry with a key recsave never writes: one misspelt by damage (a renamed
    "crc32c", say) would otherwise be ignored silently."""
    if not obj.keys() <= allowed:
        unknown = sorted(set(obj) - allowed)
        raise corrupt(path, f"{what} has unknown keys {unknown[:4]!r:.80} (allowed: {sorted(allowed)})", key)


def as_int(value: Any, what: str, path: Optional[str], key: Optional[str] = None, *,
           lo: int = 0, hi: int = MAX_ELEMENT_BYTES) -> int:
    """An integer in [lo, hi]; bools, floats and strings are refused."""
    if type(value) is not int or not lo <= value <= hi:
        raise corrupt(path, f"{what} must be an integer in [{lo}, {hi}], found {value!r}", key)
    return value


def as_ints(values: Any, what: str, path: Optional[str], key: Optional[str] = None, *,
            lo: int = 0, hi: int = MAX_ELEMENT_BYTES, increasing: Optional[str] = None) -> List[int]:
    """A list of integers in [lo, hi], optionally increasing ("strictly" or "weakly"). Index lists
    run to tens of thousands of entries (checksums, segment ends, bucket starts): the common valid
    case is checked in bulk, and only a failing list is walked for the precise message."""
    if not isinstance(values, list):
        raise corrupt(path, f"{what}s must be a list, found {type(values).__name__}", key)
    if values and set(map(type, values)) == {int} and lo <= min(values) and max(values) <= hi:
        if increasing is None or len(values) < 2:
            return values
        if len(values) <= 64:  # numpy's per-call cost outweighs a loop: a chunk per rank at 1000 ranks
            pairs = zip(values, values[1:])
            ok = all(a < b for a, b in pairs) if increasing == "strictly" else all(a <= b for a, b in pairs)
        else:
            steps = np.diff(np.asarray(values, dtype=np.int64))  # in range: at most 2**62
            ok = bool((steps > 0).all() if increasing == "strictly" else (steps >= 0).all())
        if ok:
            return values
    for i, v in enumerate(values):
        as_int(v, what, path, key, lo=lo, hi=hi)
        if increasing and i and (v < values[i - 1] or (v == values[i - 1] and increasing == "strictly")):
            raise corrupt(path, f"{what}s must increase {increasing}, found {values[i - 1]} then {v}", key)
    return values


def as_shape(value: Any, path: Optional[str], key: Optional[str] = None) -> List[int]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise corrupt(path, f"shape must be a list of at most {MAX_NDIM} integers, found {value!r}", key)
    return [as_int(d, "shape dimension", path, key) for d in value]


def byte_size(shape: Sequence[int], itemsize: int, path: Optional[str], key: Optional[str] = None) -> int:
    """product(shape) * itemsize, refusing results beyond MAX_ELEMENT_BYTES (Python ints never wrap,
    but a huge value must not reach an allocation)."""
    total = itemsize
    for d in shape:
        total *= d
        if total > MAX_ELEMENT_BYTES:
            raise corrupt(path, f"shape {list(shape)} describes more than 2^62 bytes", key)
    return total


def as_plain_name(value: Any, what: str, path: Optional[str]) -> str:
    """A file name inside the checkpoint directory: no separators, no '..', no absolute paths."""
    if not isinstance(value, str) or not _PLAIN_NAME.fullmatch(value) or value in (".", ".."):
        raise corrupt(path, f"{what} {value!r} is not a plain file name inside the checkpoint directory")
    return value


def is_plain_name(value: str) -> bool:
    return bool(_PLAIN_NAME.fullmatch(value)) and value not in (".", "..") and len(value) <= 255


def is_finite_number(value: Any) -> TypeGuard[float]:
    """An int or float (not bool) that is finite: a metric's value. An int past float range
    (10**400, which JSON allows) is not: isfinite and comparisons with floats raise on it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
