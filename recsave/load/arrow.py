"""What the Parquet export and the Parquet source share: the export's layout constants
(docs/FORMAT.md section 7), the Arrow type that stores each torch dtype bit for bit, and the
translation of Arrow / file errors into recsave's errors."""
from __future__ import annotations

import contextlib
import urllib.parse
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import torch

from recsave.errors import CheckpointNotFoundError, CorruptCheckpointError, RecsaveError, StorageError, UsageError
from recsave.format.dtypes import BY_NAME

MANIFEST = "recsave_export.json"
DELTA_MANIFEST = "recsave_delta.json"  # an export_delta feed's (tools/deltafeed.py): changes, not tables
FORMAT = "recsave.parquet"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
DTYPE_KEY = b"recsave.dtype"

_NATIVE = {"float16": pa.float16(), "float32": pa.float32(), "float64": pa.float64()}
_BITS = {1: (pa.uint8(), np.uint8, torch.int8), 2: (pa.uint16(), np.uint16, torch.int16),
         4: (pa.uint32(), np.uint32, torch.int32), 8: (pa.uint64(), np.uint64, torch.int64)}


# ------------------------------------------------------------------------------------ dtypes
def arrow_type(dtype: str) -> pa.DataType:
    """Arrow value type storing torch dtype `dtype` bit for bit."""
    if dtype in _NATIVE:
        return _NATIVE[dtype]
    dt = BY_NAME.get(dtype)
    if dt is None or dt.itemsize not in _BITS:
        raise UsageError(f"dtype {dtype!r} cannot be exported to Parquet (supported: float16/32/64 and "
                         f"dtypes of 1, 2, 4 or 8 bytes stored as bit patterns)")
    return _BITS[dt.itemsize][0]


def native_dtype(value_type: pa.DataType) -> Optional[str]:
    """The torch dtype name Arrow stores natively as `value_type` (float16/32/64), else None."""
    return next((name for name, at in _NATIVE.items() if value_type == at), None)


def to_arrow(t: torch.Tensor, dtype: str) -> pa.Array:
    flat = t.contiguous().reshape(-1)
    if dtype in _NATIVE:
        return pa.array(flat.numpy())
    _, np_u, torch_i = _BITS[flat.element_size()]
    return pa.array(flat.view(torch_i).numpy().view(np_u))


def numpy_view(t: torch.Tensor, dtype: str) -> np.ndarray:
    """A numpy view of `t` with the Arrow storage type's numpy dtype (writes go into `t`)."""
    if dtype in _NATIVE:
        return t.numpy()
    _, np_u, torch_i = _BITS[t.element_size()]
    return t.view(torch_i).numpy().view(np_u)


@contextlib.contextmanager
def arrow_errors(where: str, what: str) -> Iterator[None]:
    """Arrow and OS errors of `what` ("reading", "writing" ...) on `where` as recsave errors."""
    try:
        yield
    except RecsaveError:
        raise
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} does not exist", path=where) from None
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        if what != "reading":
            raise
        raise CorruptCheckpointError(f"{where}: not a readable Parquet file ({exc}); re-export it or point "
                                     f"to another file", path=where) from None
    except OSError as exc:
        raise StorageError(f"{where}: {what} failed: {exc}", path=where,
                           errno=getattr(exc, "errno", None)) from exc


def table_dir_name(table: str) -> str:
    """The directory an export gives `table` (URL-quoted; never "." or "..")."""
    name = urllib.parse.quote(table, safe="-_.")
    return name if name not in (".", "..") else name.replace(".", "%2E")
