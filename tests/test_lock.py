"""One writer per output directory: the lease file `<output_dir>/.recsave-writer.lock`."""
from __future__ import annotations

import gc
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings

import pytest
from helpers import assert_jobs_equal, job_state, make_job, save_outliving_the_lease

from recsave import knobs
from recsave.errors import RecsaveError, StorageError, WriterLockedError
from recsave.storage import LocalStorage, get_storage
from recsave.storage.lock import LOCK_FILE, LeaseGrant, LeaseWatch, WriterLock


@pytest.fixture(autouse=True)
def _lock_on():
    """These tests are about the lock: on whatever RECSAVE_WRITER_LOCK says."""
    with knobs.override(writer_lock=True):
        yield


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lock(out) -> dict:
    with open(os.path.join(out, LOCK_FILE)) as f:
        return json.load(f)


def _child(code: str, out: str, wait: bool = False) -> subprocess.Popen:
    """A python process that runs `code` (with `out` bound), prints 'ready', then (with `wait`)
    blocks until its stdin is closed."""
    script = textwrap.dedent(code) + "\nprint('ready', flush=True)\n"
    if wait:
        script += "sys.stdin.read()\n"
    env = dict(os.environ, RECSAVE_WRITER_LOCK="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    proc = subprocess.Popen([sys.executable, "-c", "import sys, os\n" + script, out], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline()
    assert line.strip() == "ready", proc.stderr.read()
    return proc


TAKE_LOCK = """
from recsave.storage.lock import WriterLock
from recsave.storage import LocalStorage
lock = WriterLock(LocalStorage(), sys.argv[1])
lock.acquire()
"""


def test_second_saver_on_the_same_dir_is_refused_until_the_first_closes(tmp_path):
    out = str(tmp_path / "run")
    first = make_job(out)
    first.train(2)
    first.saver.save("ckpt_2")
    holder = _lock(out)
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert set(holder) == {"host", "pid", "token", "acquired_at", "renewed_at", "pid_space"}

    second = make_job(out)
    second.train(3)
    before = sorted(os.listdir(out))
    with pytest.raises(WriterLockedError) as exc:
        second.saver.save("ckpt_3")
    assert isinstance(exc.value, RecsaveError) and isinstance(exc.value, RuntimeError)
    assert f"pid {os.getpid()}" in str(exc.value) and out in str(exc.value)
    assert sorted(os.listdir(out)) == before  # nothing written

    first.saver.save("ckpt_4")  # renews: still ours
    assert _lock(out)["token"] == holder["token"] and _lock(out)["renewed_at"] >= holder["renewed_at"]
    first.saver.close()
    assert not os.path.exists(os.path.join(out, LOCK_FILE))
    first.saver.close()  # idempotent
    second.saver.save("ckpt_3")
    assert _lock(out)["token"] != holder["token"]
    with pytest.raises(WriterLockedError):
        first.saver.save("ckpt_5")  # the first saver has to wait its turn now
    second.saver.close()


def test_lock_is_released_when_the_saver_is_garbage_collected(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out)
    job.saver.save("ckpt_0")
    assert os.path.exists(os.path.join(out, LOCK_FILE))
    del job
    gc.collect()
    assert not os.path.exists(os.path.join(out, LOCK_FILE))
    make_job(out).saver.save("ckpt_1")


def test_lock_is_released_at_exit(tmp_path):
    out = str(tmp_path / "run")
    proc = _child("""
        from helpers import make_job
        job = make_job(sys.argv[1])
        job.saver.save("ckpt_0")
        """, out)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    assert os.listdir(out) and not os.path.exists(os.path.join(out, LOCK_FILE))


def test_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    out = str(tmp_path / "run")
    proc = _child(TAKE_LOCK + "sys.stdout.write('ready\\n'); sys.stdout.flush(); os._exit(0)\n", out)
    proc.wait(timeout=60)
    dead = _lock(out)["pid"]
    assert dead == proc.pid
    job = make_job(out)
    job.train(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an expected takeover is a log line, not a warning
        with caplog.at_level(logging.INFO, logger="recsave"):
            job.saver.save("ckpt_1")
    (line,) = [r for r in caplog.records if "stale writer lock" in r.getMessage()]
    assert line.levelno == logging.INFO and line.name == "recsave"
    assert f"process {dead} on this host is dead" in line.getMessage() and f"pid {dead}" in line.getMessage()
    assert _lock(out)["pid"] == os.getpid()
    job.saver.close()


@pytest.mark.parametrize("pid_space", ["another-boot:4026531836", None])
def test_a_dead_pid_of_another_pid_space_is_not_taken_for_a_dead_holder(tmp_path, pid_space):
    """A holder with this hostname but another boot or pid namespace (a container sharing the
    host's name), or an older writer that recorded none: its pid says nothing about it here, so its
    fresh lease holds."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that is dead here
    record = {"host": socket.gethostname(), "pid": proc.pid, "token": "theirs", "acquired_at": time.time(),
              "renewed_at": time.time()}
    if pid_space is not None:
        record["pid_space"] = pid_space
    with open(os.path.join(out, LOCK_FILE), "w") as f:
        json.dump(record, f)
    job = make_job(out)
    job.train(1)
    with pytest.raises(WriterLockedError, match="is being written by another Saver"):
        job.saver.save("ckpt_1")
    assert _lock(out)["token"] == "theirs"


def test_another_live_process_blocks_us(tmp_path):
    out = str(tmp_path / "run")
    proc = _child(TAKE_LOCK, out, wait=True)
    try:
        job = make_job(out)
        with pytest.raises(WriterLockedError, match=f"pid {proc.pid} on host"):
            job.saver.save("ckpt_1")
        assert os.listdir(out) == [LOCK_FILE]
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    # The child released the lock at exit.
    job.saver.save("ckpt_1")
    job.saver.close()


def test_an_expired_lease_is_taken_over(tmp_path, caplog):
    out = str(tmp_path / "run")
    os.makedirs(out)
    old = time.time() - 100
    with open(os.path.join(out, LOCK_FILE), "w") as f:
        json.dump({"host": "other-host", "pid": 1, "token": "t", "acquired_at": old, "renewed_at": old}, f)
    job = make_job(out)
    with knobs.override(writer_lease_s=1000):
        with pytest.raises(WriterLockedError, match="other-host"):
            job.saver.save("ckpt_0")
    with knobs.override(writer_lease_s=50):
        with caplog.at_level(logging.INFO, logger="recsave"):
            job.saver.save("ckpt_0")
    assert any("not renewed for" in r.getMessage() and "other-host" in r.getMessage() for r in caplog.records)
    job.saver.close()


def test_a_saver_whose_lock_was_taken_over_stops_saving(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out)
    job.saver.save("ckpt_0")
    with open(os.path.join(out, LOCK_FILE), "w") as f:
        json.dump({"host": "other-host", "pid": 1, "token": "t", "acquired_at": 0, "renewed_at": time.time()}, f)
    with pytest.raises(WriterLockedError, match="lost the writer lock"):
        job.saver.save("ckpt_1")
    job.saver.close()
    assert os.path.exists(os.path.join(out, LOCK_FILE))  # not ours: left alone


def test_a_lock_lost_during_a_save_stops_it_before_its_commit_point(tmp_path, monkeypatch):
    """A save that outlives writer_lease_s may find its lock taken over by another Saver while its
    shards are written: it checks the lock again right before writing the index, so it commits
    nothing (its rotation would otherwise run against the other writer's save in progress)."""
    from recsave.load import contents

    out = str(tmp_path / "run")
    job = make_job(out)
    job.saver.save("ckpt_0")
    real = contents.index_meta

    def taken_over_meanwhile(*args, **kwargs):  # runs in the commit, after every shard is written
        with open(os.path.join(out, LOCK_FILE), "w") as f:
            json.dump({"host": "other-host", "pid": 1, "token": "t", "acquired_at": 0,
                       "renewed_at": time.time()}, f)
        return real(*args, **kwargs)

    monkeypatch.setattr(contents, "index_meta", taken_over_meanwhile)
    with pytest.raises(WriterLockedError, match="lost the writer lock"):
        job.saver.save("ckpt_1")
    assert not os.path.exists(os.path.join(out, "ckpt_1", "index"))
    with open(os.path.join(out, "checkpoint")) as f:
        assert f.read().split() == ["ckpt_0"]
    job.saver.close()


def test_a_save_longer_than_the_lease_keeps_its_lock(tmp_path, monkeypatch):
    """A save held up for three leases goes on renewing its lease (the renewal thread): a second
    Saver of the dir is refused meanwhile, instead of taking the lock over as stale and saving the
    same id into the directory the first is still writing. The first then commits, and its
    checkpoint loads. (test_remote.py: the same on memory:// and S3.)"""
    out = str(tmp_path / "run")
    job, raised = save_outliving_the_lease(out, monkeypatch)
    assert isinstance(raised, WriterLockedError) and "being written by another Saver" in str(raised)
    saved = job_state(job)
    job.saver.close()
    fresh = make_job(out)
    assert fresh.saver.latest_checkpoint() == get_storage(out).join(out, "ckpt_1")
    fresh.saver.load()
    assert_jobs_equal(job_state(fresh), saved)
    fresh.saver.close()


def test_training_longer_than_the_lease_keeps_the_lock_between_saves(tmp_path):
    """A holder renews its lease while it trains between saves: a second Saver (say another host's
    job given the same output dir) is refused however long the first goes without saving, and the
    first's next save works."""
    out = str(tmp_path / "run")
    with knobs.override(writer_lease_s=0.3):
        first, second = make_job(out, seed=1), make_job(out, seed=2)
        first.saver.save("ckpt_0")
        time.sleep(1.0)  # three leases of training
        with pytest.raises(WriterLockedError, match="being written by another Saver"):
            second.saver.save("ckpt_1")
        first.train(1)
        first.saver.save("ckpt_1")
        first.saver.close()
        second.saver.save("ckpt_2")  # released: free for the next writer
        second.saver.close()
    assert not os.path.exists(os.path.join(out, LOCK_FILE))


def test_a_held_lock_is_renewed_until_it_is_released(tmp_path):
    out = str(tmp_path / "run")
    mine, other = WriterLock(LocalStorage(), out), WriterLock(LocalStorage(), out)
    with knobs.override(writer_lease_s=0.3):
        mine.acquire()
        time.sleep(1.0)
        with pytest.raises(WriterLockedError, match="being written by another Saver"):
            other.acquire()
        mine.ensure_held()
        mine.release()
        other.acquire()
        time.sleep(0.3)  # a renewal of the released lock would write its token back
        assert mine.owned() is False and other.owned() is True
        assert not mine.lost  # released, not lost
    other.release()
    assert not os.path.exists(os.path.join(out, LOCK_FILE))


def test_a_lock_whose_renewals_stopped_is_taken_over_and_found_lost(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    mine, other = WriterLock(LocalStorage(), out), WriterLock(LocalStorage(), out)
    monkeypatch.setattr(WriterLock, "beat", lambda self, stop, interval: True)  # renewals fail
    with knobs.override(writer_lease_s=0.3):
        mine.acquire()
        time.sleep(0.5)
        other.acquire()  # stale: taken over
        with pytest.raises(WriterLockedError, match="lost the writer lock"):
            mine.ensure_held()
        assert mine.lost and mine.owned() is False
    mine.release()  # not ours: left alone
    assert other.owned() is True
    other.release()


def test_without_a_renewal_thread_the_lock_still_works(tmp_path, monkeypatch):
    """Where no thread can be started (a thread limit, a shutting-down interpreter) acquire() still
    returns, and ensure_held renews the lock once half a lease has passed."""
    lock = WriterLock(LocalStorage(), str(tmp_path / "run"))
    real_start = threading.Thread.start

    def no_lease_thread(self):
        if self.name == "recsave-lease":
            raise RuntimeError("can't start new thread")
        real_start(self)
    monkeypatch.setattr(threading.Thread, "start", no_lease_thread)
    with knobs.override(writer_lease_s=0.2):
        lock.acquire()
        before = _lock(str(tmp_path / "run"))["renewed_at"]
        time.sleep(0.15)
        lock.ensure_held()
    assert _lock(str(tmp_path / "run"))["renewed_at"] > before
    lock.release()


def test_a_lock_lost_during_the_commit_is_not_taken_again(tmp_path, monkeypatch):
    """The lock is taken over while the commit runs and the other writer then lets it go: the
    commit point renews the lock, never takes it anew, so the save fails and writes no index (the
    other writer may have committed the same id meanwhile)."""
    from recsave.load import contents

    out = str(tmp_path / "run")
    job = make_job(out)
    with knobs.override(writer_lease_s=0.2):  # the renewal thread's interval is set when it starts
        job.saver.save("ckpt_0")
    job.train(1)
    real = contents.index_meta

    def taken_over_then_released(*args, **kwargs):  # in the commit, after its first check
        with open(os.path.join(out, LOCK_FILE), "w") as f:
            json.dump({"host": "other-host", "pid": 1, "token": "t", "acquired_at": 0, "renewed_at": time.time()}, f)
        assert found_lost.wait(timeout=20)  # the renewal thread finds it taken over
        os.remove(os.path.join(out, LOCK_FILE))  # the other writer is done
        return real(*args, **kwargs)

    found_lost = threading.Event()
    real_beat = WriterLock.beat

    def beat(self, stop, interval):
        go_on = real_beat(self, stop, interval)
        if self.lost:
            found_lost.set()
        return go_on

    monkeypatch.setattr(WriterLock, "beat", beat)
    monkeypatch.setattr(contents, "index_meta", taken_over_then_released)
    with knobs.override(writer_lease_s=0.2):
        with pytest.raises(WriterLockedError, match="lost the writer lock"):
            job.saver.save("ckpt_1")
    assert not os.path.exists(os.path.join(out, "ckpt_1", "index"))
    assert not os.path.exists(os.path.join(out, LOCK_FILE))  # not taken again
    job.saver.close()


def test_ensure_held_reads_the_lock_only_once_half_a_lease_has_passed(tmp_path, monkeypatch):
    """Without renewals from the thread (here: they fail), ensure_held costs nothing for half a
    lease, then renews the lock itself (one read)."""
    out = str(tmp_path / "run")
    lock = WriterLock(LocalStorage(), out)
    reads = []
    real = WriterLock._read
    monkeypatch.setattr(WriterLock, "_read", lambda self: reads.append(1) or real(self))
    monkeypatch.setattr(WriterLock, "beat", lambda self, stop, interval: True)
    with knobs.override(writer_lease_s=0.4):
        lock.acquire()
        reads.clear()
        lock.ensure_held()
        assert reads == []
        time.sleep(0.25)
        lock.ensure_held()
        assert reads == [1]
    lock.release()


class _CountingStorage(LocalStorage):
    """LocalStorage counting its reads of the lock file."""

    def __init__(self):
        super().__init__()
        self.lock_reads = 0

    def read_bytes(self, path, limit):
        self.lock_reads += path.endswith(LOCK_FILE)
        return super().read_bytes(path, limit)


def _write_lock(out, **fields) -> None:
    record = {"host": "other", "pid": 1, "token": "t", "acquired_at": time.time(), "renewed_at": time.time()}
    record.update(fields)
    with open(os.path.join(out, LOCK_FILE), "w") as f:
        json.dump(record, f)


def _grant(out, lease_s, token="t", acquired_at=None, renewed_ago=0.0) -> LeaseGrant:
    taken = time.time() - 1 if acquired_at is None else acquired_at
    return LeaseGrant(os.path.join(out, LOCK_FILE), token, lease_s, taken, renewed_ago)


def test_a_lease_watch_reads_once_then_nothing_for_half_a_lease_then_follows_renewals(tmp_path):
    """Another rank's check of rank 0's lock: one read when made (does this rank see rank 0's
    file?), then none for half a lease after rank 0's last renewal; then one read per check, which
    restarts the half lease from the renewal it finds."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    storage = _CountingStorage()
    _write_lock(out)
    watch = LeaseWatch(storage, _grant(out, 0.6))
    watch.check()
    assert storage.lock_reads == 1
    time.sleep(0.35)
    _write_lock(out)  # rank 0 renewed
    watch.check()
    assert storage.lock_reads == 2
    watch.check()  # half a lease after that renewal has not passed
    assert storage.lock_reads == 2


def test_a_lease_watch_stops_a_rank_once_another_writer_took_the_lock_over(tmp_path):
    out = str(tmp_path / "run")
    os.makedirs(out)
    _write_lock(out, token="ours")
    watch = LeaseWatch(LocalStorage(), _grant(out, 0.2, token="ours"))
    _write_lock(out, token="theirs", host="elsewhere", pid=77)
    time.sleep(0.11)
    with pytest.raises(WriterLockedError, match="now held by pid 77 on host 'elsewhere'.*this rank stops writing"):
        watch.check()
    assert not watch.may_discard()  # its files may have the names the new writer writes


def test_a_lease_watch_stops_a_rank_when_rank_0_stopped_renewing(tmp_path, monkeypatch):
    """Rank 0 renews every quarter lease: three quarters without a renewal mean it is gone or
    stalled, and a whole lease lets another writer take the lock over."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    _write_lock(out)
    watch = LeaseWatch(LocalStorage(), _grant(out, 0.4))
    time.sleep(0.21)
    now = time.time()
    _write_lock(out, renewed_at=now - 0.31)
    with monkeypatch.context() as m:  # the lock's age exactly 0.31 s when read, however busy the machine
        m.setattr(time, "time", lambda: now)
        with pytest.raises(WriterLockedError, match=r"rank 0 has not renewed the writer lock for 0\.3 s "
                                                    r"\(writer_lease_s=0.4;"):
            watch.check()
        assert watch.may_discard()  # within its lease: no other writer can have begun
    now = time.time()
    with monkeypatch.context() as m:  # ages exactly as written, however long the reads take on a busy machine
        m.setattr(time, "time", lambda: now)
        _write_lock(out, renewed_at=now - 0.45)
        assert not watch.may_discard()  # its lease ran out: another writer may begin at any moment
        _write_lock(out, renewed_at=now - 0.2)  # renewed within three quarters: rank 1 goes on
        watch.check()


def test_a_lease_watch_finds_a_lock_gone_after_it_saw_it_lost(tmp_path):
    """A writer that took the lock over, saved and closed leaves no lock file: this rank saw rank
    0's token there when the save began, so that is a lost lock, not a lock it cannot see."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    _write_lock(out)
    watch = LeaseWatch(LocalStorage(), _grant(out, 0.2))
    os.remove(os.path.join(out, LOCK_FILE))
    time.sleep(0.11)
    with pytest.raises(WriterLockedError, match="is now released"):
        watch.check()
    assert not watch.may_discard()


@pytest.mark.parametrize("there", ["nothing", "an older lock", "a newer lock"])
def test_a_lease_watch_that_cannot_see_rank_0s_lock_lets_the_rank_write(tmp_path, there):
    """Per-rank local disks: rank 0's lock file is not on this rank's disk (at most a lock another
    job left there, before or after rank 0 took its own); rank 0's own checks guard the save, and
    this rank reads no more."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    if there != "nothing":
        taken = time.time() + (-3600 if there == "an older lock" else 60)
        _write_lock(out, token="other", acquired_at=taken, renewed_at=taken)
    storage = _CountingStorage()
    watch = LeaseWatch(storage, _grant(out, 0.2, renewed_ago=0.2))
    watch.check()
    watch.check()
    assert storage.lock_reads == 1
    assert watch.may_discard()


def test_a_paused_save_stops_before_writing_into_a_taken_over_dir(tmp_path, monkeypatch):
    """A holder that could not renew its lease for longer than the lease (a paused process, a store
    it could not reach) may have been taken over, and the new writer may be saving the same id. It
    writes no further file once it finds that out (before its next table), and its clean-up leaves
    the directory alone: the files in it may be the new writer's."""
    from recsave.save import pipeline

    out = str(tmp_path / "run")
    job = make_job(out)
    job.saver.save("ckpt_0")
    job.train(1)
    monkeypatch.setattr(WriterLock, "beat", lambda self, stop, interval: True)  # renewals fail
    real, calls = pipeline.write_shards, []
    theirs = os.path.join(out, "ckpt_1", "theirs.bin")

    def paused_then_taken_over(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.5)
            WriterLock(LocalStorage(), out).acquire()  # stale by now: taken over
            with open(theirs, "wb") as f:  # the new writer's save of the same id
                f.write(b"new writer")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "write_shards", paused_then_taken_over)
    with knobs.override(writer_lease_s=0.3):
        with pytest.raises(WriterLockedError, match="lost the writer lock"):
            job.saver.save("ckpt_1")
    assert len(calls) == 1  # the first table's shards; no file after the takeover was found
    assert not os.path.exists(os.path.join(out, "ckpt_1", "io_state_0.pt"))
    with open(theirs, "rb") as f:
        assert f.read() == b"new writer"
    assert not os.path.exists(os.path.join(out, "ckpt_1", "index"))
    job.saver.close()


_FORK_AND_EXIT = """
import os, sys
from recsave.storage import LocalStorage
from recsave.storage.lock import WriterLock, LOCK_FILE
lock = WriterLock(LocalStorage(), sys.argv[1])
lock.acquire()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a forked child that ends normally runs the exit finalizers of its copy
os.waitpid(pid, 0)
print("after the child:", os.path.exists(os.path.join(sys.argv[1], LOCK_FILE)))
lock.release()
print("after release:", os.path.exists(os.path.join(sys.argv[1], LOCK_FILE)))
"""


def test_a_forked_child_leaves_the_parents_lock_alone(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", _FORK_AND_EXIT, str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["after the child: True", "after release: False"]


def test_lock_file_is_invisible_to_listing_and_rotation(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=2)
    for step in range(1, 5):
        job.train(1)
        job.saver.save(f"ckpt_{step}")
    assert job.saver.checkpoints() == [os.path.join(out, f"ckpt_{s}") for s in (3, 4)]
    job.saver.wait()  # the pruned directories' deletion (save/pruning.py)
    assert sorted(os.listdir(out)) == [LOCK_FILE, "checkpoint", "ckpt_3", "ckpt_4"]
    at_4 = job_state(job)
    fresh = make_job(out)
    fresh.saver.load()  # loading needs no lock
    assert_jobs_equal(job_state(fresh), at_4)
    job.saver.close()


def test_remote_lock(tmp_path):
    out = f"memory://recsave-lock-{uuid.uuid4().hex}/run"
    first, second = make_job(out), make_job(out)
    first.saver.save("ckpt_0")
    st = get_storage(out)
    assert LOCK_FILE in st.listdir(out)
    with pytest.raises(WriterLockedError, match="pid"):
        second.saver.save("ckpt_1")
    first.saver.close()
    assert LOCK_FILE not in st.listdir(out)
    second.saver.save("ckpt_1")
    second.saver.close()
    st.remove_tree(out)


def test_knob_turns_the_lock_off(tmp_path):
    out = str(tmp_path / "run")
    with knobs.override(writer_lock=False):
        make_job(out).saver.save("ckpt_0")
        make_job(out).saver.save("ckpt_1")
    assert not os.path.exists(os.path.join(out, LOCK_FILE))


def test_two_lock_objects_race_for_one_dir(tmp_path):
    out = str(tmp_path / "run")
    a, b = WriterLock(LocalStorage(), out), WriterLock(LocalStorage(), out)
    a.acquire()
    with pytest.raises(WriterLockedError):
        b.acquire()
    a.release()
    b.acquire()
    b.release()
    assert not os.path.exists(os.path.join(out, LOCK_FILE))


def test_a_new_writer_waits_for_a_collected_savers_remote_release(monkeypatch):
    """A collected Saver releases its remote lock on a helper thread without blocking the
    collection; a new writer of the same dir in this process waits for that release instead of
    finding this pid's lock and refusing. Events order the steps, not sleeps: the release is held
    at a gate that opens only once the new writer has started waiting for it."""
    from recsave.storage import lock as lock_mod

    out = f"memory://recsave-lock-{uuid.uuid4().hex}/run"
    storage = get_storage(out)
    first = WriterLock(storage, out)
    first.acquire()
    path = first.path
    gate, at_gate, waiting = threading.Event(), threading.Event(), threading.Event()
    removed_on, waits = [], []
    real_remove = storage.remove_file

    def gated_remove(p):
        removed_on.append(threading.current_thread())
        at_gate.set()
        if threading.current_thread() is not threading.main_thread():  # nobody could open it here
            gate.wait(timeout=60)
        real_remove(p)
    monkeypatch.setattr(storage, "remove_file", gated_remove)
    real_wait = lock_mod.futures_wait

    def wait_observed(*args, **kwargs):
        waits.append(threading.current_thread())
        waiting.set()
        return real_wait(*args, **kwargs)
    monkeypatch.setattr(lock_mod, "futures_wait", wait_observed)

    del first
    gc.collect()  # runs the finalizer: it returns while its release is still held at the gate
    assert waits == [], "the collection waited for the release"
    assert at_gate.wait(timeout=60), "the collected lock was never released"
    assert len(removed_on) == 1 and removed_on[0] is not threading.main_thread()
    assert not gate.is_set() and storage.exists(path)

    opener = threading.Thread(target=lambda: waiting.wait(timeout=60) and gate.set())
    opener.start()
    second = WriterLock(storage, out)
    try:
        second.acquire()  # waits for the release, which the opener lets through meanwhile
    finally:
        waiting.set()
        gate.set()
        opener.join()
    assert waits == [threading.main_thread()] and len(removed_on) == 1
    assert json.loads(storage.read_bytes(second.path, 1 << 16))["token"] == second.token
    second.release()
    assert not storage.exists(second.path)


class _ChangingLock(LocalStorage):
    """Reads of the lock file fail `times` times as a lock replaced between its size and its
    read does on an object store (CorruptCheckpointError: size changed)."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    def read_bytes(self, path, limit):
        if path.endswith(LOCK_FILE) and self.times:
            self.times -= 1
            from recsave.errors import CorruptCheckpointError
            raise CorruptCheckpointError(f"{path}: size changed while reading", path=path)
        return super().read_bytes(path, limit)


@pytest.mark.parametrize("times", [1, 99])
def test_a_lock_changing_under_a_read_is_a_writer_lock_error(tmp_path, times):
    out = str(tmp_path / "run")
    holder = WriterLock(LocalStorage(), out)
    holder.acquire()
    contender = WriterLock(_ChangingLock(times), out)
    match = "is being written by another Saver" if times == 1 else "the writer lock cannot be read .*size changed"
    with pytest.raises(WriterLockedError, match=match):  # never CorruptCheckpointError
        contender.acquire()
    holder.release()


def test_a_writer_frozen_past_its_lease_after_its_index_neither_lists_nor_prunes(tmp_path, monkeypatch):
    """Writer A stalls (both threads, as under SIGSTOP) right after writing ckpt_1's index, longer
    than its lease; B takes the stale lock over and commits ckpt_2 and ckpt_3. A's save must fail
    with WriterLockedError, not list ckpt_1 over B's list nor prune B's checkpoints."""
    from recsave.format import index as index_mod

    out = str(tmp_path / "out")
    lease = 0.5
    with knobs.override(writer_lease_s=lease):
        a = make_job(out, max_keep=2, seed=1)
        a.train(1)
        a.saver.save("ckpt_0")
        b = make_job(out, max_keep=2, seed=2)
        b.train(1)
        real = index_mod.write_bytes

        def stalled(ckpt_dir, data, storage=None):
            real(ckpt_dir, data, storage=storage)
            if ckpt_dir.endswith("ckpt_1"):
                with a.saver._checkpoints._lock._mutex:  # A's renewals stall too
                    time.sleep(2 * lease)
                    b.saver.save("ckpt_2")
                    b.train(1)
                    b.saver.save("ckpt_3")
        monkeypatch.setattr(index_mod, "write_bytes", stalled)
        a.train(1)
        with pytest.raises(WriterLockedError, match="the index of ckpt_1 was written, but this Saver lost"):
            a.saver.save("ckpt_1")
        monkeypatch.undo()
        assert open(os.path.join(out, "checkpoint")).read().split() == ["ckpt_2", "ckpt_3"]
        live = job_state(b)
        b.saver.close()
        fresh = make_job(out, max_keep=2, seed=3)
        fresh.saver.load()
        assert_jobs_equal(job_state(fresh), live)
        a.saver.close()  # a lost lock is not released (the file is B's)
        fresh.saver.close()


def test_a_forked_child_does_not_save_under_its_parents_lock(tmp_path):
    """The parent holds the lock; a child forked from it saving into the same dir must wait for
    the lock like any other process (WriterLockedError here), not renew the parent's holding as
    its own, which left the lock with the child's pid, takeable once the child exited."""
    out = str(tmp_path / "out")
    job = make_job(out, max_keep=None)
    job.train(1)
    job.saver.save("ckpt_1")
    before = _lock(out)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code, never return into pytest
        code = 1
        try:
            job.train(1)
            job.saver.save("ckpt_child")
        except WriterLockedError:
            code = 0
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _lock(out)["pid"] == os.getpid() and _lock(out)["token"] == before["token"]
    assert not os.path.exists(os.path.join(out, "ckpt_child"))
    job.train(1)
    job.saver.save("ckpt_2")  # the parent's holding is intact
    job.saver.close()


def test_local_replace_exclusive_lets_one_racer_in_and_keeps_a_file_it_did_not_expect(tmp_path):
    """The stale-lock takeover's primitive on local disk: it replaces only a file holding the
    expected bytes, puts back one that did not, and of two racing takers (threads, both reading
    the same stale lock) exactly one acquires, in every one of 300 trials, with 2 and with 4
    racers (with 3 or more a loser moving the winner's fresh file aside once let a third in)."""
    st = LocalStorage()
    path = str(tmp_path / "f")
    assert st.replace_exclusive(path, b"old", b"new") is False  # nothing there
    with open(path, "wb") as f:
        f.write(b"old")
    assert st.replace_exclusive(path, b"old", b"mine") is True
    assert st.replace_exclusive(path, b"old", b"theirs") is False  # it holds "mine" now: put back
    assert open(path, "rb").read() == b"mine" and os.listdir(tmp_path) == ["f"]

    out = str(tmp_path / "run")
    os.makedirs(out)
    stale = json.dumps({"host": "elsewhere", "pid": 1, "token": "dead", "acquired_at": 0, "renewed_at": 0})
    for trial in range(300):
        with open(os.path.join(out, LOCK_FILE), "w") as f:
            f.write(stale)
        racers = 2 if trial % 2 else 4
        locks, won = [WriterLock(st, out) for _ in range(racers)], []
        barrier = threading.Barrier(racers)

        threads = [threading.Thread(target=_take_lock, args=(lock, barrier, won)) for lock in locks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1
        won[0].release()


def _take_lock(lock, barrier, won):
    barrier.wait()
    try:
        lock.acquire()
        won.append(lock)
    except WriterLockedError:
        pass


def test_a_forked_child_releasing_its_copy_neither_blocks_nor_frees_the_parents_lock(tmp_path):
    """The parent's renewal thread may hold the lock's mutex at the fork (held here on purpose):
    the child's close() must return at once and leave the lock file to the parent."""
    out = str(tmp_path / "out")
    job = make_job(out, max_keep=None)
    job.train(1)
    job.saver.save("ckpt_1")
    lock = job.saver._checkpoints._lock  # the holding the child gets a copy of
    with lock._mutex:
        pid = os.fork()
        if pid == 0:
            import signal
            signal.alarm(10)  # a deadlock ends the child with SIGALRM
            job.saver.close()
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _lock(out)["pid"] == os.getpid()
    job.train(1)
    job.saver.save("ckpt_2")
    job.saver.close()


def test_no_pid_space_known_here_takes_no_dead_pid_shortcut(tmp_path, monkeypatch):
    """Where this process's pid space cannot be read (no /proc/self/ns), a same-host dead pid
    proves nothing either: the holder's fresh lease holds."""
    import recsave.storage.lockrecord as lockrecord

    space = lockrecord.pid_space()  # the record's: were it known here, the dead pid would free the lock
    assert space is not None
    monkeypatch.setattr(lockrecord, "pid_space", lambda: None)
    out = str(tmp_path / "run")
    os.makedirs(out)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with open(os.path.join(out, LOCK_FILE), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": proc.pid, "token": "theirs", "acquired_at": time.time(),
                   "renewed_at": time.time(), "pid_space": space}, f)
    job = make_job(out)
    job.train(1)
    with pytest.raises(WriterLockedError, match="is being written by another Saver"):
        job.saver.save("ckpt_1")


def test_a_stale_lock_is_taken_over_where_the_directory_cannot_be_flocked(tmp_path, monkeypatch):
    """NFS emulates flock with byte-range locks, which a directory opened for reading cannot take
    (EBADF): the takeover falls back to write and read back instead of failing every time."""
    import errno

    import recsave.storage.local as local_mod

    def refused(fd, op):
        raise OSError(errno.EBADF, "Bad file descriptor")
    monkeypatch.setattr(local_mod.fcntl, "flock", refused)
    assert LocalStorage().replace_exclusive(str(tmp_path / "x"), b"a", b"b") is None
    out = str(tmp_path / "run")
    os.makedirs(out)
    with open(os.path.join(out, LOCK_FILE), "w") as f:
        json.dump({"host": "elsewhere", "pid": 1, "token": "dead", "acquired_at": 0, "renewed_at": 0}, f)
    job = make_job(out)
    job.train(1)
    job.saver.save("ckpt_1")
    assert _lock(out)["pid"] == os.getpid()
    job.saver.close()


def test_a_stale_lock_is_taken_over_while_something_else_flocks_the_directory(tmp_path):
    """`flock <output_dir> python train.py` (a launcher's idiom) holds the directory's flock for
    the job's life: the takeover waits a bounded while, then falls back to write and read back,
    instead of blocking forever on the job's own launcher."""
    import fcntl

    out = str(tmp_path / "run")
    os.makedirs(out)
    with open(os.path.join(out, LOCK_FILE), "w") as f:
        json.dump({"host": "elsewhere", "pid": 1, "token": "dead", "acquired_at": 0, "renewed_at": 0}, f)
    held = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        job = make_job(out)
        job.train(1)
        started = time.monotonic()
        job.saver.save("ckpt_1")
        assert time.monotonic() - started < 30
        assert _lock(out)["pid"] == os.getpid()
        job.saver.close()
    finally:
        os.close(held)


# Lock records without a renewal time a live writer could have written: cut short, garbled, or
# written by another program. (A file that is no JSON object at all is "unreadable": taken at once.)
NO_RENEWAL_TIME = {
    "empty_object": {},
    "no_pid_no_time": {"host": "other-host", "token": "theirs"},
    "null_time": {"host": "other-host", "pid": 1, "token": "theirs", "renewed_at": None},
    "text_time": {"host": "other-host", "pid": 1, "token": "theirs", "renewed_at": "2026-01-01"},
    "bool_time": {"host": "other-host", "pid": 1, "token": "theirs", "renewed_at": True},
    "nan_time": {"host": "other-host", "pid": 1, "token": "theirs", "renewed_at": float("nan")},
    "far_future": {"host": "other-host", "pid": 1, "token": "theirs", "renewed_at": 1e300},
}


def _put_lock_record(out, record, age_s=0.0):
    """A lock file holding `record` (json.dumps writes NaN as JSON's NaN), last modified `age_s` ago."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, LOCK_FILE)
    with open(path + ".new", "w") as f:
        json.dump(record, f)
    os.replace(path + ".new", path)  # whole, as a writer renewing by rename leaves it
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))


@pytest.mark.parametrize("record", sorted(NO_RENEWAL_TIME))
def test_a_lock_without_a_renewal_time_goes_stale_by_its_files_age(tmp_path, caplog, record):
    """Such a lock was never stale: every later Saver on the directory was refused forever. Its
    file's last modification stands in for the renewal: refused while younger than the lease (the
    message says when it goes stale and what to do), taken over once older."""
    out = str(tmp_path / "run")
    _put_lock_record(out, NO_RENEWAL_TIME[record])
    with open(os.path.join(out, LOCK_FILE), "rb") as f:
        theirs = f.read()
    lock = WriterLock(LocalStorage(), out)
    with knobs.override(writer_lease_s=50):
        with pytest.raises(WriterLockedError) as refused:
            lock.acquire()
        message = str(refused.value)
        assert message.startswith(f"{out} is being written by another Saver (")
        assert "its record has no renewal time (cut short, or not written by recsave): it is taken over once its " \
               "file is unchanged for writer_lease_s=50 s (last modified 0 s ago)" in message
        assert message.endswith(f"wait for that, save into another output_dir, or delete the lock file if no writer "
                                f"uses {out}")
        with open(os.path.join(out, LOCK_FILE), "rb") as f:
            assert f.read() == theirs
        _put_lock_record(out, NO_RENEWAL_TIME[record], age_s=100)
        with caplog.at_level(logging.INFO, logger="recsave"):
            lock.acquire()
    assert _lock(out)["token"] == lock.token and lock.held
    (line,) = [r.getMessage() for r in caplog.records if "stale writer lock" in r.getMessage()]
    assert "it records no renewal time, and its file was last modified 100 s ago > writer_lease_s=50" in line
    lock.release()
    assert not os.path.exists(os.path.join(out, LOCK_FILE))


def test_a_lock_without_a_renewal_time_kept_fresh_by_its_holder_is_never_taken(tmp_path):
    """Another program holding the lock file without recsave's renewed_at, rewriting it while it
    works: never taken over however many leases pass; once it stops, taken a lease later."""
    out = str(tmp_path / "run")
    _put_lock_record(out, {"owner": "another program"})
    stop = threading.Event()

    def renew():
        while not stop.wait(0.05):
            _put_lock_record(out, {"owner": "another program"})

    holder = threading.Thread(target=renew)
    holder.start()
    try:
        lock = WriterLock(LocalStorage(), out)
        with knobs.override(writer_lease_s=1.0):
            deadline = time.monotonic() + 3.0  # three leases
            while time.monotonic() < deadline:
                with pytest.raises(WriterLockedError, match="its record has no renewal time"):
                    lock.acquire()
                time.sleep(0.1)
    finally:
        stop.set()
        holder.join()
    assert _lock(out) == {"owner": "another program"}
    _put_lock_record(out, {"owner": "another program"}, age_s=1.5)
    with knobs.override(writer_lease_s=1.0):
        lock.acquire()
    assert _lock(out)["token"] == lock.token
    lock.release()


def test_a_lock_with_a_dead_pid_and_no_renewal_time_is_taken_at_once(tmp_path):
    """The dead-pid rule still applies to a record without a renewal time (same host and pid space)."""
    from recsave.storage.lockrecord import pid_space

    out = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    _put_lock_record(out, {"host": socket.gethostname(), "pid": proc.pid, "pid_space": pid_space(), "token": "theirs"})
    lock = WriterLock(LocalStorage(), out)
    with knobs.override(writer_lease_s=1000):
        lock.acquire()
    assert _lock(out)["token"] == lock.token
    lock.release()


class _StatCountingStorage(LocalStorage):
    """Local storage counting modified_at calls; from call `fail_from` on they raise StorageError
    (a store gone unreachable, a file vanishing between two stats)."""

    def __init__(self, fail_from=None):
        super().__init__()
        self.stats, self.fail_from = 0, fail_from

    def modified_at(self, path):
        self.stats += 1
        if self.fail_from is not None and self.stats >= self.fail_from:
            raise StorageError(f"{path}: stat failed (injected)", path=path)
        return super().modified_at(path)


@pytest.mark.parametrize("fail_from", [1, 2])
def test_a_refusal_whose_stat_of_the_lock_file_fails_is_still_a_writer_locked_error(tmp_path, fail_from):
    """A fresh lock without a renewal time, whose file's age cannot be read (the first stat fails)
    or could no longer be read when the refusal was worded (a second stat did): the refusal is
    the WriterLockedError all the same, not the storage's error, its wording without the age."""
    out = str(tmp_path / "run")
    _put_lock_record(out, NO_RENEWAL_TIME["no_pid_no_time"])
    lock = WriterLock(_StatCountingStorage(fail_from=fail_from), out)
    with knobs.override(writer_lease_s=50):
        with pytest.raises(RecsaveError) as refused:
            lock.acquire()
    assert type(refused.value) is WriterLockedError
    message = str(refused.value)
    assert message.startswith(f"{out} is being written by another Saver (")
    if fail_from == 1:
        assert "it is taken over once its file is unchanged for writer_lease_s=50 s (when it was last modified " \
               "could not be read: " in message and "stat failed (injected)" in message
    else:  # the one stat succeeded
        assert "writer_lease_s=50 s (last modified 0 s ago)" in message
    assert _lock(out) == NO_RENEWAL_TIME["no_pid_no_time"] and not lock.held


@pytest.mark.parametrize("renewal_time", [False, True])
def test_a_refusal_stats_the_lock_file_once_at_most(tmp_path, renewal_time):
    """Judging the lock stale and wording its refusal share one stat of the lock file (none for a
    record with a usable renewal time)."""
    out = str(tmp_path / "run")
    record = dict(NO_RENEWAL_TIME["no_pid_no_time"])
    if renewal_time:
        record["renewed_at"] = time.time()
    _put_lock_record(out, record)
    storage = _StatCountingStorage()
    with knobs.override(writer_lease_s=50):
        with pytest.raises(WriterLockedError, match="is being written by another Saver"):
            WriterLock(storage, out).acquire()
    assert storage.stats == (0 if renewal_time else 1)


class _ReleasedBeforeStatStorage(LocalStorage):
    """Local storage on which the holder releases its lock just as another writer stats it."""

    def modified_at(self, path):
        os.remove(path)
        return super().modified_at(path)


def test_a_lock_released_while_a_writer_looks_at_its_age_is_taken(tmp_path):
    """The holder released the lock between a writer's read of it and the stat of its file: the
    writer was refused, told the storage kept no modification time so the lock never went stale,
    though the lock was free (review). It tries to take it again and does."""
    out = str(tmp_path / "run")
    _put_lock_record(out, NO_RENEWAL_TIME["no_pid_no_time"])
    lock = WriterLock(_ReleasedBeforeStatStorage(), out)
    with knobs.override(writer_lease_s=50):
        lock.acquire()
    assert lock.held and _lock(out)["token"] == lock.token
    lock.release()


@pytest.mark.parametrize("record", [{"renewed_at": 10 ** 400}, {"pid": 2 ** 64}, {"pid": -1}, {"pid": 0}],
                         ids=["renewed_at_beyond_float", "pid_beyond_c_long", "pid_negative", "pid_zero"])
def test_a_lock_record_with_numbers_out_of_range_is_refused_as_held(tmp_path, record):
    """A fresh record whose renewed_at is too large for a float, or whose pid is no process id
    here, raised OverflowError (or for pid 0 / -1 asked about a process group): such a record is
    garbage, judged by the file's age like one without the field (the holder may be alive)."""
    from recsave.storage.lockrecord import pid_space

    out = str(tmp_path / "run")
    full = {"host": socket.gethostname(), "pid_space": pid_space(), "token": "theirs", **record}
    _put_lock_record(out, full)
    with knobs.override(writer_lease_s=50):
        with pytest.raises(RecsaveError) as refused:
            WriterLock(LocalStorage(), out).acquire()
    assert type(refused.value) is WriterLockedError
    assert _lock(out) == full
