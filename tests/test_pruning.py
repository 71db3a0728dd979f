"""Rotation's deletions off the save's path (recsave/save/pruning.py): a pruned checkpoint leaves its
id at once (moved into output_dir/.recsave+pruned on local disk), the files go on a thread, and
whatever a dead process left there is garbage that nothing lists."""
import gc
import os
import shutil
import threading
import time
import uuid

import pytest
from helpers import CTR, assert_jobs_equal, job_state, listing, make_job

from recsave import Saver, knobs
from recsave.errors import UsageError, WriterLockedError
from recsave.format import ckptlist
from recsave.format.ckptlist import PRUNED_DIR
from recsave.storage import get_storage
from recsave.storage.local import LocalStorage
from recsave.storage.lock import LOCK_FILE


def _save_steps(job, steps):
    for step in steps:
        job.train(1)
        job.saver.save(f"ckpt_{step}")


def test_a_pruned_checkpoint_leaves_its_id_before_its_files_are_deleted(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=1)
    _save_steps(job, [1])
    release, blocked = threading.Event(), []
    real = LocalStorage.remove_tree

    def slow(self, path):  # the thread's deletion waits until the test has looked
        if os.path.basename(path) == PRUNED_DIR:
            blocked.append(release.wait(timeout=30))
        real(self, path)

    monkeypatch.setattr(LocalStorage, "remove_tree", slow)
    _save_steps(job, [2])  # returns while the deletion of ckpt_1 is held
    assert not blocked  # the save did not wait for it
    assert not os.path.exists(os.path.join(out, "ckpt_1"))
    assert ckptlist.read(LocalStorage(), out) == ["ckpt_2"]
    moved = os.listdir(os.path.join(out, PRUNED_DIR))
    assert len(moved) == 1 and moved[0].startswith("ckpt_1-")
    release.set()
    job.saver.wait()
    assert blocked == [True]
    assert listing(out) == ["checkpoint", "ckpt_2"]
    job.saver.close()


def test_close_and_the_next_save_wait_for_the_deletion(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=1)
    _save_steps(job, [1, 2])
    job.saver.close()  # joined before the writer lock goes
    assert listing(out) == ["checkpoint", "ckpt_2"]
    _save_steps(job, [3, 4])  # each save joins the previous one's deletion before it looks
    job.saver.wait()
    assert listing(out) == ["checkpoint", "ckpt_4"]
    job.saver.close()


def test_a_left_over_pruned_dir_is_never_listed_and_the_next_save_removes_it(tmp_path):
    """A process that died while deleting left a committed-looking copy in PRUNED_DIR: a rebuilt
    list does not bring it back, and the next save's collection removes it."""
    out = tmp_path / "run"
    job = make_job(str(out), max_keep=3)
    _save_steps(job, [1, 2])
    job.saver.close()
    shutil.copytree(out / "ckpt_1", out / PRUNED_DIR / "ckpt_1-999-0")
    shutil.copytree(out / "ckpt_1", out / PRUNED_DIR / "ckpt_9")  # a valid id with a valid index inside
    os.remove(out / "checkpoint")
    with pytest.warns(RuntimeWarning, match="rebuilt the list of committed checkpoints"):
        assert ckptlist.committed(LocalStorage(), str(out), rewrite=True).ids == ["ckpt_1", "ckpt_2"]
    assert not ckptlist.looks_like_checkpoint(LocalStorage(), str(out), PRUNED_DIR)
    assert ckptlist.validate_id("ckpt_9") and not ckptlist.is_plain_name(PRUNED_DIR)
    job = make_job(str(out), max_keep=3)
    job.saver.load()
    _save_steps(job, [3])
    assert listing(out) == ["checkpoint", "ckpt_1", "ckpt_2", "ckpt_3"]
    job.saver.close()


def test_the_pruned_dir_name_is_not_a_checkpoint_id(tmp_path):
    """No release could have written a checkpoint under that name: a listed one is never deleted."""
    job = make_job(str(tmp_path / "run"))
    with pytest.raises(UsageError, match="is not usable"):
        job.saver.save(PRUNED_DIR)
    job.saver.close()


def test_a_garbage_collected_saver_releases_the_lock_while_its_deletion_runs(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=1)
    _save_steps(job, [1])
    release = threading.Event()
    real = LocalStorage.remove_tree

    def slow(self, path):  # a multi-GB checkpoint's deletion, still running on the old Saver's thread
        if os.path.basename(path) == PRUNED_DIR and threading.current_thread().name == "recsave-prune":
            release.wait(timeout=30)
        real(self, path)

    monkeypatch.setattr(LocalStorage, "remove_tree", slow)
    _save_steps(job, [2])
    del job
    gc.collect()
    other = make_job(out, max_keep=1)  # another writer in this process: the lock is free
    other.saver.load()
    _save_steps(other, [3])
    release.set()
    other.saver.wait()
    assert listing(out) == ["checkpoint", "ckpt_3"]
    other.saver.close()


def test_a_symlink_in_the_pruned_dir_s_place_is_not_followed(tmp_path):
    out = tmp_path / "run"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    job = make_job(str(out), max_keep=1)
    _save_steps(job, [1])
    os.symlink(elsewhere, out / PRUNED_DIR)
    _save_steps(job, [2, 3])
    job.saver.close()
    assert os.listdir(elsewhere) == []  # deleted in place, nothing moved out of the output dir
    assert listing(out) == [PRUNED_DIR, "checkpoint", "ckpt_3"]


def test_a_file_in_the_pruned_dir_s_place_is_kept_and_pruning_deletes_in_place(tmp_path):
    out = tmp_path / "run"
    job = make_job(str(out), max_keep=1)
    _save_steps(job, [1])
    (out / PRUNED_DIR).write_text("the user's")
    _save_steps(job, [2])
    assert not (out / "ckpt_1" / "index").exists()  # the index at once, the rest on the thread
    job.saver.wait()
    assert listing(out) == [PRUNED_DIR, "checkpoint", "ckpt_2"]
    assert (out / PRUNED_DIR).read_text() == "the user's"
    job.saver.close()


def test_object_stores_delete_the_index_at_once_and_the_rest_on_the_thread(monkeypatch):
    """memory:// has no cheap rename: the pruned checkpoint's index goes in the save (its id is
    gone), its other objects on the thread, which keeps the writer lock held even after the Saver
    is dropped; a new writer of this process waits for the deletion, then takes the lock."""
    url = f"memory://prune-{uuid.uuid4().hex}/run"
    st = get_storage(url)
    saver = Saver(CTR(seed=0), output_dir=url, max_keep=1)
    saver.save("ckpt_1")
    release, blocked = threading.Event(), []
    real = type(st).remove_tree

    def slow(self, path):
        if threading.current_thread().name == "recsave-prune":
            blocked.append(release.wait(timeout=30))
        real(self, path)

    monkeypatch.setattr(type(st), "remove_tree", slow)
    saver.save("ckpt_2")  # returns while the deletion of ckpt_1's objects is held
    assert not blocked and ckptlist.read(st, url) == ["ckpt_2"]
    assert not st.exists(f"{url}/ckpt_1/index") and st.exists(f"{url}/ckpt_1/model.pt")
    assert PRUNED_DIR not in st.listdir(url)
    lock_file = f"{url}/{LOCK_FILE}"
    held_by = st.read_bytes(lock_file, 1 << 16)
    del saver
    gc.collect()
    assert st.read_bytes(lock_file, 1 << 16) == held_by  # a dropped Saver's lock stays until the deletion ends
    timer = threading.Timer(0.3, release.set)
    timer.start()
    other = Saver(CTR(seed=0), output_dir=url, max_keep=1)
    other.save("ckpt_3")  # waited for the deletion, then took the lock
    timer.join()
    assert blocked[0] is True and st.read_bytes(lock_file, 1 << 16) != held_by
    other.wait()
    assert sorted(n for n in st.listdir(url) if n.startswith("ckpt_")) == ["ckpt_3"]
    other.close()


def _held_deletion(monkeypatch, st, url):
    """remove_tree on the pruning thread waits for the returned event and records whether the
    writer lock file still existed when it went on."""
    release, lock_there = threading.Event(), []
    real = type(st).remove_tree

    def slow(self, path):
        if threading.current_thread().name == "recsave-prune":
            release.wait(timeout=30)
            lock_there.append(st.exists(f"{url}/{LOCK_FILE}"))
        real(self, path)

    monkeypatch.setattr(type(st), "remove_tree", slow)
    return release, lock_there


def _pruned_in_place_and_held(monkeypatch):
    """A memory:// Saver whose second save pruned ckpt_1 in place, its deletion held (_held_deletion)."""
    url = f"memory://prune-{uuid.uuid4().hex}/run"
    st = get_storage(url)
    saver = Saver(CTR(seed=0), output_dir=url, max_keep=1)
    saver.save("ckpt_1")
    release, lock_there = _held_deletion(monkeypatch, st, url)
    saver.save("ckpt_2")
    return url, st, saver, release, lock_there


def test_close_keeps_the_lock_until_an_in_place_deletion_ends(monkeypatch):
    url, st, saver, release, lock_there = _pruned_in_place_and_held(monkeypatch)
    threading.Timer(0.3, release.set).start()
    saver.close()
    assert lock_there == [True] and not st.exists(f"{url}/{LOCK_FILE}")


def test_an_in_place_deletion_longer_than_the_lease_keeps_it_renewed(monkeypatch):
    """While the thread deletes a pruned checkpoint in place (its name still in use), a writer of
    another host must not take the lock over as stale, however long the deletion takes."""
    from recsave.storage.lock import WriterLock

    with knobs.override(writer_lease_s=0.3):
        url, st, saver, release, lock_there = _pruned_in_place_and_held(monkeypatch)
        time.sleep(1.0)  # three leases into the held deletion
        with pytest.raises(WriterLockedError, match="being written by another Saver"):
            WriterLock(st, url).acquire()
        release.set()
        saver.close()
    assert lock_there == [True] and not st.exists(f"{url}/ckpt_1")


def test_an_interrupted_close_leaves_the_lock_to_the_deleting_thread(monkeypatch):
    """A KeyboardInterrupt while close() waits: the lock is not released under the deletion (another
    writer could save into the name being deleted); the thread releases it when done."""
    from concurrent.futures import Future

    url, st, saver, release, lock_there = _pruned_in_place_and_held(monkeypatch)
    real_result, interrupted = Future.result, []

    def interrupt(self, timeout=None):
        if threading.current_thread() is threading.main_thread() and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return real_result(self, timeout)

    monkeypatch.setattr(Future, "result", interrupt)
    with pytest.raises(KeyboardInterrupt):
        saver.close()
    assert st.exists(f"{url}/{LOCK_FILE}") and st.exists(f"{url}/ckpt_1/model.pt")
    release.set()
    saver.wait()  # the deletion still counts as running: waited for again
    assert lock_there == [True] and not st.exists(f"{url}/ckpt_1")
    for _ in range(100):  # the thread drops its reference, the lock's finalizer releases it
        if not st.exists(f"{url}/{LOCK_FILE}"):
            break
        time.sleep(0.05)
    assert not st.exists(f"{url}/{LOCK_FILE}")


def test_without_the_writer_lock_object_stores_prune_inline(monkeypatch):
    """With the knob writer_lock off nothing would keep another writer out of a name being deleted
    on the thread: the deletion stays in the save."""
    url = f"memory://prune-{uuid.uuid4().hex}/run"
    st = get_storage(url)
    release, lock_there = _held_deletion(monkeypatch, st, url)  # a deletion on the thread would wait
    with knobs.override(writer_lock=False):
        saver = Saver(CTR(seed=0), output_dir=url, max_keep=1)
        saver.save("ckpt_1")
        saver.save("ckpt_2")
        assert sorted(n for n in st.listdir(url) if n.startswith("ckpt_")) == ["ckpt_2"]
        release.set()
        saver.close()
    assert lock_there == []


def test_a_restore_after_pruning_loads_the_kept_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=1)
    _save_steps(job, [1, 2, 3])
    expected = job_state(job)
    job.saver.close()
    fresh = make_job(out)
    fresh.saver.load()
    assert ckptlist.read(LocalStorage(), out) == ["ckpt_3"]
    assert_jobs_equal(job_state(fresh), expected)
    fresh.saver.close()


def test_in_place_pruning_deletes_the_index_first(monkeypatch):
    """Without a rename (object stores) a process that dies while deleting leaves a directory
    without an index: a rebuilt list does not take it for a committed checkpoint."""
    from recsave.errors import StorageError

    url = f"memory://prune-{uuid.uuid4().hex}/run"
    st = get_storage(url)
    saver = Saver(CTR(seed=0), output_dir=url, max_keep=1)
    saver.save("ckpt_1")

    def dies(self, path):  # stands in for the process dying after the first DELETE
        raise StorageError(f"{path}: deleting failed (injected)", path=path)

    monkeypatch.setattr(type(st), "remove_tree", dies)
    saver.save("ckpt_2")
    with pytest.warns(RuntimeWarning, match="deleting pruned checkpoints failed"):
        saver.wait()
    monkeypatch.undo()
    assert not st.exists(f"{url}/ckpt_1/index") and st.exists(f"{url}/ckpt_1/model.pt")
    st.remove_file(f"{url}/checkpoint")
    with pytest.warns(RuntimeWarning, match="rebuilt the list"):
        assert ckptlist.committed(st, url, rewrite=True).ids == ["ckpt_2"]
    saver.save("ckpt_3")  # its collection removes the leftover
    assert sorted(n for n in st.listdir(url) if n.startswith("ckpt_")) == ["ckpt_3"]
    saver.close()


def test_the_next_save_waits_for_the_last_deletion_before_it_looks(tmp_path, monkeypatch):
    """Without the wait, the next save's collection would delete the same directory alongside the
    thread and replace the pending deletion (whose warning would be lost)."""
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=1)
    _save_steps(job, [1])
    release, order = threading.Event(), []
    real_remove, real_committed = LocalStorage.remove_tree, ckptlist.committed

    def slow(self, path):
        if os.path.basename(path) == PRUNED_DIR and threading.current_thread().name == "recsave-prune":
            release.wait(timeout=30)
            real_remove(self, path)
            order.append("deleted")
            return
        real_remove(self, path)

    def committed(*args, **kwargs):
        order.append("looked")
        return real_committed(*args, **kwargs)

    monkeypatch.setattr(LocalStorage, "remove_tree", slow)
    _save_steps(job, [2])  # its deletion of ckpt_1 is held
    monkeypatch.setattr(ckptlist, "committed", committed)
    timer = threading.Timer(0.3, release.set)
    timer.start()
    _save_steps(job, [3])
    timer.join()
    assert order[0] == "deleted", order
    job.saver.close()


def test_gc_names_a_pruned_dir_a_dead_writer_left(tmp_path):
    from recsave.tools import catalog

    out = tmp_path / "run"
    job = make_job(str(out), max_keep=2)
    _save_steps(job, [1, 2])
    job.saver.close()
    shutil.copytree(out / "ckpt_1", out / PRUNED_DIR / "ckpt_0-999-0")
    assert catalog.clean_output_dir(str(out)) == {"removed_checkpoints": [PRUNED_DIR], "removed_temp_files": [],
                                                  "aborted_uploads": [], "kept_broken": {}}
    assert listing(out) == ["checkpoint", "ckpt_1", "ckpt_2"]


@pytest.mark.parametrize("error", [OSError("disk gone (injected)"), RuntimeError("a bug (injected)")])
def test_a_failed_pruning_warns_and_the_committed_save_returns(tmp_path, monkeypatch, error):
    """Pruning runs after the new checkpoint is committed and listed: whatever it raises is a
    warning (the next save prunes again), never an error that reports the committed save as failed."""
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=1)
    _save_steps(job, [1])

    def failing(*args, **kwargs):
        raise error
    monkeypatch.setattr(ckptlist, "collect_garbage", failing)
    job.train(1)
    with pytest.warns(RuntimeWarning, match=f"pruning old checkpoint directories failed .{type(error).__name__}"):
        assert job.saver.save("ckpt_2") == os.path.join(out, "ckpt_2")
    assert job.saver.checkpoints() == [os.path.join(out, "ckpt_2")]
    assert os.path.isdir(os.path.join(out, "ckpt_1"))  # left for the next save
    fresh = make_job(out)
    fresh.saver.load()
    assert_jobs_equal(job_state(fresh), job_state(job))
    monkeypatch.undo()
    _save_steps(job, [3])  # prunes what the failed pruning left
    job.saver.wait()
    assert [n for n in listing(out) if n.startswith("ckpt_")] == ["ckpt_3"]
    job.saver.close()


def _rank_copy(out, ckpt_id, files=("sparse-1-0.safetensors", "io_state_1.pt")):
    """A checkpoint directory as a rank other than 0 writes it into its own output dir."""
    os.makedirs(os.path.join(out, ckpt_id))
    for name in files:
        with open(os.path.join(out, ckpt_id, name), "wb") as f:
            f.write(b"x")


def test_a_rank_prunes_its_own_dir_of_what_rank_0_pruned_never_a_shared_one(tmp_path, monkeypatch):
    """What a rank other than 0 does after a commit whose rotation removed checkpoints from rank 0's
    dir (the multi-rank runs: tests/test_multirank.py): in a dir of its own it removes its copies
    of those (recsave's files alone), never the one just written nor another program's directory;
    in a dir holding a `checkpoint` list or a writer lock (shared with rank 0) nothing; a failure
    is a RuntimeWarning."""
    from recsave.save.pipeline import CheckpointWriter

    out = str(tmp_path / "rank1")
    for ckpt_id in ("ckpt_1", "ckpt_2", "ckpt_3"):
        _rank_copy(out, ckpt_id)
    _rank_copy(out, "ckpt_0", files=("sparse-1-0.safetensors", "notes.txt"))  # not recsave's alone
    writer = CheckpointWriter(LocalStorage(), out, 1, 1, 16)
    writer._prune_own_dir("ckpt_3", ["ckpt_0", "ckpt_1", "ckpt_3", "ckpt_7"])
    writer.settle()
    assert sorted(os.listdir(out)) == ["ckpt_0", "ckpt_2", "ckpt_3"]

    for marker in (ckptlist.LIST_FILE, LOCK_FILE):  # a dir rank 0 writes into: its rotation prunes it
        shared = str(tmp_path / f"shared-{marker}")
        _rank_copy(shared, "ckpt_1")
        open(os.path.join(shared, marker), "w").close()
        writer = CheckpointWriter(LocalStorage(), shared, 1, 1, 16)
        writer._prune_own_dir("ckpt_2", ["ckpt_1"])
        writer.settle()
        assert sorted(os.listdir(shared)) == sorted(["ckpt_1", marker])

    def failing(self, path):
        raise OSError(5, "Input/output error (injected)")
    monkeypatch.setattr(LocalStorage, "move_tree_aside", lambda self, path, to: False)
    monkeypatch.setattr(LocalStorage, "remove_tree", failing)
    writer = CheckpointWriter(LocalStorage(), out, 1, 1, 16)
    with pytest.warns(RuntimeWarning, match="ckpt_2.*Input/output error"):
        writer._prune_own_dir("ckpt_3", ["ckpt_2"])
