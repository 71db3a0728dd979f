"""Save / restore / rotation / model-bank warm start through fsspec: `memory://` and `s3://` against a
real moto_server on 127.0.0.1 (started here; if it cannot start, the S3 tests fail — never skip)."""
from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from typing import Iterator, Tuple

import fsspec
import pytest
import torch
from helpers import assert_jobs_equal, job_state, make_job, same_bits, save_outliving_the_lease, train

import recsave
from recsave import CorruptCheckpointError
from recsave.errors import UsageError
from recsave.storage import get_storage
from recsave.storage.lock import LOCK_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _running_moto(tmp_dir) -> Iterator[Tuple[str, subprocess.Popen]]:
    """A moto S3 server on a free local port: (its URL, its process)."""
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "moto.server"]
    port = _free_port()
    log = tmp_dir / "moto.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd + ["-H", "127.0.0.1", "-p", str(port)], stdout=log_file,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moto_server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not answer on {url} within 60 s:\n{log.read_text()}")
                time.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # in case a test stopped it
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """The session's moto server; s3fs / botocore reach it through AWS_ENDPOINT_URL (read by
    botocore >= 1.31 when a client is made, so every S3FileSystem uses it)."""
    with _running_moto(tmp_path_factory.mktemp("moto")) as (url, _):
        saved = {k: os.environ.get(k) for k in list(S3_ENV) + ["AWS_ENDPOINT_URL"]}
        os.environ.update(S3_ENV, AWS_ENDPOINT_URL=url)
        try:
            yield url
        finally:
            # Savers a test left unclosed release their S3 writer lock in a finalizer: run those
            # now, while the server answers, rather than give each the release timeout at exit.
            gc.collect()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _clear_fs_caches():
    """What a new process would see: no cached file system instances or listings."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(params=["memory", pytest.param("s3", marks=pytest.mark.s3)])
def remote(request):
    """A fresh, empty remote root URL on each backend."""
    if request.param == "memory":
        root = f"memory://recsave-test-{uuid.uuid4().hex}"
        yield root
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)
        return
    request.getfixturevalue("moto_server")
    import s3fs

    _clear_fs_caches()
    bucket = f"recsave-{uuid.uuid4().hex[:16]}"
    fs = s3fs.S3FileSystem()
    fs.mkdir(bucket)
    assert fs.exists(bucket), "the bucket was not created on moto_server"
    yield f"s3://{bucket}"
    _clear_fs_caches()


def _fs(url):
    return fsspec.core.url_to_fs(url)[0]


def _ls(url):
    """Names directly under `url` (fresh listing)."""
    storage = get_storage(url)
    return [n for n in storage.listdir(url) if n != LOCK_FILE]


def _read(url):
    return get_storage(url).read_range(url, 0, get_storage(url).size(url))


def _write(url, data):
    get_storage(url).write_atomic(url, data)


def test_save_restore_round_trip(remote):
    out = f"{remote}/run"
    job = make_job(out, save_interval=4, max_keep=3)
    job.train(9)  # ckpt_4, ckpt_8
    assert _read(f"{out}/checkpoint") == b"ckpt_4\nckpt_8\n"
    files = _ls(f"{out}/ckpt_8")
    shards = [f for f in files if f.startswith("sparse-")]
    assert shards and set(files) - set(shards) == {"index", "model.pt", "extra.pt", "io_state_0.pt",
                                                   "io_state_count"}
    assert job.saver.latest_checkpoint() == f"{out}/ckpt_8"
    if remote.startswith("s3://"):  # the objects really are on the server
        import boto3

        bucket = remote[len("s3://"):]
        keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="run/ckpt_8/")["Contents"]}
        assert keys == {f"run/ckpt_8/{f}" for f in files}
    job.manager.save()  # ckpt_9
    at_9 = job_state(job)

    if remote.startswith("s3://"):
        _clear_fs_caches()
    fresh = make_job(out, save_interval=4, max_keep=3)
    assert fresh.manager.restore() == 9
    assert_jobs_equal(job_state(fresh), at_9)
    older = make_job(out, save_interval=4)
    assert older.manager.restore(4) == 4 and older.reader.offset == 4
    # Training on from the restored state matches training on without a restart.
    job.train(2)
    fresh.train(2)
    assert_jobs_equal(job_state(fresh), job_state(job))


def test_restore_with_nothing_committed(remote):
    out = f"{remote}/empty_run"
    job = make_job(out, save_interval=5)
    job.train(1)
    before = job_state(job)
    assert job.manager.restore() == 0
    assert_jobs_equal(job_state(job), before)
    assert not _fs(remote).exists(f"{out}/checkpoint")


def test_rotation_prunes_earlier_checkpoints_and_keeps_unrelated_objects(remote):
    out = f"{remote}/run"
    first = make_job(out, max_keep=None)
    for step in range(1, 5):
        first.train(1)
        first.saver.save(f"ckpt_{step}")
    _write(f"{out}/notes.txt", b"keep me")
    _write(f"{out}/logs/train.log", b"step 4")
    assert _read(f"{out}/checkpoint") == b"ckpt_1\nckpt_2\nckpt_3\nckpt_4\n"

    if remote.startswith("s3://"):
        _clear_fs_caches()
    first.saver.close()  # one writer per output dir
    second = make_job(out, max_keep=2)
    second.saver.load()
    second.train(1)
    second.saver.save("ckpt_5")
    assert _read(f"{out}/checkpoint") == b"ckpt_4\nckpt_5\n"
    second.saver.wait()  # the pruned checkpoints' objects go on a thread, their indexes in the save
    assert _ls(out) == ["checkpoint", "ckpt_4", "ckpt_5", "logs", "notes.txt"]
    assert _read(f"{out}/notes.txt") == b"keep me" and _read(f"{out}/logs/train.log") == b"step 4"
    assert second.saver.checkpoints() == [f"{out}/ckpt_4", f"{out}/ckpt_5"]


def test_rotation_in_a_dir_named_like_a_glob_deletes_only_its_own_checkpoints(remote):
    """fsspec's rm expands patterns: rotation in run[ab] removed runa's checkpoint too (and left
    its own, without its index). Each pattern character is taken as itself now."""
    other = make_job(f"{remote}/runa", max_keep=None)
    other.train(1)
    other.saver.save("ckpt_1")
    other.saver.close()
    for name in ("run[ab]", "run*", "run?"):
        job = make_job(f"{remote}/{name}", max_keep=1)
        job.train(1)
        job.saver.save("ckpt_1")
        job.train(1)
        job.saver.save("ckpt_2")
        job.saver.close()
        assert _ls(f"{remote}/{name}") == ["checkpoint", "ckpt_2"]
    assert _ls(f"{remote}/runa") == ["checkpoint", "ckpt_1"]
    make_job(f"{remote}/runa").saver.load()


def test_uncommitted_leftover_is_not_latest_and_is_removed(remote):
    out = f"{remote}/run"
    job = make_job(out, max_keep=3)
    job.train(2)
    job.saver.save("ckpt_2")
    at_2 = job_state(job)
    # A crashed save: a shard file but no index, not listed.
    _write(f"{out}/ckpt_3/sparse-0-0.safetensors", b"partial")
    job.saver.close()
    fresh = make_job(out)
    assert fresh.saver.latest_checkpoint() == f"{out}/ckpt_2"
    fresh.saver.load()
    assert_jobs_equal(job_state(fresh), at_2)
    fresh.saver.save("ckpt_4")
    fresh.saver.wait()
    assert _ls(out) == ["checkpoint", "ckpt_2", "ckpt_4"]


def test_gc_aborts_the_uploads_a_killed_writer_left(remote):
    """A writer killed mid-upload leaves a multipart upload: invisible, yet stored until aborted.
    gc aborts those under the output dir begun before it took the lock; others stay."""
    from recsave.tools import catalog

    out = f"{remote}/run"
    job = make_job(out)
    job.train(2)
    job.saver.save("ckpt_2")
    job.saver.close()
    if not remote.startswith("s3://"):  # memory:// has no multipart uploads
        assert catalog.clean_output_dir(out)["aborted_uploads"] == []
        return
    fs = _fs(remote)
    bucket = remote[len("s3://"):]
    # Not ours: outside the output dir, another program's files inside it (a model exported next
    # to the checkpoints has a checkpoint's file names), and a save into an output dir below it.
    theirs = ["elsewhere/big.bin", "run/logs/tensorboard/events.out", "run/notes.txt", "run/export/model.pt",
              "run/eval/index", "run/nested/ckpt_9/sparse-0-0.safetensors"]
    fs.pipe(f"{bucket}/run/ckpt_4/io_state_0.pt", b"x")  # the killed writer's files before model.pt
    # Killed writers' uploads of the names anyone's files may have: recognised by a finished file
    # (ckpt_4, removed by gc as a leftover first), or by another upload beside them (ckpt_5).
    ours = ["run/ckpt_4/sparse-0-0.safetensors", "run/ckpt_4/model.pt", "run/ckpt_5/io_state_1.pt",
            "run/ckpt_5/extra.pt"]
    begun = {key: fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
             for key in [*ours, *theirs]}
    time.sleep(1.1)  # the lock's LastModified has whole seconds
    done = catalog.clean_output_dir(out)
    assert done["aborted_uploads"] == sorted(k[len("run/"):] for k in ours)
    left = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert sorted((u["Key"], u["UploadId"]) for u in left) == sorted((k, begun[k]) for k in theirs)
    assert catalog.clean_output_dir(out)["aborted_uploads"] == []
    assert make_job(out).saver.latest_checkpoint() == f"{out}/ckpt_2"


def test_flipped_byte_is_detected(remote):
    out = f"{remote}/run"
    job = make_job(out)
    job.train(2)
    ckpt = job.saver.save("ckpt_2")
    index = json.loads(_read(f"{ckpt}/index"))
    (chunk,) = index["tensors"]["user@embedding"]["chunks"]
    data = bytearray(_read(f"{ckpt}/{chunk['file']}"))
    data[chunk["offset"] + chunk["length"] // 2] ^= 0x01
    _write(f"{ckpt}/{chunk['file']}", bytes(data))
    with pytest.raises(CorruptCheckpointError, match=chunk["file"]):
        make_job(out).saver.load()


def test_model_bank_warm_start(remote, tmp_path):
    bank1, bank2 = f"{remote}/bank/v1", f"{remote}/bank/v2"
    j1 = make_job(bank1)
    j1.train(4)
    j1.saver.save("ckpt_4")
    s1 = job_state(j1)
    j2 = make_job(bank2, seed=3)
    train(j2.model, j2.opts, 3, start=400)
    j2.saver.save("ckpt_3")
    s2 = job_state(j2)

    if remote.startswith("s3://"):
        _clear_fs_caches()
    # A new run (its own output dir, here local) warm-starts from the bank.
    job = make_job(str(tmp_path / "run"), save_interval=10)
    report = job.manager.load_model_bank([
        {"path": bank2, "load": ["*"], "exclude": ["io_state", "global_step"]},
        {"path": f"{bank1}/ckpt_4", "load": ["user*", "mlp.*"]},
    ])
    assert report.loaded["user"].checkpoint == f"{bank1}/ckpt_4"
    assert report.loaded["item"].checkpoint == f"{bank2}/ckpt_3"
    after = job_state(job)
    for key in after["model"]:
        src = s1 if key.startswith(("user@", "mlp.")) else s2
        assert same_bits(after["model"][key], src["model"][key]), key
    assert after["reader"] == 0  # io_state excluded
    assert job.manager.global_step == 0


def test_resharding_load_reads_only_owned_buckets(remote, monkeypatch):
    """A checkpoint on remote storage loaded by rank 1 of 3 (the environment says so): exactly that
    rank's ids, bit for bit, reading about a third of the sparse bytes through ranged requests."""
    import torch
    from helpers import table_state

    from recsave import partition
    from recsave.format import read_index

    monkeypatch.setenv("RECSAVE_MIN_SEGMENT_BYTES", "256")  # fine segments for these tiny tables
    out = f"{remote}/run"
    job = make_job(out)
    job.train(6)
    job.saver.save("ckpt_6")
    if remote.startswith("s3://"):
        _clear_fs_caches()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    fresh = make_job(out)
    report = fresh.saver.load(load_conf={"exclude": ["io_state"]})
    for name in ("user", "item"):
        want = table_state(getattr(job.model, name))
        keep = partition.owner_of(want["@id"], 3) == 1
        got = table_state(getattr(fresh.model, name))
        for k in want:
            assert torch.equal(got[k], want[k][keep]), (name, k)
    index = read_index(f"{out}/ckpt_6", get_storage(out))
    sparse = sum(t.nbytes for t in index.tensors.values())
    assert report.bytes_read - sum(i.nbytes for n, i in report.loaded.items() if i.category == "dense") < sparse * 0.5


@pytest.mark.s3
@pytest.mark.parametrize("pending", ["nothing", "async_save"])
def test_exit_releases_the_s3_lock_and_commits_a_pending_async_save(tmp_path, pending):
    """A script that ends without close(): the exit releases the writer lock (a restart on another
    host must not wait writer_lease_s) and lets a running async_save commit (on S3 its shards are
    streamed, gathering blocks on a thread of their own)."""
    with _running_moto(tmp_path) as (url, _server):
        env = dict(os.environ, **S3_ENV, AWS_ENDPOINT_URL=url, RECSAVE_WRITER_LOCK="1",
                   PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
        bucket = f"recsave-{uuid.uuid4().hex[:16]}"
        script = textwrap.dedent(f"""
            import s3fs
            from helpers import make_job
            s3fs.S3FileSystem().mkdir("{bucket}")
            job = make_job("s3://{bucket}/run", max_keep=None)
            job.train(1)
            job.saver.save("ckpt_1")
            if {pending == "async_save"!r}:
                job.train(1)
                job.saver.async_save("ckpt_2")
            """)
        child = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                               text=True, timeout=300)
        assert child.returncode == 0, child.stderr
        assert "failed" not in child.stderr, child.stderr
        import s3fs

        fs = s3fs.S3FileSystem(key=S3_ENV["AWS_ACCESS_KEY_ID"], secret=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                               client_kwargs={"endpoint_url": url, "region_name": "us-east-1"},
                               skip_instance_cache=True)
        assert not fs.exists(f"{bucket}/run/{LOCK_FILE}")
        listed = fs.cat(f"{bucket}/run/checkpoint").decode().split()
        assert listed == (["ckpt_1", "ckpt_2"] if pending == "async_save" else ["ckpt_1"])


@pytest.mark.s3
def test_exit_is_not_held_up_by_a_hung_endpoint(tmp_path):
    """An unclosed Saver's S3 writer lock is released at interpreter exit. With the server hung
    (stopped: connections are accepted by the kernel and never answered), the exit gives up after
    lock_release_timeout_s instead of waiting out botocore's timeouts times io_retries; the lock is
    left behind, to be taken over as stale."""
    with _running_moto(tmp_path) as (url, server):
        env = dict(os.environ, **S3_ENV, AWS_ENDPOINT_URL=url, RECSAVE_WRITER_LOCK="1",
                   RECSAVE_LOCK_RELEASE_TIMEOUT_S="2", PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
        bucket = f"recsave-{uuid.uuid4().hex[:16]}"
        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import sys, s3fs
            from helpers import make_job
            s3fs.S3FileSystem().mkdir("{bucket}")
            job = make_job("s3://{bucket}/run")
            job.saver.save("ckpt_0")
            print("ready", flush=True)
            sys.stdin.read()
            """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, cwd=ROOT)
        try:
            assert select.select([child.stdout], [], [], 120)[0], "the child did not get ready in 120 s"
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
            os.kill(server.pid, signal.SIGSTOP)
            started = time.monotonic()
            child.stdin.close()
            assert child.wait(timeout=60) == 0, child.stderr.read()
            took = time.monotonic() - started
        finally:
            os.kill(server.pid, signal.SIGCONT)
            if child.poll() is None:
                child.kill()
                child.wait()
        assert took < 30, f"exit took {took:.1f} s with the endpoint hung"
        import s3fs

        fs = s3fs.S3FileSystem(key=S3_ENV["AWS_ACCESS_KEY_ID"], secret=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                               client_kwargs={"endpoint_url": url, "region_name": "us-east-1"},
                               skip_instance_cache=True)
        assert fs.exists(f"{bucket}/run/{LOCK_FILE}")  # left behind, taken over as stale later


def test_a_files_ukey_is_the_same_from_a_listing_and_from_a_stat(remote):
    """Another rank takes rank 0's index bytes only when its ukey of the file equals rank 0's
    (load/shared_reads.py); a rank whose fsspec cache holds the file from a directory listing must
    get the same token as one that asked the store about the file alone."""
    storage = get_storage(remote)
    path = storage.join(remote, "ckpt_1", "index")
    storage.write_atomic(path, b"x" * 1000)
    _clear_fs_caches() if remote.startswith("s3") else None
    fresh = get_storage(remote).ukey(path)
    fs = _fs(remote)
    fs.ls(storage.join(remote, "ckpt_1"), detail=True)  # the listing fills the cache
    assert get_storage(remote).ukey(path) == fresh
    storage.write_atomic(path, b"y" * 1000)
    assert get_storage(remote).ukey(path) != fresh


def test_a_reader_sees_a_file_rewritten_by_another_process(remote):
    """A polling reader (an evaluator watching `checkpoint`) whose fsspec listing cache holds a
    file must see it rewritten elsewhere: sizes and existence are asked afresh on object stores,
    or it read the old size of the new bytes (a cut-off id) and never saw new checkpoints."""
    import s3fs  # noqa: F401 (the s3 case writes through an instance of its own)

    storage = get_storage(remote)
    path = storage.join(remote, "checkpoint")
    storage.write_atomic(path, b"ckpt_10\nckpt_11\n")
    storage.listdir(remote)  # fills the process's listing cache
    assert storage.read_bytes(path, 1 << 20) == b"ckpt_10\nckpt_11\n"
    other = fsspec.filesystem(remote.split("://")[0], skip_instance_cache=True) \
        if remote.startswith("s3") else _fs(remote)  # another process's view of the store
    other.pipe_file(path, b"ckpt_11\nckpt_12\nckpt_13\n")
    assert storage.read_bytes(path, 1 << 20) == b"ckpt_11\nckpt_12\nckpt_13\n"
    assert storage.exists(storage.join(remote, "checkpoint"))


def test_file_urls_write_small_files_atomically(tmp_path, monkeypatch):
    """A file:// output dir writes the index, the list and the lock like a local path: to a
    temporary name, then renamed (never truncated in place, where a reader or a crash meets an
    empty or cut-off file), and the lock created with O_EXCL."""
    url = "file://" + str(tmp_path / "run")
    storage = get_storage(url)
    path = storage.join(url, "checkpoint")
    storage.makedirs(url)
    opened = []
    real_open = open

    def spy(file, mode="r", *args, **kwargs):
        if "w" in str(mode):
            opened.append(os.path.basename(str(file)))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy)
    storage.write_atomic(path, b"ckpt_1\n")
    monkeypatch.setattr("builtins.open", real_open)
    assert opened and all(name.startswith("checkpoint.tmp-") for name in opened)
    assert storage.read_bytes(path, 100) == b"ckpt_1\n"
    assert storage.create_exclusive(storage.join(url, "lock"), b"a")
    assert not storage.create_exclusive(storage.join(url, "lock"), b"b")


@pytest.mark.s3
@pytest.mark.multirank
def test_two_ranks_restore_from_s3_with_one_read_of_the_index(moto_server, tmp_path, monkeypatch):
    """Saved by 2 gloo ranks to S3, loaded by 2: rank 1 reads neither the index nor the checkpoint
    list (rank 0 broadcasts them; the ETags match) and holds exactly its rows."""
    import torch
    from mr_worker import expected_rows, global_ids
    from test_multirank import run_ranks

    from recsave import partition

    bucket = f"recsave-{uuid.uuid4().hex[:16]}"
    _fs(f"s3://{bucket}").mkdir(bucket)
    monkeypatch.setenv("OUT_URL", f"s3://{bucket}/out")
    codes, outs = run_ranks("save", 2, tmp_path)
    assert codes == [0, 0], outs
    codes, outs = run_ranks("load", 2, tmp_path)
    assert codes == [0, 0], outs
    ids_all = global_ids()
    for r in range(2):
        report = json.loads((tmp_path / f"report_2_{r}.json").read_text())
        assert report["whole_reads"].get("index", 0) == (1 if r == 0 else 0), report
        assert report["whole_reads"].get("checkpoint", 0) == (1 if r == 0 else 0), report
        assert report["checkpoints"] == [f"s3://{bucket}/out/ckpt_1"]
        got = torch.load(tmp_path / f"user_2_{r}.pt", weights_only=True)
        assert sorted(got["ids"].tolist()) == sorted(ids_all[partition.owner_of(ids_all, 2) == r].tolist())
        assert torch.equal(got["values"], expected_rows(got["ids"], 0.0))


def test_create_exclusive_lets_only_the_first_of_two_writers_in(remote, monkeypatch):
    """Two writers that both found no lock file (their existence checks ran first) and then put
    theirs: the conditional put (If-None-Match on S3) refuses the second, where a plain put let
    each read back its own record and both hold the lock."""
    a, b = get_storage(remote), get_storage(remote)
    path = a.join(remote, "run", ".lock")
    monkeypatch.setattr(type(a), "exists", lambda self, p: False)  # both checked before either put
    assert a.create_exclusive(path, b'{"token":"a"}')
    assert not b.create_exclusive(path, b'{"token":"b"}')
    monkeypatch.undo()
    assert a.read_bytes(path, 100) == b'{"token":"a"}'


def test_an_output_dir_at_a_stores_root_keeps_its_scheme():
    """memory:// as the output dir: joined paths keep "://" (they became memory:/ckpt_2, which
    get_storage then took for a local path)."""
    from recsave.storage.remote import FsspecStorage

    storage = get_storage("memory://")
    assert storage.join("memory://", "ckpt_2") == "memory://ckpt_2"
    assert storage.join("memory://", "ckpt_2", "index") == "memory://ckpt_2/index"
    assert storage.split("memory://ckpt_2") == ("memory://", "ckpt_2")
    assert isinstance(get_storage(storage.join("memory://", "ckpt_2")), FsspecStorage)



def test_a_save_longer_than_the_lease_keeps_its_remote_lock(remote, monkeypatch):
    """On an object store a save that outlives writer_lease_s renews its lease while it uploads: a
    second Saver is refused instead of committing the same id into the directory the first still
    writes (whose uploads would then overwrite the second's committed shards)."""
    from recsave import knobs
    from recsave.errors import WriterLockedError

    out = f"{remote}/run"
    with knobs.override(writer_lock=True):
        job, raised = save_outliving_the_lease(out, monkeypatch, lease_s=1.0)
        assert isinstance(raised, WriterLockedError) and "being written by another Saver" in str(raised)
        saved = job_state(job)
        job.saver.close()
        _clear_fs_caches()
        fresh = make_job(out)
        fresh.saver.load()
        assert fresh.saver.latest_checkpoint() == f"{out}/ckpt_1"
        assert_jobs_equal(job_state(fresh), saved)
        fresh.saver.close()


def test_tools_never_ask_above_the_bucket(tmp_path):
    """compact and export_serving check that their destination lies in no checkpoint by walking up
    its parents; on an object store the walk stops at the bucket: `<scheme>://index` would be
    another account's bucket (S3 answers 403), which failed every export."""
    import torch
    from fsspec.implementations.memory import MemoryFileSystem

    import recsave

    probes = []

    class BucketFS(MemoryFileSystem):
        protocol = "bucketfs"

        @classmethod
        def _strip_protocol(cls, path):
            if isinstance(path, str) and path.startswith("bucketfs://"):
                path = path[len("bucketfs://"):]
            return MemoryFileSystem._strip_protocol(path)

        def info(self, path, **kwargs):
            p = self._strip_protocol(path).lstrip("/")
            probes.append(p)
            if not p.startswith("mine"):
                raise PermissionError(f"AccessDenied: {p}")
            return super().info(path, **kwargs)

    fsspec.register_implementation("bucketfs", BucketFS, clobber=True)
    root = f"bucketfs://mine/{uuid.uuid4().hex}"
    model = torch.nn.ModuleDict({"user": recsave.HashTable(4, name="user")})
    model["user"](torch.arange(10))
    ckpt = recsave.Saver(model, output_dir=f"{root}/train").save("ckpt_1")
    assert recsave.compact(ckpt, f"{root}/compacted") == f"{root}/compacted/ckpt_1"
    assert recsave.export_serving(ckpt, f"{root}/serve") == f"{root}/serve/ckpt_1"
    assert [p for p in probes if not p.startswith("mine")] == []



@pytest.mark.parametrize("where", ["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def test_remove_empty_dir_removes_only_an_empty_directory(tmp_path, where, request):
    """What a failed tool uses to remove the directories it made: one step that never takes a file
    another writer put there meanwhile (a check, then a recursive removal, could). On S3 a bucket
    is the one directory there is, and it is never removed, empty or not (s3fs's exists() is False
    on any error, so "the export made it" can be wrong; a deleted bucket gives up its name), and
    never an error."""
    if where == "s3":
        request.getfixturevalue("moto_server")
        import s3fs
        _clear_fs_caches()
        fs, bucket = s3fs.S3FileSystem(), f"recsave-{uuid.uuid4().hex[:16]}"
        full_bucket, empty_bucket = f"{bucket}-full", f"{bucket}-empty"
        fs.mkdir(full_bucket)
        fs.mkdir(empty_bucket)
        fs.pipe(f"{full_bucket}/theirs", b"x")
        storage = get_storage(f"s3://{full_bucket}")
        storage.remove_empty_dir(f"s3://{full_bucket}")
        storage.remove_empty_dir(f"s3://{empty_bucket}")
        storage.remove_empty_dir(f"s3://{full_bucket}/not-a-directory")
        _clear_fs_caches()
        assert s3fs.S3FileSystem().exists(f"{full_bucket}/theirs")
        assert empty_bucket in [b.rstrip("/") for b in s3fs.S3FileSystem().ls("")]
        return
    root = str(tmp_path) if where == "local" else f"memory://red-{uuid.uuid4().hex}"
    storage = get_storage(root)
    full, empty = storage.join(root, "full"), storage.join(root, "empty")
    storage.makedirs(full)
    storage.makedirs(empty)
    storage.write_atomic(storage.join(full, "theirs"), b"x")
    storage.remove_empty_dir(full)
    storage.remove_empty_dir(empty)
    storage.remove_empty_dir(storage.join(root, "never-there"))
    assert storage.exists(storage.join(full, "theirs")) and not storage.exists(empty)


@pytest.mark.s3
def test_gc_takes_an_upload_gone_before_its_abort_in_its_stride(moto_server, monkeypatch):
    """An upload its writer finished (or a retried abort whose first try landed) between gc's
    listing and its abort: NoSuchUpload is what gc wanted, not an error that stops it part way."""
    from recsave.tools import catalog

    bucket = f"recsave-{uuid.uuid4().hex[:16]}"
    fs = _fs(f"s3://{bucket}")
    fs.mkdir(bucket)
    out = f"s3://{bucket}/run"
    job = make_job(out)
    job.train(2)
    job.saver.save("ckpt_2")
    job.saver.close()
    fs.pipe(f"{bucket}/run/ckpt_4/io_state_0.pt", b"x")  # the killed writer's files before model.pt
    for key in ("run/ckpt_4/model.pt", "run/ckpt_4/sparse-0-0.safetensors"):
        fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    time.sleep(1.1)
    real = type(fs).call_s3

    def twice(self, method, *args, **kwargs):
        if method == "abort_multipart_upload":
            real(self, method, *args, **kwargs)  # lands, then the "retry" finds it gone
        return real(self, method, *args, **kwargs)
    monkeypatch.setattr(type(fs), "call_s3", twice)
    done = catalog.clean_output_dir(out)
    assert done["aborted_uploads"] == ["ckpt_4/model.pt", "ckpt_4/sparse-0-0.safetensors"]
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []


@pytest.mark.parametrize("where", ["file", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_failed_write_stream_leaves_the_file_that_was_there(tmp_path, where, request):
    """Nothing is published before an upload completes (S3), or before the rename (file://): a
    producer's error must leave the old file as it was, not delete it. memory:// shows a file from
    its open on: the partial one is removed, never left."""
    if where == "memory":
        path = f"memory://recsave-test-{uuid.uuid4().hex}/data.bin"
        storage = get_storage(path)
        storage.write_atomic(path, b"OLD CONTENT")
        with pytest.raises(RuntimeError, match="fails"):
            storage.write_stream(path, lambda f: (f.write(b"partial"), (_ for _ in ()).throw(RuntimeError("fails"))))
        assert not storage.exists(path)
        return
    if where == "s3":
        request.getfixturevalue("moto_server")
        bucket = f"recsave-{uuid.uuid4().hex[:16]}"
        _fs(f"s3://{bucket}").mkdir(bucket)
        path = f"s3://{bucket}/dir/data.bin"
    else:
        path = f"file://{tmp_path}/data.bin"
    storage = get_storage(path)
    storage.write_atomic(path, b"OLD CONTENT")

    def produce(f):
        f.write(b"new bytes " * 1000)
        raise RuntimeError("the producer failed")
    with pytest.raises(RuntimeError, match="the producer failed"):
        storage.write_stream(path, produce)
    _clear_fs_caches()
    assert get_storage(path).read_range(path, 0, 11) == b"OLD CONTENT"
    assert get_storage(path).size(path) == 11


@pytest.mark.parametrize("url", ["dir::s3://bucket/run", "simplecache::s3://bucket/run",
                                 "filecache::memory://run", "blockcache::memory://run",
                                 "dir://::memory://bucket/run", "simplecache://::memory://bucket/run"])
def test_chained_urls_are_refused_before_anything_is_written(url):
    model = torch.nn.ModuleDict({"t": recsave.HashTable(4, name="t")})
    with pytest.raises(UsageError, match="chained fsspec URL.*give the store's own URL"):
        recsave.Saver(model, output_dir=url).save("ckpt_1")
    with pytest.raises(UsageError, match="chained fsspec URL"):
        get_storage(url)


def test_an_output_dir_at_the_memory_roots_triple_slash_form_saves_and_loads():
    """memory:/// is the root of memory:// spelled with its path's slash: joined paths keep the
    scheme (they were 'memory:/ckpt_1', which named a local path)."""
    fs = fsspec.filesystem("memory")
    before = set(fs.store), set(fs.pseudo_dirs)
    try:
        model = torch.nn.ModuleDict({"t": recsave.HashTable(4, name="t")})
        model["t"](torch.arange(10))
        assert get_storage("memory:///").join("memory:///", "ckpt_1") == "memory:///ckpt_1"
        path = recsave.Saver(model, output_dir="memory:///").save("ckpt_1")
        assert path == "memory:///ckpt_1"
        fresh = torch.nn.ModuleDict({"t": recsave.HashTable(4, name="t")})
        assert recsave.Saver(fresh, output_dir="memory:///").load().checkpoints == [path]
        assert torch.equal(fresh["t"].export(torch.arange(10))[1], model["t"].export(torch.arange(10))[1])
    finally:
        for key in set(fs.store) - before[0]:
            fs.store.pop(key, None)
        fs.pseudo_dirs[:] = [d for d in fs.pseudo_dirs if d in before[1]]


def test_an_output_dir_whose_name_ends_in_a_colon_holds_its_files(tmp_path):
    """Only a scheme and slashes is a store's root: "memory://b/exp:" is a directory like any
    other, its files inside it (a check on the trailing ':' alone joined them as siblings)."""
    root = f"memory://recsave-test-{uuid.uuid4().hex}"
    out = f"{root}/exp:"
    assert get_storage(out).join(out, "ckpt_1") == f"{out}/ckpt_1"
    model = torch.nn.ModuleDict({"t": recsave.HashTable(4, name="t")})
    model["t"](torch.arange(10))
    assert recsave.Saver(model, output_dir=out).save("ckpt_1") == f"{out}/ckpt_1"
    assert _ls(root) == ["exp:"]
    assert "checkpoint" in _ls(out) and "ckpt_1" in _ls(out)
    saved = recsave.Saver(model, output_dir=f"{root}/a::b")
    assert saved.save("ckpt_1") == f"{root}/a::b/ckpt_1"  # '::' after the scheme is a plain name


def test_an_output_dir_that_is_a_file_is_refused_before_the_lock(remote):
    """On memory:// the writer lock under a file failed as "another Saver is competing" (there
    was none); on S3 a save went ahead beside the object. A UsageError names the file, and nothing
    is written."""
    out = f"{remote}/run"
    _fs(out).pipe(get_storage(out).canonical(out).split("://", 1)[1], b"")
    job = make_job(out)
    job.train(1)
    with pytest.raises(UsageError, match=rf"output_dir {out} is a file, not a directory"):
        job.saver.save("ckpt_1")
    assert _fs(out).cat(get_storage(out).canonical(out).split("://", 1)[1]) == b""
    job.saver.close()


@pytest.mark.s3
def test_checkpoints_under_a_key_that_is_also_an_object_are_never_lost(remote):
    """An empty object another tool put at the output dir's own key (`run`, beside `run/ckpt_2`):
    HEAD found the object, the dir was taken for absent, a lost list was rebuilt empty, the restore
    started fresh and the next save's rotation deleted every checkpoint. The prefix's listing
    tells: the list is rebuilt from the indexes and the checkpoints stay."""
    if not remote.startswith("s3://"):
        pytest.skip("memory:// never lets a key be an object and a prefix at once")
    out = f"{remote}/run"
    job = make_job(out, save_interval=2, max_keep=None)
    job.train(4)
    job.manager.close()
    fs, key = _fs(out), out.split("://", 1)[1]
    fs.pipe(key, b"")
    fs.rm(f"{key}/checkpoint")
    _clear_fs_caches()
    again = make_job(out, save_interval=2, max_keep=None)
    with pytest.warns(RuntimeWarning, match="rebuilt"):
        assert again.manager.restore() == 4
    assert_jobs_equal(job_state(again), job_state(job))
    again.train(2)
    again.manager.close()
    assert {"ckpt_2", "ckpt_4", "ckpt_6"} <= set(_ls(out))


def test_a_lock_without_a_renewal_time_goes_stale_by_the_objects_last_modified_time(remote):
    """A lock object whose record has no renewed_at (cut short, another program's) refused every
    writer forever. The object's last-modified time, as the store reports it, stands in for the
    renewal: refused while younger than the lease, taken over once older."""
    from recsave import knobs
    from recsave.errors import WriterLockedError
    from recsave.storage.lock import WriterLock

    out = f"{remote}/run"
    storage = get_storage(out)
    path = storage.join(out, LOCK_FILE)
    _write(path, b'{"owner": "another program"}')
    assert storage.modified_at(path) == pytest.approx(time.time(), abs=5)
    lock = WriterLock(storage, out)
    with knobs.override(writer_lease_s=3):
        with pytest.raises(WriterLockedError, match="its record has no renewal time"):
            lock.acquire()
        assert _read(path) == b'{"owner": "another program"}'
        time.sleep(4.5)  # the store's times may have a resolution of a second
        lock.acquire()
    assert json.loads(_read(path))["token"] == lock.token
    lock.release()
    assert not storage.exists(path)
