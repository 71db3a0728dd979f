"""The torch.save files of a checkpoint (model.pt, extra.pt, io states): written with their size and
CRC32C recorded in the index, read back only after both check out, and only with weights_only=True so
nothing in a checkpoint is ever unpickled as an arbitrary object."""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch

try:  # torch.save imports its options on first use: 2 ms inside a process's first checkpoint
    import torch.utils.serialization.config
except ImportError:  # torch versions without it
    pass

from recsave import _C
from recsave.errors import CorruptCheckpointError
from recsave.format.reader import check_listed_file
from recsave.format.records import FileEntry, Index
from recsave.storage import Storage

# A .pt file bigger than this is not a dense state recsave wrote; refuse before reading it.
MAX_PT_BYTES = 64 << 30


def save(storage: Storage, directory: str, fname: str, obj: Any, rank: int) -> FileEntry:
    """torch.save(obj) into directory/fname; returns its index file entry (size, rank, crc32c)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    storage.write_atomic(storage.join(directory, fname), bytes(data))
    return FileEntry(len(data), rank, _C.crc32c(data))


def save_bytes(storage: Storage, directory: str, fname: str, data: bytes, rank: int) -> FileEntry:
    storage.write_atomic(storage.join(directory, fname), data)
    return FileEntry(len(data), rank, _C.crc32c(data))


def read_bytes(storage: Storage, directory: str, fname: str, index: Index) -> bytes:
    """The file's bytes after checking presence, size and CRC32C against the index."""
    entry = index.files.get(fname)
    path = storage.join(directory, fname)
    if entry is None:
        raise CorruptCheckpointError(f"{path}: the index does not list this file", path=path)
    check_listed_file(directory, fname, index, storage)
    data = storage.read_bytes(path, MAX_PT_BYTES)
    if len(data) != entry.size:
        raise CorruptCheckpointError(f"{path}: read {len(data)} bytes, the index records {entry.size}",
                                     path=path)
    if entry.crc32c is None:  # recsave records one for every file that is not a shard file
        raise CorruptCheckpointError(f"{path}: the index records no crc32c for this file, so its bytes "
                                     f"cannot be checked; the index is damaged — restore from another "
                                     f"checkpoint", path=path)
    if _C.crc32c(data) != entry.crc32c:
        raise CorruptCheckpointError(f"{path}: CRC32C mismatch; the file is damaged — restore from "
                                     f"another checkpoint", path=path)
    return data


def matches(index: Index, fname: str, data: bytes) -> bool:
    """Whether `data` are the bytes the index records for `fname` (its size and CRC32C; False for
    a file listed without a CRC, whose bytes cannot be told apart)."""
    entry = index.files.get(fname)
    return entry is not None and entry.crc32c is not None and len(data) == entry.size and \
        _C.crc32c(data) == entry.crc32c


def load(storage: Storage, directory: str, fname: str, index: Index) -> Any:
    """torch.load(weights_only=True) of a verified file. Pickled callables and other arbitrary
    objects are refused (never executed) with CorruptCheckpointError."""
    return decode(read_bytes(storage, directory, fname, index), storage.join(directory, fname))


def decode(data: bytes, path: str) -> Any:
    """torch.load(weights_only=True) of verified bytes read from `path` (named in errors)."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, KeyError) as exc:
        raise CorruptCheckpointError(
            f"{path}: refused to load: it holds something other than tensors and plain containers, "
            f"or is damaged ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})", path=path) from exc
