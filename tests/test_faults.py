"""Storage faults: transient remote errors are retried with backoff then reported as StorageError,
permanent ones are not retried; a save that hits ENOSPC / EIO leaves nothing behind and the previous
checkpoint latest and loadable; restore falls back past a corrupt latest checkpoint.

A fault-injecting fsspec file system (`faulty://`, an in-memory fs) drives most tests; the S3 tests
put a tiny HTTP proxy that answers 503 / drops connections in front of the real moto_server."""
from __future__ import annotations

import asyncio
import errno
import http.client
import http.server
import json
import os
import shutil
import subprocess
import threading
import uuid
import warnings
from typing import Dict, List, Optional

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
from helpers import assert_jobs_equal, job_state, make_job
from test_remote import moto_server  # noqa: F401  (the session's moto_server fixture)

import recsave
from recsave import CorruptCheckpointError, StorageError, knobs
from recsave.storage import get_storage, is_transient

FAST = dict(io_retries=3, io_retry_base_s=0.001, io_retry_max_s=0.01)


# ------------------------------------------------------------------------ fault-injecting fsspec fs
class Rule:
    def __init__(self, method: str, exc, times: int, path_contains: Optional[str] = None, skip: int = 0):
        self.method, self.exc, self.times, self.path_contains, self.skip = method, exc, times, path_contains, skip


class FaultyFile(MemoryFile):
    """Like an S3 upload: the object appears only when close() completes."""

    def write(self, data):
        self.fs._fault("write", self.path)
        return super().write(data)

    def close(self):
        if getattr(self, "_done", False):
            return
        self.fs._fault("close", self.path)
        self._done = True
        self.commit()

    def discard(self):
        self._done = True

    def __del__(self):  # IOBase.__del__ would close(), i.e. publish, an abandoned upload
        pass


class FaultyFS(MemoryFileSystem):
    """In-memory fs whose methods raise injected errors: `FaultyFS.rules` lists (method, exception,
    times, path substring, calls to let through first); `FaultyFS.calls` counts calls per method."""

    protocol = ("faulty",)
    store: Dict[str, MemoryFile] = {}
    pseudo_dirs = [""]
    rules: List[Rule] = []
    calls: Dict[str, int] = {}

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("faulty://"):
            path = path[len("faulty://"):]
        return super()._strip_protocol(path)

    def _fault(self, method: str, path) -> None:
        FaultyFS.calls[method] = FaultyFS.calls.get(method, 0) + 1
        for rule in FaultyFS.rules:
            if rule.method != method or rule.times <= 0:
                continue
            if rule.path_contains is not None and rule.path_contains not in str(path):
                continue
            if rule.skip > 0:
                rule.skip -= 1
                continue
            rule.times -= 1
            raise rule.exc() if callable(rule.exc) else rule.exc

    def exists(self, path, **kw):
        self._fault("exists", path)
        return super().exists(path, **kw)

    def isdir(self, path):
        self._fault("isdir", path)
        return super().isdir(path)

    def ls(self, path, detail=True, **kw):
        self._fault("ls", path)
        return super().ls(path, detail=detail, **kw)

    def makedirs(self, path, exist_ok=False):
        self._fault("makedirs", path)
        return super().makedirs(path, exist_ok=exist_ok)

    def info(self, path, **kw):
        self._fault("info", path)
        return super().info(path, **kw)

    def cat_file(self, path, start=None, end=None, **kw):
        self._fault("cat_file", path)
        return super().cat_file(path, start=start, end=end, **kw)

    def pipe_file(self, path, value, *args, **kw):
        self._fault("pipe_file", path)
        return super().pipe_file(path, value, *args, **kw)

    def rm(self, path, recursive=False, maxdepth=None):
        self._fault("rm", path)
        return super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path):
        self._fault("rm_file", path)
        return super().rm_file(path)

    def _open(self, path, mode="rb", **kw):
        self._fault("open", path)
        if mode in ("wb", "xb"):
            f = FaultyFile(self, self._strip_protocol(path), kw.get("data"))
            if kw.get("data") is not None:  # pipe_file: one put
                f.commit()
                f._done = True
            return f
        return super()._open(path, mode, **kw)


fsspec.register_implementation("faulty", FaultyFS, clobber=True)


@pytest.fixture
def faulty():
    """A fresh root on faulty://, no rules, counters at zero."""
    FaultyFS.rules, FaultyFS.calls = [], {}
    root = f"faulty://t-{uuid.uuid4().hex}"
    with knobs.override(**FAST):
        yield root
    FaultyFS.rules, FaultyFS.calls = [], {}
    FaultyFS.store.clear()
    FaultyFS.pseudo_dirs[:] = [""]


def inject(method: str, exc, times: int = 1, path_contains: Optional[str] = None, skip: int = 0) -> Rule:
    rule = Rule(method, exc, times, path_contains, skip)
    FaultyFS.rules.append(rule)
    return rule


def _names(url: str) -> List[str]:
    return [n for n in get_storage(url).listdir(url) if n != ".recsave-writer.lock"]


def _saved_job(out: str, steps: int = 2):
    job = make_job(out, max_keep=3)
    job.train(steps)
    job.saver.save(f"ckpt_{steps}")
    return job, job_state(job)


def _assert_restores(out: str, state, step: int) -> None:
    fresh = make_job(out)
    assert fresh.saver.latest_checkpoint().endswith(f"/ckpt_{step}")
    fresh.saver.load()
    assert_jobs_equal(job_state(fresh), state)


# ------------------------------------------------------------------------------ classification
def test_transient_and_permanent_errors_are_told_apart():
    from botocore.exceptions import ClientError, EndpointConnectionError, HTTPClientError, ReadTimeoutError

    def client_error(code, status):
        return ClientError({"Error": {"Code": code, "Message": "m"},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert is_transient(client_error("ServiceUnavailable", 503))
    assert is_transient(client_error("SlowDown", 503))
    assert is_transient(client_error("InternalError", 500))
    assert is_transient(client_error("ThrottlingException", 400))
    assert not is_transient(client_error("AccessDenied", 403))
    assert not is_transient(client_error("NoSuchKey", 404))
    assert is_transient(client_error("OperationAborted", 409))  # S3: "try again"
    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://x"))
    assert is_transient(asyncio.TimeoutError()) and is_transient(ConnectionResetError())
    # s3fs translates a ClientError into an OSError whose cause is the original.
    try:
        try:
            raise client_error("ServiceUnavailable", 503)
        except ClientError as e:
            raise OSError(errno.EBUSY, "Service Unavailable") from e
    except OSError as translated:
        assert is_transient(translated)
    assert is_transient(OSError(errno.EIO, "remote error"))

    class ClientSideStatus(Exception):  # aiohttp's error for a garbled status line carries a 400 of its own
        status = 400
    try:
        try:
            raise ClientSideStatus("Bad status line")
        except ClientSideStatus as e:
            raise HTTPClientError(error=ValueError("garbled status line")) from e
    except HTTPClientError as wrapped:
        assert is_transient(wrapped)  # the transient HTTPClientError decides, not a status of the client's
    # A code s3fs does not map comes as OSError(EIO); the server's 4xx answer under it decides.
    for code, status, transient in (("XAmzContentSHA256Mismatch", 400, False), ("KMS.DisabledException", 400, False),
                                    ("SlowDown", 503, True), ("OperationAborted", 409, True)):
        try:
            try:
                raise client_error(code, status)
            except ClientError as e:
                raise OSError(errno.EIO, code) from e
        except OSError as translated:
            assert is_transient(translated) is transient, code
    assert not is_transient(PermissionError(errno.EACCES, "denied"))
    assert not is_transient(FileNotFoundError(errno.ENOENT, "gone"))
    assert not is_transient(OSError(errno.ENOSPC, "full"))
    assert not is_transient(ValueError("bad"))
    import aiohttp

    assert is_transient(aiohttp.ServerDisconnectedError())
    assert is_transient(aiohttp.ClientConnectionError())


# ------------------------------------------------------------------------------ retries (faulty://)
@pytest.mark.parametrize("method", ["ls", "makedirs", "info", "cat_file", "pipe_file",
                                    "rm", "open", "write", "close"])
def test_transient_errors_are_retried_and_the_save_round_trips(faulty, method):
    out = f"{faulty}/run"
    job = make_job(out, max_keep=1)
    job.train(2)
    job.saver.save("ckpt_1")  # a second save below prunes ckpt_1: exercises rm
    job.train(1)
    FaultyFS.calls = {}
    errors = [ConnectionResetError, TimeoutError, lambda: OSError(errno.EBUSY, "SlowDown")]
    for exc in errors:
        inject(method, exc, times=1)
    job.saver.save("ckpt_3")
    job.saver.wait()  # the pruning of ckpt_1 (its rm) ends on a thread
    state = job_state(job)
    assert FaultyFS.calls.get(method, 0) > 3, f"{method} was not called / retried: {FaultyFS.calls}"
    assert all(r.times == 0 for r in FaultyFS.rules), "every injected fault fired"
    for exc in errors:
        inject(method, exc, times=1)
    _assert_restores(out, state, 3)
    assert _names(out) == ["checkpoint", "ckpt_3"]


def test_exhausted_retries_raise_storage_error_naming_path_operation_attempts(faulty):
    path = f"{faulty}/x/blob"
    st = get_storage(path)
    inject("pipe_file", lambda: OSError(errno.EBUSY, "Service Unavailable"), times=100)
    with knobs.override(io_retries=4):
        with pytest.raises(StorageError) as exc:
            st.write_atomic(path, b"data")
    assert FaultyFS.calls["pipe_file"] == 5
    msg = str(exc.value)
    assert path in msg and "writing" in msg and "5 attempt" in msg and "Service Unavailable" in msg
    assert exc.value.errno == errno.EBUSY and exc.value.path == path
    assert isinstance(exc.value.__cause__, OSError)


def test_backoff_grows_and_is_capped(faulty, monkeypatch):
    from recsave.storage import retry as storage_mod

    slept: List[float] = []
    monkeypatch.setattr(storage_mod.time, "sleep", slept.append)
    inject("cat_file", TimeoutError, times=100)
    st = get_storage(faulty)
    st.write_atomic(f"{faulty}/f", b"abc")
    with knobs.override(io_retries=6, io_retry_base_s=0.1, io_retry_max_s=0.5):
        with pytest.raises(StorageError, match="7 attempt"):
            st.read_range(f"{faulty}/f", 0, 3)
    assert len(slept) == 6
    bounds = [0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    assert all(b / 2 <= s <= b for s, b in zip(slept, bounds)), slept


@pytest.mark.parametrize("exc", [lambda: PermissionError(errno.EACCES, "Access Denied"),
                                 lambda: OSError(errno.EINVAL, "InvalidArgument"),
                                 lambda: OSError(errno.ENOSPC, "No space left")])
def test_permanent_errors_are_not_retried(faulty, exc):
    inject("pipe_file", exc, times=100)
    st = get_storage(faulty)
    with pytest.raises(StorageError, match="not retried") as err:
        st.write_atomic(f"{faulty}/a", b"x")
    assert FaultyFS.calls["pipe_file"] == 1
    assert err.value.errno == exc().errno


def test_a_transient_error_is_not_read_as_missing(faulty):
    st = get_storage(faulty)
    st.write_atomic(f"{faulty}/d/f", b"x")
    inject("info", TimeoutError, times=2)
    assert st.exists(f"{faulty}/d/f")
    inject("info", ConnectionResetError, times=2)
    assert st.isdir(f"{faulty}/d")
    assert FaultyFS.calls["info"] == 6
    inject("info", TimeoutError, times=100)
    with pytest.raises(StorageError, match="checking"):
        st.exists(f"{faulty}/d/f")


def test_missing_files_are_not_retried(faulty):
    st = get_storage(faulty)
    with pytest.raises(FileNotFoundError):
        st.size(f"{faulty}/nope")
    assert FaultyFS.calls["info"] == 1
    assert st.listdir(f"{faulty}/nodir") == []


def test_streaming_write_replays_after_a_transient_failure(faulty):
    path = f"{faulty}/big"
    st = get_storage(path)
    pieces = [bytes([i]) * 1000 for i in range(10)]
    inject("write", ConnectionResetError, times=2, skip=4)  # the 5th and 6th write fail
    inject("close", TimeoutError, times=1)
    with st.open_write(path) as f:
        for p in pieces:
            f.write(memoryview(p))
    assert st.read_range(path, 0, 10000) == b"".join(pieces)


def test_write_stream_retries_by_producing_again_and_keeps_no_buffer(faulty):
    """A retried upload runs the producer again: a producer that reuses one buffer for every piece
    (as the CUDA gather does with its pinned buffers) still publishes the right bytes."""
    path = f"{faulty}/big"
    st = get_storage(path)
    runs = []

    def produce(f):
        runs.append(1)
        buf = bytearray(1000)
        for i in range(10):
            buf[:] = bytes([i]) * 1000
            f.write(memoryview(buf))

    inject("write", ConnectionResetError, times=1, skip=4)  # the 5th write fails
    inject("close", TimeoutError, times=1)
    st.write_stream(path, produce)
    assert len(runs) == 3
    assert st.read_range(path, 0, 10000) == b"".join(bytes([i]) * 1000 for i in range(10))


def test_write_stream_does_not_retry_the_producers_own_error_or_a_permanent_one(faulty):
    path = f"{faulty}/big"
    st = get_storage(path)
    runs = []

    def failing_producer(f):
        runs.append(1)
        f.write(b"partial")
        raise KeyError("source gone")

    with pytest.raises(KeyError):
        st.write_stream(path, failing_producer)
    assert len(runs) == 1 and not st.exists(path)
    inject("write", lambda: PermissionError(errno.EACCES, "denied"), times=100)
    with pytest.raises(StorageError, match="not retried"):
        st.write_stream(path, lambda f: f.write(b"x" * 100))
    assert not st.exists(path)


@pytest.mark.parametrize("failing", ["write", "close"])
def test_failed_streaming_write_publishes_nothing(faulty, failing):
    path = f"{faulty}/big"
    st = get_storage(path)
    inject(failing, lambda: PermissionError(errno.EACCES, "denied"), times=1, skip=1 if failing == "write" else 0)
    with pytest.raises(StorageError):
        with st.open_write(path) as f:
            f.write(b"a" * 100)
            f.write(b"b" * 100)
    assert not st.exists(path)
    # An error of the caller inside the block: nothing published either.
    with pytest.raises(RuntimeError):
        with st.open_write(path) as f:
            f.write(b"partial")
            raise RuntimeError("caller failed")
    assert not st.exists(path)


# ------------------------------------------------------------- ENOSPC / EIO at moments of a save
MOMENTS = {  # what the save writes -> (fs method, path substring)
    "shard": ("write", "sparse-"),
    "shard_close": ("close", "sparse-"),
    "model.pt": ("pipe_file", "model.pt"),
    "index": ("pipe_file", "/index"),
    "checkpoint": ("pipe_file", "/checkpoint"),
}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("moment", sorted(MOMENTS))
def test_disk_full_or_io_error_during_a_save(faulty, moment, code):
    out = f"{faulty}/run"
    job, at_2 = _saved_job(out)
    job.train(1)
    method, where = MOMENTS[moment]
    rule = inject(method, lambda: OSError(code, os.strerror(code)), times=100, path_contains=where)
    with pytest.raises(StorageError) as exc:
        job.saver.save("ckpt_3")
    assert exc.value.errno == code
    assert where.strip("/") in str(exc.value)
    fired = 100 - rule.times
    assert fired == (1 if code == errno.ENOSPC else knobs.get("io_retries") + 1)  # EIO is retried
    FaultyFS.rules = []
    assert _names(out) == ["checkpoint", "ckpt_2"]  # the partial ckpt_3 is gone
    assert job.saver.checkpoints() == [f"{out}/ckpt_2"]
    _assert_restores(out, at_2, 2)


# ------------------------------------------------------------------- a real full disk (tmpfs)
@pytest.fixture
def tiny_tmpfs(tmp_path):
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a 2 MB tmpfs needs root (os.geteuid() != 0); the faulty:// ENOSPC tests "
                    "cover the same paths")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount -t tmpfs was refused here (rc {proc.returncode}: {proc.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_real_full_disk_leaves_previous_checkpoint(tiny_tmpfs):
    out = str(tiny_tmpfs / "run")
    job, at_2 = _saved_job(out)
    job.model.user(torch.arange(1, 120_001, dtype=torch.int64))  # ~8 MB of new rows: cannot fit in 2 MB
    with pytest.raises(StorageError) as exc:
        job.saver.save("ckpt_3")
    assert exc.value.errno == errno.ENOSPC
    assert sorted(n for n in os.listdir(out) if n != ".recsave-writer.lock") == ["checkpoint", "ckpt_2"]
    job.saver.close()
    _assert_restores(out, at_2, 2)


# ------------------------------------------------------------------------- fallback restore
def _corrupt_latest(out: str, job) -> str:
    ckpt = job.saver.latest_checkpoint()
    index = json.loads(open(os.path.join(ckpt, "index"), "rb").read())
    (chunk,) = index["tensors"]["user@embedding"]["chunks"]
    path = os.path.join(ckpt, chunk["file"])
    data = bytearray(open(path, "rb").read())
    data[chunk["offset"] + chunk["length"] // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    return ckpt


@pytest.mark.parametrize("damage", ["flip", "delete_index", "delete_dir"])
def test_restore_falls_back_past_a_bad_latest(tmp_path, damage):
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=3, max_keep=3)
    job.train(3)
    at_3 = job_state(job)
    job.train(3)  # ckpt_6
    bad = job.saver.latest_checkpoint()
    if damage == "flip":
        _corrupt_latest(out, job)
    elif damage == "delete_index":
        os.remove(os.path.join(bad, "index"))
    else:
        shutil.rmtree(bad)
    job.saver.close()

    strict = make_job(out, save_interval=3)
    with pytest.raises((CorruptCheckpointError, recsave.CheckpointNotFoundError)):
        strict.manager.restore(fallback=False)
    with pytest.raises((CorruptCheckpointError, recsave.CheckpointNotFoundError)):
        strict.saver.load()

    fresh = make_job(out, save_interval=3)
    with pytest.warns(RuntimeWarning, match="ckpt_6.*falling back.*ckpt_3"):
        assert fresh.manager.restore() == 3
    assert_jobs_equal(job_state(fresh), at_3)

    other = make_job(out, save_interval=3)
    with pytest.warns(RuntimeWarning, match="ckpt_6"):
        report = other.saver.load(fallback=True)
    assert report.checkpoints == [os.path.join(out, "ckpt_3")] and report.step == 3
    assert_jobs_equal(job_state(other), at_3)


def test_fallback_gives_up_when_every_checkpoint_is_bad(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=2)
    job.train(4)
    for ckpt in job.saver.checkpoints():
        os.remove(os.path.join(ckpt, "index"))
    fresh = make_job(out, save_interval=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(recsave.CheckpointNotFoundError, match="ckpt_2"):
            fresh.manager.restore()
    assert len([w for w in caught if "falling back" in str(w.message)]) == 1


def test_fallback_is_not_used_for_an_explicit_step(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=2)
    job.train(4)
    os.remove(os.path.join(job.saver.latest_checkpoint(), "index"))
    with pytest.raises(recsave.CheckpointNotFoundError):
        make_job(out, save_interval=2).manager.restore(4)


# -------------------------------------------------------------------- S3: faults through a proxy
class FaultProxy:
    """HTTP proxy on 127.0.0.1 in front of moto_server. `plan` is a list of actions for the next
    requests ("503", "drop", anything else forwards); `fail_methods` answers 503 to every request
    of those HTTP methods."""

    def __init__(self, upstream: str):
        self.host, self.port = upstream.split("//", 1)[1].split(":")
        self.plan: List[str] = []
        self.fail_methods: set = set()
        self.injected = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    planned = proxy.plan.pop(0) if proxy.plan else "ok"
                    action = "503" if self.command in proxy.fail_methods else planned
                    if action != "ok":
                        proxy.injected += 1
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if action == "503":
                    payload = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
                               b'<Message>injected by the test proxy</Message></Error>')
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.host, int(proxy.port), timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "expect")}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                head = self.command == "HEAD"  # a HEAD answer has the object's length, no body
                self.send_header("Content-Length", resp.getheader("Content-Length", "0") if head else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def s3_proxy(moto_server, monkeypatch):
    """A fresh bucket reached through a FaultProxy; botocore's own retries are off (AWS_MAX_ATTEMPTS=1)
    so recsave's retries are what is tested."""
    import s3fs

    proxy = FaultProxy(moto_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"recsave-faults-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    try:
        yield proxy, f"s3://{bucket}"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        proxy.close()


@pytest.mark.s3
def test_s3_save_and_restore_survive_503s_and_dropped_connections(s3_proxy):
    import s3fs

    proxy, root = s3_proxy
    out = f"{root}/run"
    with knobs.override(io_retries=5, io_retry_base_s=0.01, io_retry_max_s=0.05):
        job = make_job(out)
        job.train(2)
        proxy.plan = ["503", "503", "ok", "drop", "ok", "ok", "503"] * 3
        job.saver.save("ckpt_2")
        at_2 = job_state(job)
        assert proxy.injected >= 9
        job.saver.close()
        s3fs.S3FileSystem.clear_instance_cache()
        proxy.plan, proxy.injected = ["503", "ok", "drop", "ok", "503", "503"] * 3, 0
        fresh = make_job(out)
        fresh.saver.load()
        assert proxy.injected >= 9
    assert_jobs_equal(job_state(fresh), at_2)


@pytest.mark.s3
def test_s3_permanently_failing_endpoint_fails_the_save_and_keeps_the_previous(s3_proxy):
    import s3fs

    proxy, root = s3_proxy
    out = f"{root}/run"
    with knobs.override(io_retries=2, io_retry_base_s=0.01, io_retry_max_s=0.02):
        job = make_job(out)
        job.train(2)
        job.saver.save("ckpt_2")
        at_2 = job_state(job)
        job.train(1)
        proxy.fail_methods = {"PUT", "POST"}  # every upload fails; reads and deletes work
        with pytest.raises(StorageError, match="3 attempt") as exc:
            job.saver.save("ckpt_3")
        assert "injected by the test proxy" in str(exc.value) and "writing" in str(exc.value)
        proxy.fail_methods = set()
        assert _names(out) == ["checkpoint", "ckpt_2"]
        proxy.fail_methods = {"GET", "HEAD", "PUT", "POST", "DELETE"}  # the store is down
        with pytest.raises(StorageError, match="3 attempt") as exc:
            job.saver.save("ckpt_4")
        # a HEAD (stats are asked afresh) carries no body: the status, not the proxy's text
        assert "injected by the test proxy" in str(exc.value) or "Service Unavailable" in str(exc.value)
        proxy.fail_methods = set()
    job.saver.close()
    s3fs.S3FileSystem.clear_instance_cache()
    assert _names(out) == ["checkpoint", "ckpt_2"]
    _assert_restores(out, at_2, 2)


def test_training_on_after_a_fallback_replaces_the_damaged_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=3, max_keep=3)
    job.train(6)  # ckpt_3, ckpt_6
    _corrupt_latest(out, job)
    job.saver.close()

    fresh = make_job(out, save_interval=3, max_keep=3)
    with pytest.warns(RuntimeWarning, match="ckpt_6"):
        assert fresh.manager.restore() == 3
    fresh.train(3)  # autosaves ckpt_6 again: the damaged one must be replaced, not returned
    assert fresh.saver.latest_checkpoint() == os.path.join(out, "ckpt_6")
    fresh.saver.close()
    check = make_job(out, save_interval=3)
    assert check.manager.restore(fallback=False) == 6
    assert_jobs_equal(job_state(check), job_state(fresh))


@pytest.mark.parametrize("err", [recsave.FormatVersionError("newer format"), recsave.UsageError("bad call"),
                                 recsave.CorruptCheckpointError("damaged")])
def test_recsave_errors_pass_through_remote_retries_unwrapped(err):
    """storage.retry.call retries transient I/O only: an error of recsave's own (a newer format, a
    usage error, damage) raises as it is, at once, never re-wrapped as a StorageError."""
    from recsave.storage import retry

    calls = []

    def fail():
        calls.append(1)
        raise err

    with pytest.raises(type(err)) as exc:
        retry.call("reading", "memory://x/index", fail)
    assert exc.value is err and not isinstance(exc.value, recsave.StorageError) and len(calls) == 1
