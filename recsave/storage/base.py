"""The Storage interface: what the format, load, save and tools layers need from a place that holds
files. Paths are strings in the storage's own syntax (local paths or URLs); `join` builds them.
:class:`~recsave.storage.local.LocalStorage` and :class:`~recsave.storage.remote.FsspecStorage`
implement it; callers never ask which one they have."""
from __future__ import annotations

import abc
import contextlib
from concurrent.futures import Future
from typing import IO, Any, Callable, Collection, List, Optional, Protocol, Sequence, Tuple

from recsave.errors import CheckpointNotFoundError, CorruptCheckpointError, OverLimitError, StorageError


def os_error(exc: OSError, path: str, what: str) -> StorageError:
    """A StorageError for a failed local file system call."""
    return StorageError(f"{path}: {what} failed: {exc.strerror or exc}", path=path, errno=exc.errno)


class ShardReader(Protocol):
    """An open shard file, as :meth:`Storage.open_shard` returns it: the C++ engine's
    ``_C.ShardReader`` on local disk, :class:`~recsave.storage.ranged.RangedShardReader` (the same
    methods over ranged requests) elsewhere."""

    @property
    def size(self) -> int: ...

    def read_header(self, max_header_bytes: int) -> bytes:
        """The header bytes after the file's 8-byte little-endian header length."""

    def read(self, offsets: Any, addresses: Any, lengths: Any, expected_crcs: Any = None,
             threads: int = 1) -> None:
        """Reads ``lengths[i]`` bytes at ``offsets[i]`` to raw address ``addresses[i]`` (uint64
        numpy arrays); with `expected_crcs` (uint32) each range's CRC32C is checked
        (CorruptCheckpointError on a mismatch)."""

    def close(self) -> None: ...


class ShardContent(Protocol):
    """The bytes of one shard file, able to write themselves in the two ways storage moves bytes
    (:meth:`Storage.write_shard` picks one)."""

    size: int

    def write_positional(self, writer: Any) -> None:
        """Writes every byte through an engine ``_C.ShardWriter`` (positional, parallel writes in
        any order; the file is reserved at `size` already)."""

    def write_stream(self, f: IO[bytes]) -> None:
        """Writes every byte to `f` in file order. May run again from the start (a retried upload):
        it must write the same bytes every time."""


class Commits(Protocol):
    """Where durable engine writers wait for their commit (format.commits.DeferredCommits)."""

    def submit(self, writer: Any) -> None: ...


class Storage(abc.ABC):
    """Files under paths; see docs/API.md section 4 for every method's contract."""

    # ----------------------------------------------------------------------------- names, metadata
    @abc.abstractmethod
    def join(self, *parts: str) -> str: ...

    @abc.abstractmethod
    def split(self, path: str) -> Tuple[str, str]:
        """(parent, last component) of `path`."""

    def local_path(self, path: str) -> Optional[str]:
        """`path` as a path of this machine's file system (a local path, a file:// URL's path), for
        tools that only take one (torch.distributed.checkpoint's FileSystemReader / Writer); None
        on other storage."""
        return None

    def canonical(self, path: str) -> str:
        """One spelling per place, to tell whether two paths (of any storages) name the same
        directory: local paths absolute and symlinks resolved (also given as file://), others
        with their scheme and no trailing slash."""
        return path.rstrip("/")

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def isdir(self, path: str, *, follow_links: bool = False) -> bool:
        """Whether `path` is a directory; a symbolic link to one counts only with `follow_links`
        (never by default, so that nothing is removed through a link)."""

    @abc.abstractmethod
    def listdir(self, path: str) -> List[str]:
        """Names in the directory, sorted; [] when it does not exist."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes; CheckpointNotFoundError when missing."""

    @abc.abstractmethod
    def regular_file_size(self, path: str) -> Optional[int]:
        """Size of the plain file at `path`, or None when something else is there (a directory, and
        on local disk a symbolic link, a device...); CheckpointNotFoundError when nothing is."""

    @abc.abstractmethod
    def ukey(self, path: str) -> str:
        """A token that changes when the file changes (size, modification time or ETag)."""

    def modified_at(self, path: str) -> Optional[float]:
        """When the file at `path` was last written, in seconds since the epoch by the storage's
        own clock (a local file's mtime, an object's last-modified time); None where the storage
        does not say. CheckpointNotFoundError when nothing is there."""
        self.size(path)  # CheckpointNotFoundError when missing, as where the storage tells
        return None

    # ------------------------------------------------------------------------------------- removal
    @abc.abstractmethod
    def remove_tree(self, path: str) -> None: ...

    @abc.abstractmethod
    def remove_empty_dir(self, path: str) -> None:
        """Removes directory `path` only if it is empty, in one step (a file another writer puts
        there meanwhile is never lost); nothing otherwise, and no error."""

    def move_tree_aside(self, path: str, to: str) -> bool:
        """Moves directory `path` to `to` (a new name on the same storage, whose parent this
        creates) when that is one cheap atomic step, so that a slow removal of `to` can follow off
        the caller's path; False where it is not (object stores: a copy per object) or it failed,
        with `path` as it was."""
        return False

    @abc.abstractmethod
    def remove_file(self, path: str) -> None:
        """Removes a file; a missing one is not an error."""

    def abort_stale_uploads(self, path: str, marker: str,
                            ours: Callable[[Sequence[str]], Collection[str]]) -> List[str]:
        """Aborts the unfinished uploads under directory `path` that began before file `marker`
        was last written, both by the store's own clock, and whose paths relative to `path` are
        among `ours(those paths)` (another program's upload there, or a save into an output dir
        below, is not); returns those relative paths. A writer killed in the middle of a multipart upload leaves
        one behind: invisible to listings, yet stored (and billed) until aborted. [] where a store
        has no such uploads."""
        return []

    # --------------------------------------------------------------------------------------- reads
    @abc.abstractmethod
    def _read_raw(self, path: str, offset: int, length: int) -> bytes:
        """Up to `length` bytes at `offset` (fewer at the end of the file)."""

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """Exactly `length` bytes at `offset`; a shorter file is a truncated (corrupt) one."""
        if length == 0:
            return b""
        try:
            data = self._read_raw(path, offset, length)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} does not exist", path=path) from None
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise os_error(exc, path, "reading") from exc
        if len(data) != length:
            raise CorruptCheckpointError(f"{path}: file ends before byte {offset + length} (truncated)",
                                         path=path)
        return data

    def read_bytes(self, path: str, limit: int) -> bytes:
        """The whole file, refusing files over `limit` bytes before reading them
        (CorruptCheckpointError); CheckpointNotFoundError when missing."""
        size = self.size(path)
        if size > limit:
            raise over_limit(path, size, limit)
        return self.read_range(path, 0, size)

    @abc.abstractmethod
    def open_shard(self, path: str, size: Optional[int] = None) -> ShardReader:
        """The shard file at `path` opened for header and ranged reads. `size`, when the caller
        knows it (from the index, checked against the file), spares a request remotely."""

    @abc.abstractmethod
    def open_input(self, path: str) -> Any:
        """A pyarrow input file (random access) of `path`, e.g. for ``pyarrow.parquet.ParquetFile``."""

    # -------------------------------------------------------------------------------------- writes
    @abc.abstractmethod
    def write_atomic(self, path: str, data: bytes) -> None:
        """Publishes `data` at `path` in one step: readers see the old file or the new one."""

    @abc.abstractmethod
    def open_write(self, path: str) -> "contextlib.AbstractContextManager[IO[bytes]]":
        """A writable file that becomes visible at `path` only if the block exits without error."""

    def write_stream(self, path: str, produce: Callable[[IO[bytes]], None]) -> None:
        """Publishes at `path` the bytes `produce(f)` writes to `f`, only if it returns. Remote
        storage retries a transient upload failure by running `produce` again from the start, so
        it must write the same bytes every time; nothing written is kept (`produce` may reuse its
        buffers, and memory stays at what it holds itself)."""
        with self.open_write(path) as f:
            produce(f)

    @abc.abstractmethod
    def write_shard(self, path: str, content: ShardContent, *, durable: bool,
                    commits: Optional[Commits] = None) -> None:
        """Publishes the shard file `content` at `path` (atomically). Local disk writes it with the
        engine's positional parallel writes (``content.write_positional``) and, when `durable` and
        `commits` is given, queues the commit there instead of committing now; remote storage
        streams it (``content.write_stream`` through :meth:`write_stream`)."""

    @abc.abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Creates `path` holding `data` unless a file is there; whether this call created it.
        Exclusive on local disk (O_EXCL); on object stores best effort (absent, put, read back:
        the last of two racing writers wins, and the other one sees that)."""

    def replace_exclusive(self, path: str, expected: bytes, data: bytes) -> Optional[bool]:
        """Replaces the file at `path` with `data` if it holds `expected`, exclusively: of callers
        racing to replace the same file, at most one gets True. None where the storage cannot
        (object stores: the caller writes and reads back, best effort)."""
        return None

    @abc.abstractmethod
    def being_created(self, path: str) -> bool:
        """Whether the (empty) file at `path` may be one that :meth:`create_exclusive` is still
        filling: locally the file exists before its bytes do, for a moment; a put is atomic."""

    # ------------------------------------------------------------------------------------- helpers
    def run_detached(self, fn: Callable[[], None], name: str) -> "Future[None]":
        """Runs a best-effort call `fn` (a cleanup from a finalizer) without holding up the caller
        where the storage's I/O may hang; returns its future. Here: runs it now (local I/O does
        not hang)."""
        future: "Future[None]" = Future()
        try:
            fn()
            future.set_result(None)
        except Exception as exc:  # handed to whoever waits on the future
            future.set_exception(exc)
        return future


def over_limit(path: str, size: int, limit: int) -> OverLimitError:
    return OverLimitError(f"{path}: file is {size} bytes, over the {limit}-byte limit", path=path)
