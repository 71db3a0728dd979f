"""The oracle's rules (docs/FORMAT.md): limits, the dtype table and validators of untrusted JSON
values, written from the specification like the oracle itself (recsave/format/oracle.py) and
shared by nothing else."""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Tuple

from recsave.errors import CorruptCheckpointError

FORMAT_VERSION = 1
INDEX_MAGIC = "recsave.index"
MAX_INDEX_BYTES = 256 * 1024 * 1024
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_NDIM = 32
MAX_NBYTES = 1 << 62
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")

# FORMAT.md section 4: torch dtype name -> (itemsize, safetensors code or None when stored as U8).
DTYPE_TABLE: Dict[str, Tuple[int, Optional[str]]] = {
    "float64": (8, "F64"), "float32": (4, "F32"), "float16": (2, "F16"), "bfloat16": (2, "BF16"),
    "int64": (8, "I64"), "int32": (4, "I32"), "int16": (2, "I16"), "int8": (1, "I8"),
    "uint64": (8, "U64"), "uint32": (4, "U32"), "uint16": (2, "U16"), "uint8": (1, "U8"),
    "bool": (1, "BOOL"), "complex64": (8, "C64"),
    "float8_e4m3fn": (1, "F8_E4M3"), "float8_e5m2": (1, "F8_E5M2"),
    "float8_e4m3fnuz": (1, "F8_E4M3FNUZ"), "float8_e5m2fnuz": (1, "F8_E5M2FNUZ"),
    "complex128": (16, None), "complex32": (4, None), "float8_e8m0fnu": (1, None),
    "float4_e2m1fn_x2": (1, None), "bits8": (1, None), "bits16": (2, None), "bits1x8": (1, None),
    "bits2x4": (1, None), "bits4x2": (1, None),
}
CODE_ITEMSIZE: Dict[str, int] = {code: size for size, code in DTYPE_TABLE.values() if code}


def corrupt(path: str, what: str, key: Optional[str] = None) -> CorruptCheckpointError:
    where = f"{path}: tensor {key!r}: " if key is not None else f"{path}: "
    return CorruptCheckpointError(where + what + " (the checkpoint is corrupt; restore another one)",
                                  path=path, key=key)


def is_int(v: Any) -> bool:
    # JSON true/false parse to bool, a subclass of int: they are not integers here.
    return isinstance(v, int) and not isinstance(v, bool)


def as_int(v: Any, what: str, path: str, key: Optional[str] = None, lo: int = 0, hi: int = MAX_NBYTES) -> int:
    if not is_int(v) or not lo <= v < hi:
        raise corrupt(path, f"{what} must be an integer in [{lo}, {hi}), got {v!r:.80}", key)
    return v


def as_obj(v: Any, what: str, path: str, key: Optional[str] = None) -> dict:
    if not isinstance(v, dict):
        raise corrupt(path, f"{what} must be a JSON object, got {type(v).__name__}", key)
    return v


def no_duplicates(pairs: List[Tuple[str, Any]]) -> dict:
    # A repeated key would let two readers see different values: refuse it.
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r:.80}")
        out[k] = v
    return out


def parse_json(raw: bytes, what: str, path: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, int digit limit
        raise corrupt(path, f"{what} is not valid UTF-8 JSON: {str(e):.200}") from None


def as_shape(v: Any, what: str, path: str, key: Optional[str] = None, itemsize: int = 1) -> Tuple[List[int], int]:
    """Validates a shape and returns it with its byte size ``product(shape) x itemsize``, which must be
    < 2^62 (so that a reader using int64 arithmetic cannot overflow); each dim is bounded the same way."""
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise corrupt(path, f"{what} shape must be a list of at most {MAX_NDIM} dims, got {v!r:.80}", key)
    nbytes = itemsize
    for d in v:
        if not is_int(d) or d < 0:
            raise corrupt(path, f"{what} shape {v!r:.80} has a dim that is not a non-negative integer", key)
        nbytes *= d
        if nbytes >= MAX_NBYTES or d >= MAX_NBYTES:  # Python ints never overflow: bound them explicitly
            raise corrupt(path, f"{what} shape {v!r:.80} x itemsize {itemsize} is 2^62 bytes or more", key)
    return list(v), nbytes


def plain_name(name: Any, path: str) -> str:
    if not isinstance(name, str) or not PLAIN_NAME.match(name) or name in (".", ".."):
        raise corrupt(path, f"file name {name!r:.120} is not a plain file name inside the checkpoint directory")
    return name
