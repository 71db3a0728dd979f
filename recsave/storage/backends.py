"""One small storage interface chosen by URL: plain paths use the local file system directly (and the
C++ engine's positional writes), every URL with a scheme (``s3://``, ``memory://``, ``file://``...) goes
through fsspec in bounded chunks."""
from __future__ import annotations

import abc
import contextlib
import errno as errno_mod
import os
import random
import shutil
import time
from typing import IO, Any, Callable, Iterator, List, Optional, TypeVar

from recsave import _C
from recsave import knobs
from recsave.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError

T = TypeVar("T")


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

    def write_stream(self, path: str, produce: Callable[[IO[bytes]], None]) -> None:
        """Publishes at `path` the bytes `produce(f)` writes to `f`, only if it returns. Remote
        storage retries a transient upload failure by running `produce` again from the start, so
        it must write the same bytes every time; nothing written is kept (`produce` may reuse its
        buffers, and memory stays at what it holds itself)."""
        with self.open_write(path) as f:
            produce(f)

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
    multipart upload, which becomes visible only when complete.

    Every remote call goes through :meth:`_retry`: transient failures (connection errors, timeouts,
    HTTP 5xx / throttling) are retried with exponential backoff and jitter (knobs ``io_retries``,
    ``io_retry_base_s``, ``io_retry_max_s``), then reported as a StorageError naming the path, the
    operation, the attempts and the last error. Permanent errors (not found, permission, other 4xx)
    are not retried."""

    def __init__(self, url: str):
        import fsspec

        self.fs, _ = fsspec.core.url_to_fs(url)
        self.protocol = url.split("://", 1)[0]

    def join(self, *parts: str) -> str:
        head, *rest = parts
        return "/".join([head.rstrip("/")] + [p.strip("/") for p in rest])

    def exists(self, path: str) -> bool:
        # fsspec's exists() / isdir() answer False on any error; info() lets a transient failure be
        # retried instead of read as "missing" (which would make a restore start from scratch).
        return self._info_or_none(path, "checking") is not None

    def isdir(self, path: str) -> bool:
        info = self._info_or_none(path, "checking")
        return info is not None and info.get("type") == "directory"

    def _info_or_none(self, path: str, what: str) -> Optional[dict]:
        try:
            return self._retry(what, path, lambda: self.fs.info(path))
        except FileNotFoundError:
            return None

    def listdir(self, path: str) -> List[str]:
        refresh = _accepts_refresh(self.fs)
        try:
            entries = self._retry("listing", path, lambda: self.fs.ls(path, detail=False, refresh=True)
                                  if refresh else self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def makedirs(self, path: str) -> None:
        self._call(lambda p: self.fs.makedirs(p, exist_ok=True), path, "creating the directory")

    def size(self, path: str) -> int:
        try:
            info = self._retry("stat", path, lambda: self.fs.info(path))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} does not exist", path=path) from None
        return int(info["size"])

    def remove_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._retry("removing", path, lambda: self.fs.rm(path, recursive=True))

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._retry("removing", path, lambda: self.fs.rm_file(path))

    def _read_raw(self, path: str, offset: int, length: int) -> bytes:
        return self._retry("reading", path, lambda: self.fs.cat_file(path, start=offset, end=offset + length))

    def write_atomic(self, path: str, data: bytes) -> None:
        self._call(lambda p: self.fs.pipe_file(p, data), path, "writing")

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        """A stream that publishes `path` only when the block exits without error. The buffers
        handed to write() are kept (by reference, not copied) and uploaded by write_stream as the
        block exits, which retries a transient failure by uploading them again: they MUST NOT
        change until the block exits. Shard files use write_stream itself, which keeps nothing."""
        pieces = _Pieces()
        yield pieces  # type: ignore[misc]
        self.write_stream(path, pieces.write_to)

    def write_stream(self, path: str, produce: Callable[[IO[bytes]], None]) -> None:
        attempts = max(0, int(knobs.get("io_retries"))) + 1
        for attempt in range(1, attempts + 1):
            upload = _Upload(self._retry("opening for writing", path, lambda: self._open_upload(path)))
            try:
                produce(upload)  # type: ignore[arg-type]
                upload.close()
                return
            except _UploadError as failed:
                self._discard(upload.f, path)
                exc = failed.__cause__
                transient = is_transient(exc) and not isinstance(exc, FileNotFoundError)
                if not transient or attempt == attempts:
                    raise _failed(exc, path, "writing", attempt, transient=transient) from exc
            except BaseException:  # the producer's own error: not the store's, not retried
                self._discard(upload.f, path)
                raise
            time.sleep(backoff_s(attempt))

    def _open_upload(self, path: str) -> Any:
        block = max(5 << 20, min(knobs.get("io_chunk_bytes"), 256 << 20))
        return self.fs.open(path, "wb", block_size=block)

    def _discard(self, f: Any, path: str) -> None:
        """Drops an unfinished upload without publishing it (aborts a multipart upload)."""
        with contextlib.suppress(Exception):
            if hasattr(f, "discard"):
                f.discard()
            else:
                f.close()
        with contextlib.suppress(Exception):
            self.remove_file(path)

    def _call(self, fn, path: str, what: str):
        try:
            return self._retry(what, path, lambda: fn(path))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} does not exist", path=path) from None

    def _retry(self, what: str, path: str, fn: Callable[[], T]) -> T:
        """fn(), retried on transient errors. FileNotFoundError passes through (callers decide what a
        missing file means); every other failure becomes a StorageError."""
        attempts = max(0, int(knobs.get("io_retries"))) + 1
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except (FileNotFoundError, StorageError, CorruptCheckpointError):
                raise
            except Exception as exc:  # classified below; anything not transient is raised at once
                if not is_transient(exc) or attempt == attempts:
                    raise _failed(exc, path, what, attempt, transient=is_transient(exc)) from exc
                time.sleep(backoff_s(attempt))
        raise AssertionError("unreachable")


class _UploadError(Exception):
    """An upload call failed (the cause): tells the store's failures from the producer's."""


class _Upload:
    """The file object write_stream hands its producer: an fsspec upload whose failures are
    marked as such."""

    def __init__(self, f: Any):
        self.f = f

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except Exception as exc:
            raise _UploadError() from exc

    def close(self) -> None:
        try:
            self.f.close()
        except Exception as exc:
            raise _UploadError() from exc


class _Pieces:
    """The file object of FsspecStorage.open_write: keeps references to the written buffers."""

    def __init__(self) -> None:
        self._views: List[memoryview] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._views.append(view)
        return len(view)

    def write_to(self, f: IO[bytes]) -> None:
        for view in self._views:
            f.write(view)


def backoff_s(attempt: int) -> float:
    """Seconds to wait after failed attempt `attempt` (1-based): full jitter over an exponential
    bound, capped by the io_retry_max_s knob."""
    cap = float(knobs.get("io_retry_max_s"))
    bound = min(cap, float(knobs.get("io_retry_base_s")) * (2 ** (attempt - 1)))
    return random.uniform(bound / 2, bound)


# errno values of permanent conditions: retrying cannot help.
_PERMANENT_ERRNOS = {errno_mod.ENOENT, errno_mod.EACCES, errno_mod.EPERM, errno_mod.EINVAL, errno_mod.ENOSPC,
                     errno_mod.EROFS, errno_mod.EEXIST, errno_mod.ENOTDIR, errno_mod.EISDIR,
                     errno_mod.ENAMETOOLONG, getattr(errno_mod, "EDQUOT", errno_mod.ENOSPC),
                     errno_mod.EFBIG, errno_mod.ENOTEMPTY}
# errno values of conditions that pass: the store is busy, a connection dropped, a request timed out.
_TRANSIENT_ERRNOS = {errno_mod.EIO, getattr(errno_mod, "EREMOTEIO", errno_mod.EIO), errno_mod.EAGAIN,
                     errno_mod.EBUSY, errno_mod.ETIMEDOUT, errno_mod.ECONNRESET, errno_mod.ECONNREFUSED,
                     errno_mod.ECONNABORTED, errno_mod.EPIPE, errno_mod.ENETUNREACH, errno_mod.EHOSTUNREACH,
                     errno_mod.ENETDOWN}
_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestLimitExceeded",
                   "TooManyRequestsException", "RequestTimeout", "RequestTimeoutException",
                   "ServiceUnavailable", "InternalError", "503", "500"}
_TRANSIENT_NAMES = {
    # botocore
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ConnectionError", "HTTPClientError", "IncompleteReadError", "ResponseStreamingError",
    "ResponseParserError",
    # aiohttp
    "ClientConnectionError", "ClientConnectorError", "ServerDisconnectedError", "ClientPayloadError",
    "ClientOSError", "ServerTimeoutError", "ServerConnectionError",
    # fsspec / urllib3 / http.client
    "FSTimeoutError", "ProtocolError", "IncompleteRead", "RemoteDisconnected",
}


def _http_status(exc: BaseException) -> Optional[int]:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if isinstance(status, int) else None
    status = getattr(exc, "status", None)  # aiohttp ClientResponseError
    return status if isinstance(status, int) else None


def _judge_one(exc: BaseException) -> Optional[bool]:
    """True: transient, False: permanent, None: this exception alone does not say."""
    if isinstance(exc, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
                        NotADirectoryError)):
        return False
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError: judge by error code and HTTP status
        code = str(response.get("Error", {}).get("Code", ""))
        status = _http_status(exc)
        if code in _THROTTLE_CODES or (status is not None and (status >= 500 or status == 429)):
            return True
        return False
    status = _http_status(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    if isinstance(exc, (TimeoutError, ConnectionError)):  # asyncio.TimeoutError, socket.timeout too
        return True
    if any(k.__name__ in _TRANSIENT_NAMES for k in type(exc).__mro__):
        return True
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.errno in _PERMANENT_ERRNOS:
            return False
        if exc.errno in _TRANSIENT_ERRNOS:
            return True
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the failed remote operation may succeed. Looks at the exception and its
    causes (s3fs translates a botocore ClientError into an OSError whose cause is the original)."""
    seen = 0
    cur: Optional[BaseException] = exc
    while cur is not None and seen < 8:
        verdict = _judge_one(cur)
        if verdict is not None:
            return verdict
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


def _failed(exc: BaseException, path: str, what: str, attempts: int, *, transient: bool) -> StorageError:
    err = getattr(exc, "errno", None)
    detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    if transient:
        hint = (f"gave up after {attempts} attempt(s) (knob io_retries={knobs.get('io_retries')}); "
                f"check that the store is reachable")
    else:
        hint = f"not retried (a permanent error), attempt {attempts}"
    return StorageError(f"{path}: {what} failed: {detail}; {hint}", path=path,
                        errno=err if isinstance(err, int) else None)


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
