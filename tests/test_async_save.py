"""Saver.async_save and CheckpointManager(async_mode=...): the checkpoint holds the state at the
call, byte-identical to a synchronous save; background failures surface; the manager's modes."""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
from helpers import assert_jobs_equal, checkpoint_bytes, job_state, make_job
from test_faults import faulty, inject  # noqa: F401  (fixture)

from recsave import CheckpointManager, HashTable, Saver, knobs
from recsave.errors import StorageError, UsageError
from recsave.save import pipeline as saver_mod
from recsave.tables.optim import SparseAdagrad


@pytest.mark.parametrize("knob_values", [{}, {"segment_bytes": 512, "write_block_bytes": 1024}])
def test_async_and_sync_checkpoints_are_byte_identical(tmp_path, knob_values):
    a, b = make_job(str(tmp_path / "sync")), make_job(str(tmp_path / "async"))
    a.train(4)
    b.train(4)
    with knobs.override(**knob_values):  # overrides are per thread: the writer thread must see them
        sync_dir = a.saver.save("ckpt_4")
        stage, write = b.saver.async_save("ckpt_4")
    assert stage.done() and stage.result() is None
    assert write.result(timeout=60) == str(tmp_path / "async" / "ckpt_4")
    sync_files, async_files = checkpoint_bytes(sync_dir), checkpoint_bytes(write.result())
    assert sorted(sync_files) == sorted(async_files)
    assert len([n for n in sync_files if n.startswith("sparse-")]) >= 1
    for name in sync_files:
        assert sync_files[name] == async_files[name], name
    if knob_values:  # both saves really used the overridden segment size (on their helper threads)
        import json
        for tensor in json.loads(sync_files["index"])["tensors"].values():
            for chunk in tensor["chunks"]:
                ends = chunk.get("segments", [])
                assert all(b - a <= 512 for a, b in zip([0] + ends, ends)), ends
    a.saver.close()
    b.saver.close()


class _Gate:
    """Holds the background write at its start until released, so training provably runs between
    the snapshot and the write."""

    def __init__(self, monkeypatch):
        self.started, self.release = threading.Event(), threading.Event()
        real = saver_mod.write_shards

        def gated(*args, **kw):
            self.started.set()
            assert self.release.wait(60)
            return real(*args, **kw)
        monkeypatch.setattr(saver_mod, "write_shards", gated)


def held_async_save(job, monkeypatch, ckpt_id: str):
    """async_save(ckpt_id) with its write held at its start until gate.release is set; returns
    (gate, write future, the job state at the call)."""
    state = job_state(job)
    gate = _Gate(monkeypatch)
    stage, write = job.saver.async_save(ckpt_id)
    assert stage.done() and gate.started.wait(60) and not write.done()
    return gate, write, state


def test_snapshot_is_exact_while_training_changes_the_model(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    job = make_job(out)
    job.train(3)
    gate, write, at_3 = held_async_save(job, monkeypatch, "ckpt_3")
    job.train(6)  # new ids (tables grow and reallocate), optimizer and dense updates
    job.model.user.delete(job.model.user.ids()[:10])
    gate.release.set()
    assert write.result(timeout=60).endswith("ckpt_3")
    after = job_state(job)
    with pytest.raises(AssertionError):
        assert_jobs_equal(after, at_3)  # training did change the model...
    fresh = make_job(out)
    fresh.saver.load()
    assert_jobs_equal(job_state(fresh), at_3)  # ...but not the checkpoint


class _SlowIoState:
    """An io state whose dump on thread "A" waits until released, recording who dumped when."""

    def __init__(self):
        self.events, self.a_inside, self.b_inside, self.go = [], threading.Event(), threading.Event(), threading.Event()

    def dump_io_state(self):
        me = threading.current_thread().name
        self.events.append(f"{me} in")
        if me == "A":
            self.a_inside.set()
            assert self.go.wait(60)
        else:
            self.b_inside.set()
        self.events.append(f"{me} out")
        return {}

    def load_io_state(self, state):
        pass


def test_a_saver_used_from_two_threads_takes_their_calls_in_turn(tmp_path):
    """Thread B's async_save while thread A's was in its snapshot copied into the host buffers
    A's snapshot was filling, replaced A's pending write, and committed a checkpoint holding the
    other call's state. B now waits for A's call to return; each checkpoint holds its own call's
    state and wait() tracks the last write."""
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=None)
    job.train(2)
    slow = _SlowIoState()
    job.saver.register_io_state("slow", slow)
    at_a = job_state(job)
    results = {}
    a = threading.Thread(name="A", target=lambda: results.setdefault("A", job.saver.async_save("ckpt_a")))
    a.start()
    assert slow.a_inside.wait(60)
    b = threading.Thread(name="B", target=lambda: results.setdefault("B", job.saver.async_save("ckpt_b")))
    b.start()
    slow.b_inside.wait(3)  # without turns B would be in its snapshot by now
    slow.go.set()
    a.join(60)
    b.join(60)
    assert slow.events == ["A in", "A out", "B in", "B out"]
    assert results["A"][1].result(timeout=60).endswith("ckpt_a")
    assert results["B"][1].result(timeout=60).endswith("ckpt_b")
    assert job.saver.wait().endswith("ckpt_b")
    job.saver.close()
    assert [os.path.basename(p) for p in job.saver.checkpoints()] == ["ckpt_a", "ckpt_b"]
    for ckpt in ("ckpt_a", "ckpt_b"):  # no training in between: both hold the state of A's call
        fresh = make_job(out)
        fresh.saver.register_io_state("slow", _SlowIoState())
        fresh.saver.load(ckpt_id=ckpt)
        assert_jobs_equal(job_state(fresh), at_a)


@pytest.mark.parametrize("setting", ["max_keep", "concurrency"])
def test_a_setting_changed_during_a_save_on_another_thread_applies_after_it(tmp_path, setting):
    """Setters take their turn like the calls: max_keep lowered while thread A's save was in its
    snapshot pruned by the new value in A's commit, deleting checkpoints A's caller meant to keep."""
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=None)
    for ckpt in ("ckpt_1", "ckpt_2"):
        job.train(1)
        job.saver.save(ckpt)
    slow = _SlowIoState()
    job.saver.register_io_state("slow", slow)
    a = threading.Thread(name="A", target=lambda: job.saver.save("ckpt_3"))
    a.start()
    assert slow.a_inside.wait(60)
    change = threading.Thread(target=lambda: setattr(job.saver, setting, 1))
    change.start()
    change.join(2)
    assert change.is_alive()  # waits for A's call
    slow.go.set()
    a.join(60)
    change.join(60)
    assert getattr(job.saver, setting) == 1
    assert [os.path.basename(p) for p in job.saver.checkpoints()] == ["ckpt_1", "ckpt_2", "ckpt_3"]
    job.saver.close()


def test_retention_changed_while_an_async_write_runs_applies_from_the_next_save(tmp_path, monkeypatch):
    """max_keep lowered after async_save returned, while its write ran:
    the commit pruned by the new settings, deleting checkpoints the call meant to keep. A write
    commits under the settings of its call; the next save applies the new ones."""
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=None)
    for ckpt in ("ckpt_1", "ckpt_2"):
        job.train(1)
        job.saver.save(ckpt)
    job.train(1)
    gate, write, _ = held_async_save(job, monkeypatch, "ckpt_3")
    job.saver.max_keep = 1
    gate.release.set()
    assert write.result(timeout=60).endswith("ckpt_3")
    listed = [os.path.basename(p) for p in job.saver.checkpoints()]
    assert listed == ["ckpt_1", "ckpt_2", "ckpt_3"]
    job.train(1)
    job.saver.save("ckpt_4")
    assert [os.path.basename(p) for p in job.saver.checkpoints()] == ["ckpt_4"]
    job.saver.close()


def test_training_concurrently_with_an_unhindered_write(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out)
    job.train(2)
    expected = {}
    for step in (2, 4, 6):
        expected[step] = job_state(job)
        _, write = job.saver.async_save(f"ckpt_{step}")
        job.train(2)  # runs while the write goes on (or after it finished: both must be exact)
        write.result(timeout=60)
    for step, state in expected.items():
        fresh = make_job(out)
        fresh.saver.load(ckpt_id=f"ckpt_{step}")
        assert_jobs_equal(job_state(fresh), state)
    job.saver.close()


def test_staging_buffers_are_reused_between_saves(tmp_path):
    job = make_job(str(tmp_path / "run"))
    job.train(2)
    job.saver.async_save("ckpt_2")
    job.saver.wait()
    ptrs = {k: b.data_ptr() for k, b in job.saver._stager._buffers.items()}
    job.train(1)  # few new ids: the headroom of the table buffers absorbs them
    job.saver.async_save("ckpt_3")
    job.saver.wait()
    assert {k: b.data_ptr() for k, b in job.saver._stager._buffers.items()} == ptrs
    job.saver.close()
    assert job.saver._stager is None


def _enospc():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failed_background_write_is_logged_when_it_fails(faulty, caplog):
    """A job may exit before its next save / wait() / close(): the failure is logged at once."""
    job = make_job(f"{faulty}/run")
    job.train(1)
    inject("open", _enospc, times=100, path_contains="sparse-")
    with caplog.at_level(logging.ERROR, logger="recsave"):
        _, write = job.saver.async_save("ckpt_3")
        with pytest.raises(StorageError):
            write.result(timeout=60)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("recsave: the background write of async_save('ckpt_3') "
                                                     "failed (StorageError: ")
    assert "the error is raised by the next save, wait() or close()" in errors[0]
    from test_faults import FaultyFS
    FaultyFS.rules = []
    with pytest.raises(StorageError):
        job.saver.wait()


@pytest.mark.parametrize("surface", ["next_save", "wait", "close"])
def test_a_failed_background_write_is_reported_and_the_previous_checkpoint_stays_latest(faulty, surface):
    out = f"{faulty}/run"
    job = make_job(out)
    job.train(2)
    job.saver.save("ckpt_2")
    at_2 = job_state(job)
    job.train(1)
    inject("open", _enospc, times=100, path_contains="sparse-")
    _, write = job.saver.async_save("ckpt_3")
    with pytest.raises(StorageError) as exc:
        write.result(timeout=60)
    assert exc.value.errno == errno.ENOSPC
    assert job.saver.checkpoints() == [f"{out}/ckpt_2"]
    job.saver.load()  # a load waits for the write but leaves its error for the next save
    assert_jobs_equal(job_state(job), at_2)
    with pytest.raises(StorageError) as again:
        {"next_save": lambda: job.saver.save("ckpt_4"), "wait": job.saver.wait,
         "close": job.saver.close}[surface]()
    assert again.value is exc.value
    assert any("async_save('ckpt_3')" in note for note in again.value.__notes__)
    from test_faults import FaultyFS
    FaultyFS.rules = []
    assert job.saver.wait() is None  # reported once
    job.saver.save("ckpt_4")
    assert job.saver.checkpoints() == [f"{out}/ckpt_2", f"{out}/ckpt_4"]


def test_a_load_waits_for_the_pending_write(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    job = make_job(out)
    job.train(2)
    job.saver.save("ckpt_2")
    job.train(2)
    at_4 = job_state(job)
    gate = _Gate(monkeypatch)
    job.saver.async_save("ckpt_4")
    assert gate.started.wait(60)
    threading.Timer(0.2, gate.release.set).start()
    job.train(1)
    report = job.saver.load()
    assert report.step == 4 and report.checkpoints[-1].endswith("ckpt_4")
    assert_jobs_equal(job_state(job), at_4)


@pytest.mark.parametrize("mode", ["async", "async_pinned"])
def test_manager_autosaves_in_the_background(tmp_path, mode):
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, async_mode=mode)
    states = {}
    for step in range(1, 7):
        job.train(1)
        if step % 2 == 0:
            states[step] = job_state(job)
    job.train(1)
    final = job.manager.save()  # forced at the end of training: waits until committed
    states[7] = job_state(job)
    assert final.endswith("ckpt_7") and job.saver.pending_checkpoint is None
    assert [p.rsplit("/", 1)[-1] for p in job.saver.checkpoints()] == ["ckpt_4", "ckpt_6", "ckpt_7"]
    for step in (4, 6, 7):
        fresh = make_job(out, save_interval=2)
        assert fresh.manager.restore(step) == step
        assert_jobs_equal(job_state(fresh), states[step])
    job.manager.close()


def test_manager_rejects_an_unknown_async_mode(tmp_path):
    saver = Saver(torch.nn.Linear(2, 2), output_dir=str(tmp_path))
    with pytest.raises(UsageError, match="async_mode must be one of"):
        CheckpointManager(saver, 2, async_mode="background")


def test_manager_save_of_a_step_being_written_waits_for_it(tmp_path, monkeypatch):
    job = make_job(str(tmp_path / "run"), save_interval=0, async_mode="async")
    job.train(2)
    gate = _Gate(monkeypatch)
    path = job.manager.save(wait=False)
    assert gate.started.wait(60) and job.saver.pending_checkpoint == "ckpt_2"
    threading.Timer(0.2, gate.release.set).start()
    assert job.manager.save() == path  # same step: no second save, waits for the first
    assert job.saver.checkpoints() == [path]
    assert job.manager.wait() is None


def test_tables_with_the_tensor_id_map_save_async_like_sync(tmp_path):
    def model():
        m = torch.nn.Module()
        m.t = HashTable(4, name="t", id_map="tensor", seed=3)
        return m
    a, b = model(), model()
    opts = [SparseAdagrad(m, lr=0.1) for m in (a, b)]
    for m, opt in zip((a, b), opts):
        m.t(torch.arange(-500, 500, 3)).sum().backward()
        opt.step()
    Saver(a, opts[0], output_dir=str(tmp_path / "a")).save("ckpt_1")
    _, write = Saver(b, opts[1], output_dir=str(tmp_path / "b")).async_save("ckpt_1")
    assert checkpoint_bytes(str(tmp_path / "a" / "ckpt_1")) == checkpoint_bytes(write.result(timeout=60))
    c = model()
    Saver(c, SparseAdagrad(c, lr=0.1), output_dir=str(tmp_path / "b")).load()
    ids = torch.arange(-500, 500, 3)
    (_, va, sa), (_, vc, sc) = a.t.export(ids), c.t.export(ids)
    assert torch.equal(va, vc) and sa.keys() == sc.keys() == {"adagrad_acc"}
    assert torch.equal(sa["adagrad_acc"], sc["adagrad_acc"])


def run_script(script: str, *args: str, **env: str) -> "subprocess.CompletedProcess[str]":
    """`script` run by a new interpreter with recsave importable from this checkout; it must exit
    0 without a traceback."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script, *args], env=dict(os.environ, PYTHONPATH=root, **env),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc


def assert_one_checkpoint_of_rows(out: str, dim: int, name: str, rows: int) -> None:
    """`out` lists ckpt_1 alone, and it loads a table `name` of `rows` rows."""
    with open(os.path.join(out, "checkpoint")) as f:
        assert f.read().split() == ["ckpt_1"]
    table = HashTable(dim, name=name)
    Saver(torch.nn.ModuleDict({name: table}), output_dir=out).load()
    assert len(table) == rows


EXIT_DURING_WRITE = """
import sys, time, torch
from recsave import HashTable, Saver
table = HashTable(16, name="big")
table.lookup(torch.arange(1_500_000, dtype=torch.int64) * 3, insert=True)
model = torch.nn.ModuleDict({"big": table})
saver = Saver(model, output_dir=sys.argv[1])
saver.async_save("ckpt_1")
time.sleep(float(sys.argv[2]))
print("main thread ends", flush=True)
"""


@pytest.mark.slow  # three new processes (each imports torch) that exit mid-write
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
def test_a_write_running_when_the_script_ends_still_commits(tmp_path, delay):
    """The script's main thread ends while the background write runs (early, in the middle, at
    the fsyncs): Python joins the writer, which must still finish and commit (no executor may
    refuse its work at shutdown)."""
    out = str(tmp_path / "run")
    run_script(EXIT_DURING_WRITE, out, str(delay), RECSAVE_FSYNC="1")
    assert_one_checkpoint_of_rows(out, 16, "big", 1_500_000)


ASYNC_SAVE_AT_EXIT = """
import atexit, sys, torch
from recsave import HashTable, Saver
table = HashTable(4, name="t")
table.lookup(torch.arange(1000, dtype=torch.int64), insert=True)
saver = Saver(torch.nn.ModuleDict({"t": table}), output_dir=sys.argv[1])
atexit.register(lambda: saver.async_save("ckpt_1"))  # runs while the interpreter shuts down
"""


def test_an_async_save_started_at_interpreter_exit_still_commits(tmp_path):
    """An atexit handler (or a thread outliving the main one) runs after the interpreter began
    its shutdown, when executors refuse new work: the background write must still run."""
    out = str(tmp_path / "run")
    run_script(ASYNC_SAVE_AT_EXIT, out)
    assert_one_checkpoint_of_rows(out, 4, "t", 1000)


def test_restore_waits_for_a_save_still_being_written(tmp_path, monkeypatch):
    """restore() lists the checkpoints after the pending background write is done: before, it
    found nothing and returned 0 (the model not rewound), or refused the step being written."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=0, async_mode="async")
    job.train(3)
    job.manager.global_step = 3
    at_3 = job_state(job)
    gate = _Gate(monkeypatch)
    job.manager.save(wait=False)
    assert gate.started.wait(60)
    job.train(2)
    threading.Timer(0.3, gate.release.set).start()  # the write goes on once restore() waits
    assert job.manager.restore() == 3
    assert_jobs_equal(job_state(job), at_3)
    job.train(1)
    job.manager.global_step = 4
    gate.started.clear()
    gate.release.clear()
    job.manager.save(wait=False)
    assert gate.started.wait(60)
    threading.Timer(0.3, gate.release.set).start()
    assert job.manager.restore(4) == 4  # an explicit step being written is found, not refused
    job.manager.close()


AFTER_MAIN_THREAD = """
import sys, threading, time, torch
from recsave import HashTable, Saver

def job():
    time.sleep(0.3)  # the main thread has ended by now: the interpreter is shutting down
    table = HashTable(4, name="t")
    table.lookup(torch.arange(1000, dtype=torch.int64), insert=True)
    saver = Saver(torch.nn.ModuleDict({"t": table}), output_dir=sys.argv[1])
    saver.async_save("ckpt_1")
    saver.wait()
    fresh = HashTable(4, name="t")
    Saver(torch.nn.ModuleDict({"t": fresh}), output_dir=sys.argv[1]).load()
    ids = torch.arange(1000, dtype=torch.int64)
    print("loaded", len(fresh), bool(torch.equal(fresh.export(ids)[1], table.export(ids)[1])), flush=True)

threading.Thread(target=job).start()
"""


def test_a_thread_outliving_the_main_one_saves_async_and_loads(tmp_path):
    """Executors refuse work once the main thread has ended; a training loop on a thread of its
    own still saves (the write runs inline) and restores (the fill runs inline)."""
    proc = run_script(AFTER_MAIN_THREAD, str(tmp_path / "run"))
    assert proc.stdout.split() == ["loaded", "1000", "True"]


def test_an_async_save_of_a_committed_id_is_refused_at_the_call(tmp_path):
    """One process: the refusal comes at async_save (as it does at save), not from the
    background write at the next save / wait / close; the committed checkpoint stays."""
    from recsave.errors import CheckpointExistsError

    out = str(tmp_path / "run")
    job = make_job(out)
    job.train(2)
    job.saver.save("ckpt_2")
    before = checkpoint_bytes(os.path.join(out, "ckpt_2"))
    job.train(1)
    with pytest.raises(CheckpointExistsError, match="is a committed checkpoint already"):
        job.saver.async_save("ckpt_2")
    assert job.saver.pending_checkpoint is None and job.saver.wait() is None
    assert checkpoint_bytes(os.path.join(out, "ckpt_2")) == before
    job.saver.close()


def test_a_child_forked_during_an_async_write_closes_without_waiting_for_it(tmp_path, monkeypatch):
    """The write's thread is the parent's: a child forked while it runs holds no pending write,
    so its close() returns at once (it waited forever on a future no thread of its own would
    finish); the parent's write commits as usual."""
    out = str(tmp_path / "out")
    job = make_job(out, max_keep=None)
    job.train(1)
    go = threading.Event()
    real = saver_mod.CheckpointWriter.write

    def held_back(self, *args, **kwargs):
        go.wait(30)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(saver_mod.CheckpointWriter, "write", held_back)
    _, write = job.saver.async_save("ckpt_1")
    pid = os.fork()
    if pid == 0:
        import signal
        signal.alarm(10)  # a hang ends the child with SIGALRM
        code = 0 if job.saver.pending_checkpoint is None else 4
        job.saver.close()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    go.set()
    assert os.waitstatus_to_exitcode(status) == 0
    assert write.result(timeout=60) == os.path.join(out, "ckpt_1")
    job.saver.close()


def test_a_child_forked_while_pruning_runs_does_not_wait_for_it(tmp_path, monkeypatch):
    """Rotation's deletion runs on a thread of the parent: a child forked meanwhile (a data
    loader worker after a save) waits for none in wait() / close()."""
    from recsave.storage.local import LocalStorage

    out = str(tmp_path / "out")
    job = make_job(out, max_keep=1)
    go = threading.Event()
    real = LocalStorage.remove_tree

    def held_back(self, path):
        go.wait(30)
        return real(self, path)
    monkeypatch.setattr(LocalStorage, "remove_tree", held_back)
    job.train(1)
    job.saver.save("ckpt_1")
    job.train(1)
    job.saver.save("ckpt_2")  # prunes ckpt_1 on a thread, held back
    pid = os.fork()
    if pid == 0:
        import signal
        signal.alarm(10)  # a hang ends the child with SIGALRM
        job.saver.wait()
        job.saver.close()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    go.set()
    assert os.waitstatus_to_exitcode(status) == 0
    job.saver.close()
    assert sorted(os.listdir(out)) == ["checkpoint", "ckpt_2"]


def test_restore_raises_the_error_of_a_background_write_from_before_it(faulty):
    """An autosave's background write failed, then the job called restore(): restore() went back to
    the previous checkpoint without a word, and the error surfaced at the first autosave after it,
    which then saved nothing (an unrelated step failing for a write of the abandoned state).
    restore() raises it now, restoring nothing (the latest the user knew of is gone); reported
    once, a second restore() goes back to the previous checkpoint, and autosaves go on."""
    from test_faults import FaultyFS

    out = f"{faulty}/run"
    job = make_job(out, save_interval=2, async_mode="async")
    job.train(2)
    assert job.manager.wait() == f"{out}/ckpt_2"
    at_2 = job_state(job)
    inject("open", _enospc, times=100, path_contains="sparse-")
    job.train(2)  # the autosave of ckpt_4 fails in the background
    assert job.saver.pending_checkpoint == "ckpt_4"
    job.saver.wait_for_pending()
    at_4 = job_state(job)
    FaultyFS.rules = []  # the disk has room again: only the write of ckpt_4 failed
    with pytest.raises(StorageError) as exc:
        job.manager.restore()
    assert exc.value.errno == errno.ENOSPC
    assert any("async_save('ckpt_4')" in note for note in exc.value.__notes__)
    assert job.manager.global_step == 4 and job.saver.pending_checkpoint is None
    assert_jobs_equal(job_state(job), at_4)  # nothing restored
    assert job.manager.restore() == 2
    assert_jobs_equal(job_state(job), at_2)
    job.train(2)  # the autosave of ckpt_4 again: nothing from before the restore is raised
    assert job.manager.wait() == f"{out}/ckpt_4"
    assert job.saver.checkpoints() == [f"{out}/ckpt_2", f"{out}/ckpt_4"]
    job.manager.close()
