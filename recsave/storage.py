"""One small storage interface chosen by URL: plain paths use the local file system directly (and the
C++ engine's positional writes), every URL with a scheme (``s3://``, ``memory://``, ``file://``...) goes
through fsspec in bounded chunks."""
from __future__ import annotations

import abc
import contextlib
import errno as errno_mod
import os
import shutil
from typing import IO, Iterator, List

from . import _C, knobs
from .errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError


def _wrap_os_error(exc: OSError, path: str, what: str) -> StorageError:
    return StorageError(f"{path}: {what} failed: {exc.strerror or exc}", path=path, errno=exc.errno)


class Storage(abc.ABC):
    """Paths are strings in the storage's own syntax; `join` builds them."""

    is_local = False

    @abc.abstractmethod
    def join(self, *parts: str) -> str: ...
    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...
    @abc.abstractmethod
    def isdir(self, path: str) -> bool: ...
    @abc.abstractmethod
    def listdir(self, path: str) -> List[str]: ...
    @abc.abstractmethod
    def makedirs(self, path: str) -> None: ...
    @abc.abstractmethod
    def size(self, path: str) -> int: ...
    @abc.abstractmethod
    def remove_tree(self, path: str) -> None: ...
    @abc.abstractmethod
    def remove_file(self, path: str) -> None: ...
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
            raise _wrap_os_error(exc, path, "reading") from exc
        if len(data) != length:
            raise CorruptCheckpointError(f"{path}: file ends before byte {offset + length} (truncated)",
                                         path=path)
        return data
    @abc.abstractmethod
    def write_atomic(self, path: str, data: bytes) -> None:
        """Publishes `data` at `path` in one step: readers see the old file or the new one."""
    @abc.abstractmethod
    def open_write(self, path: str) -> "contextlib.AbstractContextManager[IO[bytes]]":
        """A writable file that becomes visible at `path` only if the block exits without error."""

    def read_bytes(self, path: str, limit: int) -> bytes:
        """The whole file, refusing files over `limit` bytes before reading them."""
        size = self.size(path)
        if size > limit:
            raise CorruptCheckpointError(f"{path}: file is {size} bytes, over the {limit}-byte limit",
                                         path=path)
        return self.read_range(path, 0, size)


class LocalStorage(Storage):
    is_local = True

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path) and not os.path.islink(path)

    def listdir(self, path: str) -> List[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise _wrap_os_error(exc, path, "creating the directory") from exc

    def size(self, path: str) -> int:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} does not exist", path=path) from None

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def _read_raw(self, path: str, offset: int, length: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def write_atomic(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        """A file that appears at `path` only when the block exits without error (temp + rename)."""
        temp = f"{path}.tmp-{os.getpid()}"
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
        except OSError as exc:
            self.remove_file(temp)
            raise _wrap_os_error(exc, path, "writing") from exc
        except BaseException:
            self.remove_file(temp)
            raise


class FsspecStorage(Storage):
    """Any fsspec file system. Object stores have no rename: a file is written by one put / one
    multipart upload, which becomes visible only when complete."""

    def __init__(self, url: str):
        import fsspec

        self.fs, _ = fsspec.core.url_to_fs(url)
        self.protocol = url.split("://", 1)[0]

    def join(self, *parts: str) -> str:
        head, *rest = parts
        return "/".join([head.rstrip("/")] + [p.strip("/") for p in rest])

    def exists(self, path: str) -> bool:
        return self._call(self.fs.exists, path, "checking")

    def isdir(self, path: str) -> bool:
        return self._call(self.fs.isdir, path, "checking")

    def listdir(self, path: str) -> List[str]:
        try:
            entries = self.fs.ls(path, detail=False, refresh=True) if _accepts_refresh(self.fs) \
                else self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise _wrap_os_error(exc, path, "listing") from exc
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def makedirs(self, path: str) -> None:
        self._call(lambda p: self.fs.makedirs(p, exist_ok=True), path, "creating the directory")

    def size(self, path: str) -> int:
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} does not exist", path=path) from None
        except OSError as exc:
            raise _wrap_os_error(exc, path, "stat") from exc
        return int(info["size"])

    def remove_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def _read_raw(self, path: str, offset: int, length: int) -> bytes:
        return self.fs.cat_file(path, start=offset, end=offset + length)

    def write_atomic(self, path: str, data: bytes) -> None:
        self._call(lambda p: self.fs.pipe_file(p, data), path, "writing")

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        try:
            f = self.fs.open(path, "wb", block_size=max(5 << 20, min(knobs.get("io_chunk_bytes"), 256 << 20)))
        except OSError as exc:
            raise _wrap_os_error(exc, path, "opening for writing") from exc
        ok = False
        try:
            yield f
            ok = True
        finally:
            if ok:
                try:
                    f.close()
                except OSError as exc:
                    raise _wrap_os_error(exc, path, "writing") from exc
            else:
                with contextlib.suppress(Exception):
                    if hasattr(f, "discard"):
                        f.discard()  # abort a multipart upload instead of publishing a partial file
                    else:
                        f.close()
                self.remove_file(path)

    def _call(self, fn, path: str, what: str):
        try:
            return fn(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} does not exist", path=path) from None
        except OSError as exc:
            raise _wrap_os_error(exc, path, what) from exc


def _accepts_refresh(fs) -> bool:
    return getattr(fs, "protocol", None) in ("s3", "s3a", ("s3", "s3a"), "gcs", "gs", ("gcs", "gs"))


def is_url(path: str) -> bool:
    return "://" in path


def get_storage(path: str) -> Storage:
    """LocalStorage for plain paths, FsspecStorage for URLs."""
    if not isinstance(path, str) or not path:
        raise StorageError(f"storage path must be a non-empty string, got {path!r}",
                           errno=errno_mod.EINVAL)
    return FsspecStorage(path) if is_url(path) else LocalStorage()
