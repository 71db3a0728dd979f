"""Data types of the format (docs/FORMAT.md section 4): torch name, item size, safetensors code."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from recsave.errors import CorruptCheckpointError, UsageError


@dataclass(frozen=True)
class DType:
    name: str                  # torch's name, as written in the index
    torch_dtype: torch.dtype
    itemsize: int
    st_code: Optional[str]     # safetensors code, None when safetensors has none (stored as U8)


_TABLE = [
    ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"),
    ("int64", "I64"), ("int32", "I32"), ("int16", "I16"), ("int8", "I8"),
    ("uint64", "U64"), ("uint32", "U32"), ("uint16", "U16"), ("uint8", "U8"),
    ("bool", "BOOL"), ("complex64", "C64"),
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("complex128", None), ("complex32", None), ("float8_e8m0fnu", None), ("float4_e2m1fn_x2", None),
    ("bits8", None), ("bits16", None), ("bits1x8", None), ("bits2x4", None), ("bits4x2", None),
]

BY_NAME: Dict[str, DType] = {}
BY_TORCH: Dict[torch.dtype, DType] = {}
for _name, _code in _TABLE:
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):  # older torch builds lack some of the newest types
        _entry = DType(_name, _dt, _dt.itemsize, _code)
        BY_NAME[_name] = _entry
        BY_TORCH[_dt] = _entry

BY_CODE: Dict[str, DType] = {d.st_code: d for d in BY_NAME.values() if d.st_code}


def from_torch(dtype: torch.dtype, *, key: Optional[str] = None) -> DType:
    """The format's description of a torch dtype; UsageError for dtypes the format cannot store."""
    try:
        return BY_TORCH[dtype]
    except KeyError:
        raise UsageError(
            f"tensor {key!r} has dtype {dtype}, which recsave cannot store (quantized and sub-byte "
            f"dtypes are not supported); convert it, e.g. with .dequantize() or .to(torch.uint8)",
            key=key) from None


def from_name(name: object, *, path: Optional[str] = None, key: Optional[str] = None) -> DType:
    """Looks up a dtype name read from disk; CorruptCheckpointError when unknown."""
    if isinstance(name, str) and name in BY_NAME:
        return BY_NAME[name]
    raise CorruptCheckpointError(
        f"{path}: tensor {key!r} has unknown dtype {name!r}; it was written by a newer or foreign "
        f"writer (known: {', '.join(sorted(BY_NAME))})", path=path, key=key)
