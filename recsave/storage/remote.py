"""Any fsspec file system (``s3://``, ``gs://``, ``memory://``, ``file://``...): every call retried
on transient errors (recsave.storage.retry), files published by one put or one upload."""
from __future__ import annotations

import contextlib
import datetime
import functools
import math
import re
import sys
import time
from concurrent.futures import Future
from typing import IO, Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

from recsave import knobs, threads
from recsave.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError, UsageError
from recsave.storage import retry
from recsave.storage.base import Commits, ShardContent, ShardReader, Storage
from recsave.storage.local import LocalStorage
from recsave.storage.ranged import RangedFile, RangedShardReader

T = TypeVar("T")


# fsspec's chaining: "simplecache::s3://...", also written "simplecache://::s3://...".
_CHAINED = re.compile(r"::[A-Za-z][A-Za-z0-9+.-]*://")
# A store's root: a scheme and slashes alone.
_SCHEME_ROOT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/*")
# Upload files that publish nothing before their close completes (one put, or a multipart /
# resumable upload committed at the end): (module, class), subclasses included.
_PUBLISH_ON_CLOSE = (("s3fs.core", "S3File"), ("gcsfs.core", "GCSFile"))


def _publishes_on_close(f: Any) -> bool:
    for module, name in _PUBLISH_ON_CLOSE:
        cls = getattr(sys.modules.get(module), name, None)  # loaded, if f is one of them
        if isinstance(cls, type) and isinstance(f, cls):
            return True
    return False


class FsspecStorage(Storage):
    """Any fsspec file system. Object stores have no rename: a file is written by one put / one
    multipart upload, which becomes visible only when complete.

    Every remote call goes through :func:`recsave.storage.retry.call`: transient failures
    (connection errors, timeouts, HTTP 5xx / throttling) are retried with exponential backoff and
    jitter (knobs ``io_retries``, ``io_retry_base_s``, ``io_retry_max_s``), then reported as a
    StorageError naming the path, the operation, the attempts and the last error. Permanent errors
    (not found, permission, other 4xx) are not retried."""

    def __init__(self, url: str):
        import fsspec

        self.protocol = url.split("://", 1)[0]
        if "::" in self.protocol or _CHAINED.search(url):
            # fsspec's chained URLs hand recsave's full-URL paths to the inner file system (dir::
            # prefixes them twice, the caches serve stale listings and bytes): refused outright.
            raise UsageError(
                f"{url!r} is a chained fsspec URL ({self.protocol.split('::')[0]}::...), which recsave does not "
                f"support: its files would land under other keys or be read stale from a cache; give the "
                f"store's own URL (e.g. s3://bucket/path)", path=url)
        self.fs, _ = fsspec.core.url_to_fs(url)
        # file:// URLs are local files: their small files (index, list, lock) are written like
        # LocalStorage's, temp + fsync + rename and O_EXCL, not truncated in place by pipe_file
        # (a reader or a crash could meet an empty lock file or a cut-off index).
        self._local = LocalStorage() if self.protocol in ("file", "local") else None

    # ----------------------------------------------------------------------------- names, metadata
    def join(self, *parts: str) -> str:
        head, *rest = parts
        tail = [p.strip("/") for p in rest]
        if _SCHEME_ROOT.fullmatch(head):  # a store's root ("memory://", "memory:///"): keep its slashes
            return head + "/".join(tail)
        return "/".join([head.rstrip("/")] + tail)

    def split(self, path: str) -> Tuple[str, str]:
        head, _, leaf = path.rstrip("/").rpartition("/")
        return (head + "/" if head.endswith(":/") else head), leaf

    def local_path(self, path: str) -> Optional[str]:
        return self._local_path(path) if self._local is not None else None

    def canonical(self, path: str) -> str:
        if self._local is not None:
            return self._local.canonical(self._local_path(path))
        return f"{self.protocol}://{self._local_path(path).rstrip('/')}"

    def exists(self, path: str) -> bool:
        # fsspec's exists() / isdir() answer False on any error; info() lets a transient failure be
        # retried instead of read as "missing" (which would make a restore start from scratch).
        return self._info_or_none(path, "checking") is not None

    def isdir(self, path: str, *, follow_links: bool = False) -> bool:
        info = self._info_or_none(path, "checking")
        if info is None or info.get("type") == "directory":
            return info is not None
        # An object store's key can be an object and the prefix of others at once (an empty object
        # another tool put at `run` as a folder marker, checkpoints under `run/`): HEAD finds the
        # object, and the checkpoints under the prefix were taken for absent (a lost list rebuilt
        # empty, then rotation deleting them). Its listing tells; a lone object lists only itself.
        # Only an empty object is asked about: a file recsave reads (an index) costs no LIST. A
        # writer refuses an output dir that is any other object (CheckpointWriter._hold_lock).
        if self._local is not None or info.get("size") != 0:
            return False
        own = self._local_path(path).rstrip("/")
        try:
            entries = retry.call("listing", path, lambda: self.fs.ls(own + "/", detail=False, refresh=True)
                                 if _accepts_refresh(self.fs) else self.fs.ls(own + "/", detail=False))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return any(e.rstrip("/") != own for e in entries)

    def _info_or_none(self, path: str, what: str) -> Optional[dict]:
        try:
            return retry.call(what, path, lambda: self._fresh_info(path))
        except FileNotFoundError:
            return None

    def _fresh_info(self, path: str) -> dict:
        """fs.info asked afresh where the filesystem caches listings (s3fs, gcsfs): a cached
        answer, shared by the process and never expired, hid new checkpoints from a polling reader
        and gave it the old size of a rewritten `checkpoint` list (a cut-off id)."""
        return self.fs.info(path, refresh=True) if _accepts_refresh(self.fs) else self.fs.info(path)

    def listdir(self, path: str) -> List[str]:
        refresh = _accepts_refresh(self.fs)
        try:
            entries = retry.call("listing", path, lambda: self.fs.ls(path, detail=False, refresh=True)
                                 if refresh else self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def makedirs(self, path: str) -> None:
        self._call(lambda p: self.fs.makedirs(p, exist_ok=True), path, "creating the directory")

    def size(self, path: str) -> int:
        return int(self._call(self._fresh_info, path, "stat")["size"])

    def regular_file_size(self, path: str) -> Optional[int]:
        info = self._call(self._fresh_info, path, "stat")
        return None if info.get("type") == "directory" else int(info["size"])

    def ukey(self, path: str) -> str:
        # fsspec's default ukey hashes the whole info dict, whose keys differ between an object
        # store's HEAD and a listing (s3fs: "Key"/"Size" only in the latter), so two processes
        # could get two tokens for one file. The entity tag and size name the content wherever
        # the info came from. Asked afresh: a cached answer could not tell that the file changed.
        info = self._call(self._fresh_info, path, "stat")
        etag = info.get("ETag", info.get("etag"))
        if etag is None:
            return str(self._call(self.fs.ukey, path, "stat"))
        return f"etag:{str(etag).strip(chr(34))}:{info.get('size')}"

    def modified_at(self, path: str) -> Optional[float]:
        if self._local is not None:
            return self._local.modified_at(self._local_path(path))
        # Asked afresh, as ukey: a cached answer would keep the time of an older write.
        stamp = _last_modified(self._call(self._fresh_info, path, "stat"))
        if stamp is None:  # not in the listing's fields (memory://): the file system's own accessor
            stamp = _epoch_seconds(self._call(self._modified_or_none, path, "stat"))
        return stamp

    def _modified_or_none(self, path: str) -> Any:
        """fs.modified(path), None where the file system keeps no such time (fsspec's default
        raises NotImplementedError, which retry.call would report as a failed request)."""
        try:
            return self.fs.modified(path)
        except (NotImplementedError, IsADirectoryError):
            return None

    # ------------------------------------------------------------------------------------- removal
    def remove_tree(self, path: str) -> None:
        if _GLOB_MAGIC.search(path) is not None:
            self._remove_tree_one_by_one(path)
            return
        with contextlib.suppress(FileNotFoundError):
            retry.call("removing", path, lambda: self.fs.rm(path, recursive=True))

    def remove_empty_dir(self, path: str) -> None:
        # Pseudo-directories (memory://, markers) refuse a non-empty rmdir, as S3 refuses to delete
        # a bucket that holds objects; below a bucket an object store has no directories to remove.
        if self._local is not None:
            self._local.remove_empty_dir(self._local_path(path))
            return
        local = self._local_path(path)  # s3fs hands the path to DeleteBucket: no scheme
        if self._is_bucket(local):
            # Never a bucket: the check that says a failed export made it can be wrong (s3fs's
            # exists() is False on any error, AccessDenied or a dropped connection), and a bucket
            # deleted gives up its name. An empty bucket left behind costs nothing.
            return
        with contextlib.suppress(Exception):  # not empty, gone, or not removable: left as it is
            self.fs.rmdir(local)

    def _is_bucket(self, local: str) -> bool:
        """Whether `local` (no scheme) names a bucket or container itself: fsspec's object stores
        (s3fs, gcsfs, adlfs) split a path into bucket and key, the key empty for a bucket."""
        split = getattr(self.fs, "split_path", None)
        if not callable(split):
            return False
        try:
            return not split(local)[1]
        except Exception:  # a path the store cannot split: not removed either
            return True

    def _remove_tree_one_by_one(self, path: str) -> None:
        """remove_tree of a path holding `*`, `?` or `[`: fsspec's rm expands patterns (a directory
        named run[ab] would match runa too), and escaping them is not honoured by every fsspec
        release, so what find lists under it is removed file by file (such names are rare)."""
        try:
            found = retry.call("listing", path, lambda: self.fs.find(path, withdirs=True, detail=True))
        except FileNotFoundError:
            return
        files = [p for p, info in found.items() if info.get("type") != "directory"]
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                retry.call("removing", name, functools.partial(self.fs.rm_file, name))
        # Pseudo-directories (memory://, directory markers), deepest first; stores without them
        # have nothing to remove.
        for name in sorted([p for p in found if p not in files] + [self._local_path(path)], key=len, reverse=True):
            with contextlib.suppress(OSError, ValueError):
                self.fs.rmdir(name)

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            retry.call("removing", path, lambda: self.fs.rm_file(path))

    def abort_stale_uploads(self, path: str, marker: str,
                            ours: Callable[[Sequence[str]], Collection[str]]) -> List[str]:
        call = getattr(self.fs, "call_s3", None)  # s3fs: multipart uploads are S3's
        if call is None or self._local is not None:
            return []
        since = self._call(self._fresh_info, marker, "stat").get("LastModified")
        if since is None:
            return []
        bucket, key, _ = self.fs.split_path(path)
        prefix = key.rstrip("/") + "/" if key else ""
        stale: List[Tuple[str, str]] = []
        page: Dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            listed = retry.call("listing the unfinished uploads under", path,
                                lambda: call("list_multipart_uploads", **page))
            stale += [(u["Key"], u["UploadId"]) for u in listed.get("Uploads", []) if u["Initiated"] < since]
            if not listed.get("IsTruncated"):
                break
            page.update(KeyMarker=listed["NextKeyMarker"], UploadIdMarker=listed["NextUploadIdMarker"])
        mine = set(ours([k[len(prefix):] for k, _ in stale]))
        stale = [(k, u) for k, u in stale if k[len(prefix):] in mine]
        for upload_key, upload_id in stale:
            abort = functools.partial(call, "abort_multipart_upload", Bucket=bucket, Key=upload_key, UploadId=upload_id)
            with contextlib.suppress(FileNotFoundError):  # finished or aborted meanwhile: gone either way
                retry.call("aborting an unfinished upload of", f"{bucket}/{upload_key}", abort)
        return sorted(k[len(prefix):] for k, _ in stale)

    # --------------------------------------------------------------------------------------- reads
    def read_bytes(self, path: str, limit: int) -> bytes:
        if self._local is not None:  # one open, sized by fstat: no stat-then-read race with a rename
            return self._local.read_bytes(self._local_path(path), limit)
        return super().read_bytes(path, limit)

    def _read_raw(self, path: str, offset: int, length: int) -> bytes:
        return retry.call("reading", path, lambda: self.fs.cat_file(path, start=offset, end=offset + length))

    def open_shard(self, path: str, size: Optional[int] = None) -> ShardReader:
        return RangedShardReader(self, path, self.size(path) if size is None else size)

    def open_input(self, path: str) -> Any:
        import pyarrow as pa

        return pa.PythonFile(RangedFile(self, path, self.size(path)), mode="r")

    # -------------------------------------------------------------------------------------- writes
    def write_atomic(self, path: str, data: bytes) -> None:
        if self._local is not None:
            self._local.write_atomic(self._local_path(path), data)
            return
        self._call(lambda p: self.fs.pipe_file(p, data), path, "writing")

    def _local_path(self, path: str) -> str:
        return str(self.fs._strip_protocol(path))  # noqa: SLF001 (fsspec's public-by-convention helper)

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
        if self._local is not None:  # file://: temp + rename, as on a plain path (fsspec's opens in place)
            self._local.write_stream(self._local_path(path), produce)
            return
        total = retry.attempts()
        for attempt in range(1, total + 1):
            upload = _Upload(retry.call("opening for writing", path, lambda: self._open_upload(path)))
            try:
                produce(upload)  # type: ignore[arg-type]
                upload.close()
                return
            except _UploadError as failed:
                self._discard(upload.f, path)
                exc = failed.__cause__ or failed
                transient = retry.is_transient(exc) and not isinstance(exc, FileNotFoundError)
                if not transient or attempt == total:
                    raise retry.failed(exc, path, "writing", attempt, transient=transient) from exc
            except BaseException:  # the producer's own error: not the store's, not retried
                self._discard(upload.f, path)
                raise
            time.sleep(retry.backoff_s(attempt))

    def write_shard(self, path: str, content: ShardContent, *, durable: bool,
                    commits: Optional[Commits] = None) -> None:
        if self._local is not None:  # file://: the engine's temp file, fsync and rename, as on a plain path
            self._local.write_shard(self._local_path(path), content, durable=durable, commits=commits)
            return
        self.write_stream(path, content.write_stream)  # an upload is durable once it completes

    def create_exclusive(self, path: str, data: bytes) -> bool:
        if self._local is not None:
            return self._local.create_exclusive(self._local_path(path), data)
        if self.exists(path):
            return False
        if _creates_exclusively(self.fs):
            # A conditional put (S3 If-None-Match: *): of two writers racing, the second is refused
            # instead of both reading back their own record. A refusal after a retried put whose
            # first try did land is told apart by the read-back below.
            try:
                retry.call("creating", path, lambda: self.fs.pipe_file(path, data, mode="create"))
            except StorageError as exc:
                if not isinstance(exc.__cause__, FileExistsError):
                    raise
        else:
            self.write_atomic(path, data)
        try:
            return self.read_bytes(path, len(data)) == data
        except (CheckpointNotFoundError, CorruptCheckpointError):  # removed, or another's bigger one
            return False

    def replace_exclusive(self, path: str, expected: bytes, data: bytes) -> Optional[bool]:
        if self._local is not None:
            return self._local.replace_exclusive(self._local_path(path), expected, data)
        return None

    def being_created(self, path: str) -> bool:
        if self._local is not None:
            return self._local.being_created(self._local_path(path))
        return False  # a put publishes the whole file at once

    # ------------------------------------------------------------------------------------- helpers
    def run_detached(self, fn: Callable[[], None], name: str) -> "Future[None]":
        """On a daemon thread: a finalizer may run on any thread, fsspec's event-loop thread
        included, whose I/O `fn` needs; and with the endpoint gone botocore's timeouts could hold
        the caller for minutes."""
        return threads.start(fn, name=name, daemon=True)

    def _open_upload(self, path: str) -> Any:
        block = max(5 << 20, min(knobs.get("io_chunk_bytes"), 256 << 20))
        return self.fs.open(path, "wb", block_size=block)

    def _discard(self, f: Any, path: str) -> None:
        """Drops an unfinished upload. S3's and GCS's (s3fs, gcsfs) publish nothing before their
        close completes, so a file already at `path` is left as it was; the upload is aborted.
        Other stores may show a partial file from the open on (memory://, dbfs), which is removed."""
        with contextlib.suppress(Exception):
            if hasattr(f, "discard"):
                f.discard()
            else:
                f.close()
        if _publishes_on_close(f):
            f.closed = True  # discarded: its __del__ must not try to close (and upload) it again
            return
        with contextlib.suppress(Exception):
            self.remove_file(path)

    def _call(self, fn: Callable[[str], T], path: str, what: str) -> T:
        try:
            return retry.call(what, path, lambda: fn(path))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} does not exist", path=path) from None


class _UploadError(Exception):
    """An upload call failed (the cause): tells the store's failures from the producer's."""


class _Upload:
    """The file object write_stream hands its producer: an fsspec upload whose failures are
    marked as such."""

    def __init__(self, f: Any):
        self.f = f
        self.written = 0

    def write(self, data: Any) -> int:
        try:
            n = self.f.write(data)
        except Exception as exc:
            raise _UploadError() from exc
        self.written += memoryview(data).nbytes
        return n

    def tell(self) -> int:
        return self.written

    def flush(self) -> None:
        pass

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


# The fields in which fsspec file systems report when a file was last written: s3fs, adlfs, the
# local file system (and others), gcsfs. Not "created": on a file system that updates files in
# place, a file created long ago may have been written just now.
_MODIFIED_FIELDS = ("LastModified", "last_modified", "mtime", "updated")


def _last_modified(info: Dict[str, Any]) -> Optional[float]:
    """When a file was last written, from its fsspec info (seconds since the epoch); None when no
    field says."""
    for name in _MODIFIED_FIELDS:
        stamp = _epoch_seconds(info.get(name))
        if stamp is not None:
            return stamp
    return None


def _epoch_seconds(value: Any) -> Optional[float]:
    """A time as fsspec file systems report it (a datetime, naive ones in UTC; seconds since the
    epoch; an ISO-8601 string) in seconds since the epoch; None for anything else."""
    if isinstance(value, str):
        try:
            value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    if isinstance(value, datetime.datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=datetime.timezone.utc)
        return aware.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _creates_exclusively(fs: Any) -> bool:
    """Whether fs.pipe_file takes mode="create" (fsspec >= 2024.12: s3fs sends If-None-Match)."""
    import inspect

    try:
        return "mode" in inspect.signature(fs.pipe_file).parameters
    except (TypeError, ValueError):
        return False


def _accepts_refresh(fs: Any) -> bool:
    return getattr(fs, "protocol", None) in ("s3", "s3a", ("s3", "s3a"), "gcs", "gs", ("gcs", "gs"))


_GLOB_MAGIC = re.compile(r"[*?[]")  # what fsspec's glob-expanding calls (rm) take for patterns
