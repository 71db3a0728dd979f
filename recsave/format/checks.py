"""Small validators for values read from disk. Each raises CorruptCheckpointError naming the file."""
from __future__ import annotations

import re
from typing import Any, List, Optional, Sequence

from ..errors import CorruptCheckpointError

MAX_NDIM = 32
MAX_ELEMENT_BYTES = 1 << 62  # largest tensor byte size accepted, far above any real file

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def corrupt(path: Optional[str], message: str, key: Optional[str] = None) -> CorruptCheckpointError:
    where = f"{path}: " if path else ""
    what = f"tensor {key!r}: " if key else ""
    return CorruptCheckpointError(
        f"{where}{what}{message}; the checkpoint is damaged or was not written by recsave — "
        f"restore from another checkpoint", path=path, key=key)


def as_int(value: Any, what: str, path: Optional[str], key: Optional[str] = None, *,
           lo: int = 0, hi: int = MAX_ELEMENT_BYTES) -> int:
    """An integer in [lo, hi]; bools, floats and strings are refused."""
    if type(value) is not int or not lo <= value <= hi:
        raise corrupt(path, f"{what} must be an integer in [{lo}, {hi}], found {value!r}", key)
    return value


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
