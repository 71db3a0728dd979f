"""Files read through ranged requests (:meth:`Storage.read_range`, retried remotely): a shard
reader with the methods of the engine's ``_C.ShardReader``, and a random-access file for pyarrow."""
from __future__ import annotations

import ctypes
import io
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from recsave import _C, knobs
from recsave.errors import CorruptCheckpointError, UsageError

if TYPE_CHECKING:
    from recsave.storage.base import Storage


def _corrupt(path: str, message: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {message}; the file is damaged or was not written by recsave — "
                                  f"restore from another checkpoint", path=path)


class RangedShardReader:
    """``_C.ShardReader`` over ranged requests: each read merges adjacent ranges into requests of at
    most ``io_chunk_bytes``, checks every range's CRC32C, then copies it to its address."""

    def __init__(self, storage: "Storage", path: str, size: int):
        self.storage, self.path, self.size = storage, path, size

    def read_header(self, max_header_bytes: int) -> bytes:
        if self.size < 8:
            raise _corrupt(self.path, f"file is {self.size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(self.storage.read_range(self.path, 0, 8), "little")
        if n > max_header_bytes:
            raise _corrupt(self.path, f"header length {n} exceeds the limit of {max_header_bytes} bytes")
        if n > self.size - 8:
            raise _corrupt(self.path, f"header length {n} runs past the end of the {self.size}-byte file")
        return self.storage.read_range(self.path, 8, n)

    def read(self, offsets: Any, addresses: Any, lengths: Any, expected_crcs: Any = None,
             threads: int = 1) -> None:
        offsets, addresses, lengths = (np.asarray(a, dtype=np.uint64).tolist() for a in (offsets, addresses, lengths))
        crcs = None if expected_crcs is None else np.asarray(expected_crcs, dtype=np.uint32).tolist()
        limit = knobs.get("io_chunk_bytes")
        order = sorted(range(len(offsets)), key=lambda i: offsets[i])
        i = 0
        while i < len(order):
            j, begin, end = i, offsets[order[i]], offsets[order[i]] + lengths[order[i]]
            while j + 1 < len(order) and offsets[order[j + 1]] == end and \
                    end + lengths[order[j + 1]] - begin <= limit:
                j += 1
                end += lengths[order[j]]
            data = np.frombuffer(self.storage.read_range(self.path, begin, end - begin), dtype=np.uint8)
            for k in order[i:j + 1]:
                off, n = offsets[k] - begin, lengths[k]
                piece = data[off:off + n]
                if crcs is not None and _C.crc32c(piece) != crcs[k]:
                    raise _corrupt(self.path, f"CRC32C mismatch in bytes [{offsets[k]}, {offsets[k] + n})")
                if n:
                    dest = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addresses[k]))
                    dest[:] = piece
            i = j + 1

    def close(self) -> None:
        pass


class RangedFile(io.RawIOBase):
    """A read-only, seekable file of `size` bytes whose reads are ranged requests (for pyarrow's
    ``PythonFile``: every read it makes gets the storage's retries)."""

    def __init__(self, storage: "Storage", path: str, size: int):
        super().__init__()
        self.storage, self.path, self._size, self._pos = storage, path, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}.get(whence)
        if base is None or base + offset < 0:
            raise UsageError(f"{self.path}: cannot seek to {offset} from {whence}")
        self._pos = base + offset
        return self._pos

    def read(self, size: Optional[int] = -1) -> bytes:
        n = self._size - self._pos if size is None or size < 0 else min(size, self._size - self._pos)
        if n <= 0:
            return b""
        data = self.storage.read_range(self.path, self._pos, n)
        self._pos += n
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer).cast("B")[:len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)
