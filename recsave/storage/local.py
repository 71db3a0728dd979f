"""The local file system: plain paths, atomic writes by temporary name + fsync + rename, and shard
files read and written by the C++ engine's parallel positional I/O."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import threading
import time
from typing import IO, Any, Iterator, List, Optional, Tuple

from recsave import _C, knobs
from recsave.errors import CheckpointNotFoundError, CorruptCheckpointError, RecsaveError
from recsave.storage.base import Commits, ShardContent, ShardReader, Storage, os_error, over_limit

# An empty file younger than this may be one create_exclusive is still filling.
_CREATING_S = 5.0


def _missing(path: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(f"{path} does not exist", path=path)


class LocalStorage(Storage):
    """Plain paths on this machine's file systems."""

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def split(self, path: str) -> Tuple[str, str]:
        return os.path.split(os.path.abspath(path))

    def canonical(self, path: str) -> str:
        return os.path.realpath(path)

    def local_path(self, path: str) -> Optional[str]:
        return path

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def isdir(self, path: str, *, follow_links: bool = False) -> bool:
        return os.path.isdir(path) and (follow_links or not os.path.islink(path))

    def listdir(self, path: str) -> List[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, path, "creating the directory") from exc

    def size(self, path: str) -> int:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            raise _missing(path) from None

    def regular_file_size(self, path: str) -> Optional[int]:
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise _missing(path) from None
        return st.st_size if stat.S_ISREG(st.st_mode) else None  # a symbolic link is not S_ISREG

    def ukey(self, path: str) -> str:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise _missing(path) from None
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"

    def modified_at(self, path: str) -> Optional[float]:
        try:
            return os.stat(path).st_mtime
        except FileNotFoundError:
            raise _missing(path) from None

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def remove_empty_dir(self, path: str) -> None:
        with contextlib.suppress(OSError):  # not empty, gone, or not a directory
            os.rmdir(path)

    def move_tree_aside(self, path: str, to: str) -> bool:
        """A rename: unlinking a large checkpoint's files frees its page cache (tens of ms per GB)."""
        try:
            os.makedirs(os.path.dirname(to), exist_ok=True)
            # Only into a real directory: through a symbolic link the files would leave the output
            # dir, where nothing would delete them.
            if not stat.S_ISDIR(os.lstat(os.path.dirname(to)).st_mode) or os.path.islink(path) \
                    or not os.path.isdir(path) or os.path.lexists(to):
                return False
            os.rename(path, to)
        except OSError:
            return False
        return True

    def remove_file(self, path: str) -> None:
        # A path under a file cannot exist either (NotADirectoryError): nothing to remove. A write's
        # clean-up of its temporary file there raised that error in place of the write's own.
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.remove(path)

    def _read_raw(self, path: str, offset: int, length: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def read_bytes(self, path: str, limit: int) -> bytes:
        """One open: the size checked is that of the file read (no check-then-read race)."""
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > limit:
                    raise over_limit(path, size, limit)
                data = f.read(size + 1)
        except (FileNotFoundError, NotADirectoryError):
            raise _missing(path) from None
        except IsADirectoryError:
            raise CorruptCheckpointError(f"{path} is a directory, not a file", path=path) from None
        except OSError as exc:
            raise os_error(exc, path, "reading") from exc
        if len(data) != size:
            raise CorruptCheckpointError(f"{path}: file changed size while being read ({size} bytes, then "
                                         f"{len(data)})", path=path)
        return data

    def open_shard(self, path: str, size: Optional[int] = None) -> ShardReader:
        return _C.ShardReader(path)

    def open_input(self, path: str) -> Any:
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem().open_input_file(os.path.abspath(path))

    def write_atomic(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        """A file that appears at `path` only when the block exits without error (temp + rename)."""
        # Per process and thread: the writer lock's renewal thread replaces its file while another
        # thread of the process may be writing other files (docs/FORMAT.md: `.tmp-<digits and ->`).
        temp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        durable = knobs.get("fsync")
        try:
            with open(temp, "wb") as f:
                yield f
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(temp, path)
            if durable:
                _C.fsync_directory(os.path.dirname(path) or ".")
        except RecsaveError:
            # recsave's own error, raised by the block (a source file it reads is missing, a
            # StorageError of that read) or by the engine's fsync: it says what failed already;
            # taken for a failed write, a missing file of the source read as an I/O error here.
            self.remove_file(temp)
            raise
        except OSError as exc:
            self.remove_file(temp)
            raise os_error(exc, path, "writing") from exc
        except BaseException:
            self.remove_file(temp)
            raise

    def write_shard(self, path: str, content: ShardContent, *, durable: bool,
                    commits: Optional[Commits] = None) -> None:
        writer = _C.ShardWriter(path, durable)
        try:
            writer.reserve(content.size)
            content.write_positional(writer)
            if durable and commits is not None:
                commits.submit(writer)  # fsynced together with the caller's other files
            else:
                writer.commit()
        except BaseException:
            writer.abort()
            raise

    def create_exclusive(self, path: str, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as exc:
            raise os_error(exc, path, "creating") from exc
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def replace_exclusive(self, path: str, expected: bytes, data: bytes) -> Optional[bool]:
        # Racing replacers take turns under an flock of the directory (released when the process
        # dies): each compares, then replaces by an atomic rename, so the file never disappears
        # and a creator's O_EXCL can never slip in between. Where the directory cannot be flocked
        # (NFS emulates flock with byte-range locks, which a directory opened for reading cannot
        # take) or stays flocked by something else, None: the caller's best effort (write, read
        # back).
        try:
            guard = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        except OSError as exc:
            raise os_error(exc, path, "replacing") from exc
        try:
            if not _flock_within(guard, _GUARD_WAIT_S):
                # Held that long: not by a racing replacer (they hold it for one write), but by
                # something else (a launcher's `flock <dir> python train.py`, a frozen process).
                return None
            try:
                with open(path, "rb") as f:
                    held = f.read(len(expected) + 1)
            except FileNotFoundError:
                return False
            if held != expected:
                return False
            self.write_atomic(path, data)
            return True
        except _FlockUnsupported:
            return None
        finally:
            os.close(guard)  # releases the flock

    def being_created(self, path: str) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        return st.st_size == 0 and time.time() - st.st_mtime < _CREATING_S


_GUARD_WAIT_S = 2.0  # how long replace_exclusive waits for another replacer's turn


class _FlockUnsupported(Exception):
    """The file system refuses flock on a directory."""


def _flock_within(fd: int, seconds: float) -> bool:
    """flock(fd, LOCK_EX), waiting at most `seconds` (False then); _FlockUnsupported where the
    file system refuses it."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        except OSError as exc:
            raise _FlockUnsupported() from exc
