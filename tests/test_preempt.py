"""Preemption: a SIGTERM / SIGUSR1 makes CheckpointManager save on every rank, commit and raise
Preempted (exit status 143); a restart resumes bit-exact. Time-interval saves follow rank 0's clock.
In-process tests first, then real signals to training processes (tests/preempt_job.py)."""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import assert_jobs_equal, make_job

import recsave
from recsave import ArgumentTypeError, CheckpointManager, Preempted, UsageError
from recsave.errors import CorruptCheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "preempt_job.py")


@pytest.fixture
def restore_signals():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, h in before.items():
        signal.signal(s, h)


def _list(out):
    with open(os.path.join(out, "checkpoint")) as f:
        return f.read().split()


# ----------------------------------------------------------------------------------- in process
def test_preempted_is_a_system_exit_with_status_143():
    assert recsave.Preempted is recsave.errors.Preempted is Preempted
    exc = Preempted("saved x", path="/x", step=3)
    assert isinstance(exc, SystemExit) and not isinstance(exc, Exception)
    assert exc.code == 143 and str(exc) == "saved x" and exc.path == "/x" and exc.step == 3


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_makes_the_next_step_save_and_raise(tmp_path, restore_signals, sig, caplog):
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=None)
    mgr = CheckpointManager(job.saver, 5)
    job.manager = mgr
    job.train(3)
    os.kill(os.getpid(), sig)  # the handler only sets the flag: nothing is saved yet
    assert not os.path.exists(os.path.join(out, "checkpoint"))
    assert not mgr.preempted
    with caplog.at_level(logging.INFO, logger="recsave"), pytest.raises(Preempted) as info:
        job.train(1)
    assert info.value.code == 143 and info.value.step == 4
    assert info.value.path == os.path.join(out, "ckpt_4") and mgr.preempted
    assert _list(out) == ["ckpt_4"]
    assert f"signal {sig.name}" in str(info.value)
    assert [r.levelname for r in caplog.records if "preempted" in r.getMessage()] == ["WARNING"]
    fresh = make_job(out, save_interval=4)
    assert fresh.manager.restore() == 4
    mgr.close()
    fresh.manager.close()


def test_a_refused_metric_on_the_preempted_step_costs_the_metrics_not_the_save(tmp_path, restore_signals, caplog):
    """Alone, step(metrics=...) raised a refused metric (an evaluation gone NaN) before it looked
    at the preemption flag: the last chance to save was lost and the job died with a traceback.
    The save drops the metrics (a warning); without a signal the refusal is raised, no step taken."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=None)
    mgr = CheckpointManager(job.saver, 10)
    job.manager = mgr
    job.train(3)
    with pytest.raises(UsageError, match="metric 'auc' must be a finite"):
        mgr.step(metrics={"auc": float("nan")})
    assert mgr.global_step == 3
    os.kill(os.getpid(), signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="recsave"), pytest.raises(Preempted) as info:
        mgr.step(metrics={"auc": float("nan")})
    assert info.value.step == 4 and _list(out) == ["ckpt_4"]
    assert any("the preemption save drops its metrics" in r.getMessage() for r in caplog.records)
    assert job.saver.last_save.metrics in (None, {})
    mgr.close()


def test_check_preemption_saves_and_raises_between_steps(tmp_path, restore_signals):
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=None)
    mgr = CheckpointManager(job.saver, 0)
    job.manager = mgr
    job.train(2)
    mgr.check_preemption()  # no signal: nothing happens
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Preempted):
        mgr.check_preemption()
    assert _list(out) == ["ckpt_2"]
    mgr.close()


def test_a_failed_async_write_does_not_stop_the_preemption_save(tmp_path, restore_signals, monkeypatch):
    """The background write of ckpt_4 fails; a SIGTERM at step 5 still saves and commits ckpt_5
    (the failure is logged), instead of raising the old error and losing steps 3 to 5."""
    import recsave.save.pipeline as pipeline

    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, async_mode="async")
    job.train(2)
    job.manager.wait()
    real, failed = pipeline.index_mod.write_bytes, threading.Event()

    def failing(directory, *args, **kwargs):
        if directory.endswith("ckpt_4"):
            failed.set()
            raise OSError(5, "Input/output error (injected)")
        return real(directory, *args, **kwargs)

    monkeypatch.setattr(pipeline.index_mod, "write_bytes", failing)
    job.train(2)  # step 4: its async write fails in the background
    assert failed.wait(60)
    monkeypatch.setattr(pipeline.index_mod, "write_bytes", real)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Preempted) as caught:
        job.train(1)
    assert caught.value.path.endswith("ckpt_5") and _list(out) == ["ckpt_2", "ckpt_5"]
    job.manager.close()


@pytest.mark.parametrize("how", ["rewind", "fallback"])
def test_preempted_right_after_restoring_an_older_checkpoint(tmp_path, restore_signals, how):
    """Restored to ckpt_6 past ckpt_8 (a rewind, or a fallback past a damaged ckpt_8) and preempted
    before the next step: nothing to save (ckpt_6 holds the state), exit 143 with ckpt_6 listed
    last, so the restart resumes from it and not from the branch the restore left."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2)
    job.train(8)
    job.manager.close()
    if how == "fallback":
        for name in os.listdir(os.path.join(out, "ckpt_8")):
            if name.startswith("sparse-"):
                with open(os.path.join(out, "ckpt_8", name), "r+b") as f:
                    f.truncate(10)
    again = make_job(out, save_interval=2)
    assert again.manager.restore(global_step=6 if how == "rewind" else None) == 6
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Preempted) as caught:
        again.manager.check_preemption()
    assert caught.value.path.endswith("ckpt_6") and _list(out)[-1] == "ckpt_6"
    # The damaged ckpt_8 is unlisted with it: the restart knows nothing of the fallback, and
    # its save of step 8 would be refused as a committed checkpoint at every restart.
    assert ("ckpt_8" in _list(out)) == (how == "rewind")
    again.manager.close()
    third = make_job(out, save_interval=2)
    assert third.manager.restore() == 6
    if how == "fallback":
        third.train(2)
        assert _list(out)[-1] == "ckpt_8"
    third.manager.close()


def _assert_restores(out: str, step: int) -> None:
    """A restarted job (save_interval=2, max_keep=2) restores `step` from `out`."""
    job = make_job(out, save_interval=2, max_keep=2)
    assert job.manager.restore() == step
    job.manager.close()


def test_a_save_of_another_id_after_a_fallback_unlists_the_damaged_one(tmp_path, restore_signals):
    """Fallback past a damaged ckpt_8 to ckpt_6, then a save of ckpt_7 (a preemption): ckpt_8
    left listed made every restart refuse its autosave of step 8 as committed (a crash loop),
    and counted against max_keep, pruning the intact ckpt_6 instead. It is unlisted now, its
    directory left for inspection until the next save that may remove it."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=2)
    job.train(8)
    job.manager.close()
    for name in os.listdir(os.path.join(out, "ckpt_8")):
        if name.startswith("sparse-"):
            with open(os.path.join(out, "ckpt_8", name), "r+b") as f:
                f.truncate(10)
    again = make_job(out, save_interval=2, max_keep=2)
    assert again.manager.restore() == 6 and again.saver.damaged_checkpoints == {"ckpt_8"}
    again.train(1)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Preempted):
        again.manager.check_preemption()
    assert _list(out) == ["ckpt_6", "ckpt_7"] and os.path.isdir(os.path.join(out, "ckpt_8"))
    again.manager.close()
    third = make_job(out, save_interval=2, max_keep=2)
    assert third.manager.restore() == 7
    third.train(1)  # step 8 saves anew
    assert _list(out) == ["ckpt_7", "ckpt_8"]
    third.manager.close()
    _assert_restores(out, 8)


def test_a_restore_that_finds_every_checkpoint_damaged_lets_a_fresh_start_save_over_them(tmp_path, restore_signals):
    """When every listed checkpoint is damaged the restore raises (naming them all), and each is
    marked damaged, the oldest too: a job that starts afresh then saves over them. The oldest was
    left out, so the fresh job's first autosave (ckpt_2) was refused as committed."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=2)
    job.train(4)
    job.manager.close()
    for ckpt in ("ckpt_2", "ckpt_4"):
        for name in os.listdir(os.path.join(out, ckpt)):
            if name.startswith("sparse-"):
                with open(os.path.join(out, ckpt, name), "r+b") as f:
                    f.truncate(10)
    again = make_job(out, save_interval=2, max_keep=2)
    with pytest.warns(RuntimeWarning) as caught, pytest.raises(CorruptCheckpointError, match="ckpt_2"):
        again.manager.restore()
    assert [str(w.message).split(" (")[0] for w in caught][-1] == f"every committed checkpoint of {out} was tried " \
        "and none can be loaded"
    assert again.saver.damaged_checkpoints == {"ckpt_2", "ckpt_4"}
    again.train(4)  # a fresh start: steps 2 and 4 save anew over the damaged ones
    assert _list(out) == ["ckpt_2", "ckpt_4"]
    again.manager.close()
    _assert_restores(out, 4)


def test_a_fallback_never_skips_an_index_over_max_index_bytes(tmp_path, restore_signals):
    """An index over the knob max_index_bytes here may be intact (a job that raised the knob wrote
    it): a fallback restore skipped it as damage, marked it, and the next save of its id replaced
    the intact checkpoint. It stops there instead, marking nothing."""
    from recsave import knobs
    from recsave.errors import OverLimitError

    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=3)
    job.train(6)
    job.manager.close()
    index = os.path.join(out, "ckpt_6", "index")
    with open(index, "rb") as f:
        original = f.read()
    again = make_job(out, save_interval=2, max_keep=3)
    with knobs.override(max_index_bytes=len(original) - 1), pytest.raises(OverLimitError, match="max_index_bytes"):
        again.manager.restore()
    assert again.saver.damaged_checkpoints == frozenset() and _list(out) == ["ckpt_2", "ckpt_4", "ckpt_6"]
    assert again.manager.restore() == 6
    again.manager.close()
    with open(index, "rb") as f:
        assert f.read() == original


def test_a_checkpoint_loaded_whole_after_a_fallback_is_not_unlisted_as_damaged(tmp_path, restore_signals):
    """A shard missing for a while (a network file system) makes a fallback skip ckpt_6; once a
    load reads it whole it is intact, and a preemption's make_latest keeps it listed."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2)
    job.train(6)
    job.manager.close()
    shard = next(n for n in os.listdir(os.path.join(out, "ckpt_6")) if n.startswith("sparse-"))
    os.rename(os.path.join(out, "ckpt_6", shard), os.path.join(out, shard))
    again = make_job(out, save_interval=2)
    assert again.manager.restore() == 4 and "ckpt_6" in again.saver.damaged_checkpoints
    os.rename(os.path.join(out, shard), os.path.join(out, "ckpt_6", shard))
    assert again.manager.restore(global_step=6) == 6 and not again.saver.damaged_checkpoints
    assert again.manager.restore(global_step=4) == 4
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Preempted):
        again.manager.check_preemption()
    assert _list(out) == ["ckpt_2", "ckpt_6", "ckpt_4"]
    again.manager.close()


def test_preempted_right_after_a_rewind_with_tables_without_change_tracking(tmp_path, restore_signals):
    """A table without take_changes (a TableLike) leaves the Saver no delta baseline after a
    restore; the manager still knows the restored checkpoint holds the state until a load, a
    step or a model-bank load changes it."""
    from tablelike_table import TensorTable

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t = TensorTable(4, name="t")
            self.lin = torch.nn.Linear(2, 1)

    out = str(tmp_path / "run")
    model = Model()
    manager = CheckpointManager(recsave.Saver(model, output_dir=out, max_keep=None), 2)
    for _ in range(6):
        with torch.no_grad():
            model.lin.weight += 1
        manager.step()
    manager.close()
    fresh = Model()
    again = CheckpointManager(recsave.Saver(fresh, output_dir=out, max_keep=None), 2)
    assert again.restore(global_step=4) == 4 and again.saver.delta_parent is None
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Preempted) as caught:
        again.check_preemption()
    assert caught.value.path.endswith("ckpt_4") and _list(out) == ["ckpt_2", "ckpt_6", "ckpt_4"]
    again.close()


def test_handlers_chain_to_the_previous_one_and_close_restores_it(tmp_path, restore_signals):
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        job = make_job(str(tmp_path / "run"), save_interval=None)
        mgr = CheckpointManager(job.saver, 0)
        handler = signal.getsignal(signal.SIGUSR1)
        assert handler is not previous and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # chained
        mgr.close()
        assert signal.getsignal(signal.SIGUSR1) not in (handler,)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_manager_dropped_without_close_restores_the_handlers_when_collected(tmp_path):
    import gc

    before = signal.getsignal(signal.SIGTERM)
    job = make_job(str(tmp_path / "run"), save_interval=None)
    CheckpointManager(job.saver, 0)
    assert signal.getsignal(signal.SIGTERM) is not before
    del job  # the Saver (which keeps the manager alive through its global_step extra) goes too
    gc.collect()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("order", ["first_closed_first", "first_collected"])
def test_managers_closed_in_any_order_leave_the_original_handlers(tmp_path, restore_signals, order):
    """Not LIFO: closing the first manager while a second one's handler is installed over it used
    to leave the first's dead handler as the second's 'previous', which close() then reinstalled:
    SIGTERM only set a flag nobody read, and the process could no longer be terminated."""
    import gc

    seen = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    original, before_term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    first_job = make_job(str(tmp_path / "a"), save_interval=None)
    first = CheckpointManager(first_job.saver, 0)
    second = CheckpointManager(make_job(str(tmp_path / "b"), save_interval=None).saver, 0)
    if order == "first_closed_first":
        first.close()
    else:
        del first, first_job  # collected without close()
        gc.collect()
    second.close()
    assert signal.getsignal(signal.SIGTERM) is before_term
    assert signal.getsignal(signal.SIGUSR1) is original
    os.kill(os.getpid(), signal.SIGUSR1)
    assert seen == [signal.SIGUSR1]


def _idle() -> None:
    while True:
        time.sleep(0.05)


def test_a_forked_worker_still_ends_on_sigterm(tmp_path, restore_signals):
    """A process forked while a manager is alive (a DataLoader or multiprocessing worker) inherits
    its handler, which only set a flag nothing in the child acts on: Process.terminate() and
    Pool.terminate() then hung. In the child the handler does what the one before it would."""
    import multiprocessing
    job = make_job(str(tmp_path / "run"), save_interval=10)
    child = multiprocessing.get_context("fork").Process(target=_idle, daemon=True)
    child.start()
    try:
        child.terminate()
        child.join(20)
        assert child.exitcode == -signal.SIGTERM
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    job.manager.check_preemption()  # the parent's flag is untouched: no save, no Preempted
    job.manager.close()


def test_without_save_on_preemption_no_handler_is_installed(tmp_path, restore_signals):
    before = signal.getsignal(signal.SIGTERM)
    job = make_job(str(tmp_path / "run"), save_interval=None)
    mgr = CheckpointManager(job.saver, 0, save_on_preemption=False)
    assert signal.getsignal(signal.SIGTERM) is before
    mgr.close()


def test_a_manager_made_off_the_main_thread_warns_and_installs_nothing(tmp_path, restore_signals):
    before = signal.getsignal(signal.SIGTERM)
    job = make_job(str(tmp_path / "run"), save_interval=None)
    caught = []

    def make():
        with pytest.warns(RuntimeWarning, match="main thread") as rec:
            CheckpointManager(job.saver, 0)
        caught.extend(rec)
    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert len(caught) == 1 and signal.getsignal(signal.SIGTERM) is before


def test_time_interval_saves_by_the_clock(tmp_path):
    now = [0.0]
    job = make_job(str(tmp_path / "run"), save_interval=None)
    mgr = CheckpointManager(job.saver, 0, save_interval_seconds=10, clock=lambda: now[0],
                            save_on_preemption=False)
    saved = []
    for step in range(1, 30):
        now[0] = step * 3.0  # 3 s per step: a save every 4th step (12 s >= 10 s)
        job.train(1)
        if mgr.step() is not None:
            saved.append(step)
    assert saved == [4, 8, 12, 16, 20, 24, 28]
    now[0] = 100.0
    mgr.save()  # a manual save restarts the interval
    now[0] = 109.0
    assert mgr.step() is None
    mgr.close()


def _taking(saver, method: str, now, seconds: float) -> None:
    """Makes saver.<method> advance the test clock `now` by `seconds` (a slow save or load)."""
    real = getattr(saver, method)

    def slow(*args, **kwargs):
        out = real(*args, **kwargs)
        now[0] += seconds
        return out
    setattr(saver, method, slow)


def test_the_time_interval_runs_from_the_end_of_a_slow_save(tmp_path):
    """1 s per step, saves taking 15 s against an interval of 10 s: measured from a save's start,
    every step after the first save would save."""
    now = [0.0]
    job = make_job(str(tmp_path / "run"), save_interval=None, max_keep=2)
    mgr = CheckpointManager(job.saver, 0, save_interval_seconds=10, clock=lambda: now[0],
                            save_on_preemption=False)
    _taking(job.saver, "save", now, 15.0)
    saved = []
    for step in range(1, 25):
        job.train(1)
        now[0] += 1.0
        if mgr.step() is not None:
            saved.append(step)
    assert saved == [10, 20]
    mgr.close()


def test_the_time_interval_runs_from_the_end_of_a_restore(tmp_path):
    """A restore slower than the interval: the state it loaded is saved already, so the first
    steps after it do not save it again (a redundant checkpoint, taking a max_keep place)."""
    now = [0.0]
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2)
    job.train(2)
    job.manager.close()
    again = make_job(out, save_interval=None)
    mgr = CheckpointManager(again.saver, 0, save_interval_seconds=100, clock=lambda: now[0],
                            save_on_preemption=False)
    _taking(again.saver, "load", now, 150.0)
    assert mgr.restore() == 2
    saved = []
    for step in (3, 4):
        again.train(1)
        now[0] += 1.0
        if mgr.step() is not None:
            saved.append(step)
    assert saved == [] and [os.path.basename(p) for p in again.saver.checkpoints()] == ["ckpt_2"]
    now[0] += 100.0
    again.train(1)
    assert mgr.step() is not None
    mgr.close()


def test_last_save_and_one_log_line_per_commit(tmp_path, caplog):
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=None)
    mgr = CheckpointManager(job.saver, 2, save_on_preemption=False)
    job.manager = mgr
    assert mgr.last_save is None
    with caplog.at_level(logging.INFO, logger="recsave"):
        job.train(2)
        with pytest.warns(RuntimeWarning, match="which does not save"):
            mgr.step(metrics={"auc": 0.75})  # step 3: no save
        job.train(1)  # step 4 saves (without metrics)
    lines = [r.getMessage() for r in caplog.records if "committed" in r.getMessage()]
    assert len(lines) == 2 and "ckpt_2" in lines[0] and "ckpt_4" in lines[1]
    assert "(step 4, full)" in lines[1] and "GB/s" in lines[1] and "stalled" in lines[1]
    info = mgr.last_save
    assert isinstance(info, recsave.SaveInfo) and info is job.saver.last_save
    size = sum(os.path.getsize(os.path.join(out, "ckpt_4", f)) for f in os.listdir(os.path.join(out, "ckpt_4"))
               if f != "index")
    assert (info.ckpt_id, info.path, info.step, info.kind, info.bytes, info.metrics) == (
        "ckpt_4", os.path.join(out, "ckpt_4"), 4, "full", size, None)
    assert info.seconds > 0 and info.stall_seconds == info.seconds
    with pytest.warns(RuntimeWarning, match="not recorded"):
        mgr.save(metrics={"auc": 0.5})  # ckpt_4 is the latest already: no new save
    assert mgr.last_save is info
    mgr.close()


def test_async_last_save_is_set_when_the_write_commits(tmp_path):
    job = make_job(str(tmp_path / "run"), save_interval=None)
    mgr = CheckpointManager(job.saver, 1, async_mode="async", save_on_preemption=False)
    job.manager = mgr
    job.train(1)
    mgr.wait()
    info = mgr.last_save
    assert info.ckpt_id == "ckpt_1" and info.stall_seconds <= info.seconds + 1.0
    mgr.close()


@pytest.mark.parametrize("kwargs,error", [
    ({"save_interval_seconds": 0}, UsageError), ({"save_interval_seconds": "60"}, ArgumentTypeError),
    ({"save_interval_seconds": float("nan")}, UsageError), ({"save_on_preemption": 1}, ArgumentTypeError),
    ({"clock": 5}, ArgumentTypeError), ({"full_every": 0}, UsageError), ({"full_every": 2.0}, ArgumentTypeError),
    ({"rebase_ratio": 0}, UsageError), ({"rebase_ratio": "0.3"}, ArgumentTypeError),
    ({"evict": {"older": 3}}, UsageError), ({"evict": {}}, UsageError), ({"evict": 3}, ArgumentTypeError),
    ({"evict": {"min_count": 0}}, UsageError), ({"evict": {"older_than_steps": 1.5}}, ArgumentTypeError)])
def test_bad_manager_settings(tmp_path, kwargs, error):
    job = make_job(str(tmp_path / "run"), save_interval=None)
    with pytest.raises(error):
        CheckpointManager(job.saver, 1, **kwargs)


def test_incremental_settings_are_kept_as_given(tmp_path):
    job = make_job(str(tmp_path / "run"), save_interval=None)
    mgr = CheckpointManager(job.saver, 1, full_every=4, rebase_ratio=0.5,
                            evict={"older_than_steps": 100, "min_count": 2}, save_on_preemption=False)
    assert (mgr.full_every, mgr.rebase_ratio, mgr.evict) == (4, 0.5, {"older_than_steps": 100, "min_count": 2})


def test_async_mode_is_keyword_only(tmp_path):
    job = make_job(str(tmp_path / "run"), save_interval=None)
    with pytest.raises(TypeError):
        CheckpointManager(job.saver, 1, "async")


# ------------------------------------------------------------------------------ real signals
STEPS = 60


def _env():
    env = dict(os.environ)
    env["RECSAVE_FSYNC"] = "0"
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _ranks(mode, world, tmp_path, *args):
    """Starts `world` ranks of preempt_job.py MODE (args split around RANK WORLD INIT as it takes them)."""
    init = str(tmp_path / f"init-{mode}-{time.monotonic_ns()}")
    head, tail = (args[:1], args[1:]) if mode == "reference" else (args[:2], args[2:])
    return [subprocess.Popen([sys.executable, SCRIPT, mode, *map(str, head), str(r), str(world), init,
                              *map(str, tail)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for r in range(world)]


def _finish(procs, timeout=180):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append(out)
    return [p.returncode for p in procs], outs


def _signal_at_step(procs, target, sig, to=None):
    """Reads rank 0's output until it reports step `target`, then signals the ranks in `to`."""
    for line in procs[0].stdout:
        if line.strip() == f"step {target}":
            break
    for r in (range(len(procs)) if to is None else to):
        procs[r].send_signal(sig)


def reference_states(tmp_path, world):
    """Every rank's state after an uninterrupted run of STEPS steps."""
    results = [tmp_path / f"ref_{world}_{r}.pt" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, SCRIPT, "reference", str(STEPS), str(r), str(world),
                               str(tmp_path / "init-ref"), str(results[r])], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    codes, outs = _finish(procs)
    assert codes == [0] * world, outs
    return [torch.load(p, weights_only=False) for p in results]


def _resume_and_compare(tmp_path, out, world, expect_step, reference):
    results = [tmp_path / f"resumed_{r}.pt" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, SCRIPT, "resume", out, str(STEPS), str(r), str(world),
                               str(tmp_path / "init-resume"), str(results[r])], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    codes, outs = _finish(procs)
    assert codes == [0] * world, outs
    for r in range(world):
        assert outs[r].splitlines()[0] == f"restored {expect_step}", outs[r]
        assert_jobs_equal(torch.load(results[r], weights_only=False), reference[r])


def _train(tmp_path, out, world, hook=None):
    return _ranks("train", world, tmp_path, out, STEPS, *([hook] if hook else []))


@pytest.fixture(scope="module")
def reference_1(tmp_path_factory):
    return reference_states(tmp_path_factory.mktemp("ref1"), 1)


@pytest.fixture(scope="module")
def reference_2(tmp_path_factory):
    return reference_states(tmp_path_factory.mktemp("ref2"), 2)


def preempt_and_check(tmp_path, world, reference, seed, sig=signal.SIGTERM, to=None, hook=None):
    out = str(tmp_path / "run")
    target = random.Random(seed).randint(3, 40)
    procs = _train(tmp_path, out, world, hook)
    _signal_at_step(procs, target, sig, to)
    codes, outs = _finish(procs)
    if hook == "kill-in-save":
        assert codes == [-signal.SIGKILL] * world if world == 1 else -signal.SIGKILL in codes, outs
        listed = _list(out)
        assert listed and all(int(c.split("_")[1]) % 5 == 0 for c in listed), listed  # autosaves only
        step = int(listed[-1].split("_")[1])
    else:
        assert codes == [143] * world, outs
        listed = _list(out)
        step = int(listed[-1].split("_")[1])
        assert step >= target and all("finished" not in o for o in outs)
        assert all(f"saved and committed {os.path.join(out, f'ckpt_{step}')}" in o for o in outs), outs
    _resume_and_compare(tmp_path, out, world, step, reference)
    return step


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_sigterm_at_a_random_step_commits_and_resumes_bit_exact(tmp_path, reference_1, seed):
    preempt_and_check(tmp_path, 1, reference_1, seed)


@pytest.mark.slow
def test_sigusr1_works_like_sigterm(tmp_path, reference_1):
    preempt_and_check(tmp_path, 1, reference_1, 3, sig=signal.SIGUSR1)


@pytest.mark.slow
def test_a_second_signal_during_the_preemption_save_changes_nothing(tmp_path, reference_1):
    preempt_and_check(tmp_path, 1, reference_1, 4, hook="second-signal")


@pytest.mark.slow
def test_sigkill_during_the_preemption_save_leaves_the_previous_checkpoint(tmp_path, reference_1):
    preempt_and_check(tmp_path, 1, reference_1, 5, hook="kill-in-save")


@pytest.mark.multirank
@pytest.mark.parametrize("to", [None, [1]], ids=["all_ranks", "rank1_only"])
def test_two_ranks_preempted_save_the_same_step_and_resume_bit_exact(tmp_path, reference_2, to):
    preempt_and_check(tmp_path, 2, reference_2, 6 if to else 7, to=to)


@pytest.mark.multirank
def test_two_async_ranks_preempted_resume_bit_exact(tmp_path, reference_2, monkeypatch):
    """Background writes run collectives on their own group while step() agrees on its own."""
    monkeypatch.setenv("PREEMPT_JOB_ASYNC", "1")
    preempt_and_check(tmp_path, 2, reference_2, 8)


@pytest.mark.multirank
def test_time_interval_saves_follow_rank0s_clock_on_every_rank(tmp_path):
    out = str(tmp_path / "run")
    init = str(tmp_path / "init-timed")
    results = [tmp_path / f"timed_{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, SCRIPT, "timed", out, "22", str(r), "2", init, str(results[r])],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    codes, outs = _finish(procs)
    assert codes == [0, 0], outs
    saved = [json.loads(p.read_text()) for p in results]
    assert saved[0] == saved[1] == [5, 10, 15, 20]  # rank 0: 1 s per step, interval 4.5 s
    assert _list(out) == ["ckpt_5", "ckpt_10", "ckpt_15", "ckpt_20"]


def test_a_load_after_restore_is_saved_not_taken_for_the_restored_state(tmp_path):
    """After restore(global_step=2) past ckpt_4 the manager may return ckpt_2 for a save at step
    2 only while ckpt_2 still holds the state: a model-bank load since changed it, so the save
    refuses to overwrite the committed ckpt_2 (CheckpointExistsError) instead of answering with a
    checkpoint that lacks the loaded rows."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2)
    job.train(4)
    job.manager.close()
    bank = make_job(str(tmp_path / "bank"), save_interval=2, seed=9)
    bank.train(2)
    bank.manager.close()
    again = make_job(out, save_interval=2)
    assert again.manager.restore(global_step=2) == 2
    again.manager.load_model_bank([{"path": str(tmp_path / "bank"), "load": ["sparse"]}])
    with pytest.raises(recsave.CheckpointExistsError):
        again.manager.save()
    assert _list(out) == ["ckpt_2", "ckpt_4"]
    again.manager.close()


def test_steps_after_restore_then_the_step_set_back_are_not_taken_for_the_restored_state(tmp_path):
    """restore(global_step=2), three steps of training, global_step set back to 2: ckpt_2 no
    longer holds the state, so save() refuses to overwrite it instead of listing it last (a
    restart would then lose the three steps)."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2)
    job.train(4)
    job.manager.close()
    again = make_job(out, save_interval=0)
    assert again.manager.restore(global_step=2) == 2
    again.train(3)
    again.manager.global_step = 2
    with pytest.raises(recsave.CheckpointExistsError):
        again.manager.save()
    assert _list(out) == ["ckpt_2", "ckpt_4"]
    again.manager.close()


def test_a_rewind_by_one_interval_never_takes_the_abandoned_latest_for_the_new_state(tmp_path):
    """ckpt_2, ckpt_4, ckpt_6 listed; restore(global_step=4) and two steps of other batches: the
    autosave at step 6 must not return the old branch's ckpt_6 as if it had saved (a restart would
    resume from it and lose both steps, silently). It refuses, as for an older id."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=None)
    job.train(6)
    job.manager.close()
    again = make_job(out, save_interval=2, max_keep=None)
    assert again.manager.restore(global_step=4) == 4
    again.train(1)
    with pytest.raises(recsave.CheckpointExistsError):
        again.train(1)  # step 6: its autosave
    assert _list(out) == ["ckpt_2", "ckpt_4", "ckpt_6"] and again.manager.last_save is None
    again.manager.close()


def test_saving_the_step_just_saved_again_returns_it(tmp_path):
    """The other side of the rule above: an autosave then save() at the same step (the end of
    training) returns the checkpoint just written, sync and async; a model-bank load or a change
    of global_step in between does not count as unchanged."""
    for mode in ("disabled", "async"):
        out = str(tmp_path / mode)
        job = make_job(out, save_interval=2, async_mode=mode)
        job.train(2)
        job.manager.wait()
        saved = job.manager.last_save
        assert saved is not None and saved.ckpt_id == "ckpt_2"
        assert job.manager.save() == os.path.join(out, "ckpt_2")
        job.manager.wait()
        assert job.manager.last_save is saved  # not saved again
        job.manager.global_step = 3
        job.manager.global_step = 2  # set back: the state may have changed in between
        with pytest.raises(recsave.CheckpointExistsError):
            job.manager.save()
        job.manager.close()


@pytest.mark.parametrize("mode", ["disabled", "async"])
@pytest.mark.parametrize("how", ["load", "load_model_bank", "failed_load"])
def test_a_load_through_the_saver_after_a_save_is_not_taken_for_the_saved_state(tmp_path, restore_signals,
                                                                                  mode, how):
    """An autosave at step 2, then a load through the Saver itself (not the manager): save() and
    the preemption save at step 2 must not return ckpt_2 as if it held the loaded state (a
    restart would restore the rows from before the load): they refuse to overwrite it. A failed
    load counts too (it may have changed some tables)."""
    bank = make_job(str(tmp_path / "bank"), save_interval=2, seed=9)
    bank.train(2)
    bank.manager.close()
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, async_mode=mode)
    job.train(2)
    job.manager.wait()
    if how == "load":
        job.saver.load(str(tmp_path / "bank"), load_conf={"load": ["sparse"]})
    elif how == "load_model_bank":
        job.saver.load_model_bank([{"path": str(tmp_path / "bank"), "load": ["sparse"]}])
    else:
        with pytest.raises(recsave.CheckpointNotFoundError):
            job.saver.load(str(tmp_path / "nothing"))
    with pytest.raises(recsave.CheckpointExistsError):
        job.manager.save()
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(recsave.CheckpointExistsError):
        job.manager.check_preemption()
    assert _list(out) == ["ckpt_2"]
    job.manager.close()


def test_a_save_that_failed_after_its_commit_point_is_returned_by_the_retry(tmp_path, monkeypatch):
    """The save of ckpt_2 raises after its list was written (here: the store answers the list's
    write with an error after it took it): ckpt_2 is committed and holds this state, so save()
    again returns it instead of refusing it."""
    import recsave.format.ckptlist as ckptlist

    out = str(tmp_path / "run")
    job = make_job(out, save_interval=0)
    job.train(2)
    real = ckptlist.write

    def written_then_failing(*args, **kwargs):
        real(*args, **kwargs)
        raise OSError("connection reset after the write (injected)")
    monkeypatch.setattr(ckptlist, "write", written_then_failing)
    with pytest.raises(OSError, match="injected"):
        job.manager.save()
    monkeypatch.undo()
    assert _list(out) == ["ckpt_2"]
    assert job.manager.save() == os.path.join(out, "ckpt_2")
    job.manager.close()


_CLOSE_UNDER_A_LIVE_MANAGER = """
import os, signal, sys, threading
import recsave
from helpers import make_job
out, how = sys.argv[1], sys.argv[2]
a = make_job(os.path.join(out, "a"), save_interval=0)
if how == "user_handler":  # a framework's handler that chains to the one before it (as Lightning's)
    prev = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: prev(signum, frame))
b = make_job(os.path.join(out, "b"), save_interval=0)
b.train(1)
if how == "closed_off_main_thread":
    t = threading.Thread(target=a.manager.close)
    t.start()
    t.join()
else:
    a.manager.close()
os.kill(os.getpid(), signal.SIGTERM)
b.manager.step()
print("no preemption save")
"""


@pytest.mark.parametrize("how", ["closed_off_main_thread", "user_handler"])
def test_a_closed_managers_handler_never_ends_the_process_under_a_live_one(tmp_path, how):
    """A closed manager's handler still reachable (its uninstall ran off the main thread, or a
    user's handler chains to it) passes the signal on; it must not end the process while a live
    manager's handler is in front: the live one saves and exits 143."""
    child = subprocess.run([sys.executable, "-c", _CLOSE_UNDER_A_LIVE_MANAGER, str(tmp_path), how], env=_env(),
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 143, (child.returncode, child.stdout, child.stderr)
    assert "preempted (signal SIGTERM): saved and committed" in child.stderr
    assert _list(str(tmp_path / "b")) == ["ckpt_2"]


_NO_LIVE_MANAGER = """
import os, signal, sys, threading, time
from helpers import make_job
out, how = sys.argv[1], sys.argv[2]
a = make_job(os.path.join(out, "a"), save_interval=0)
if how == "user_handler":  # a framework's handler that chains to the one before it, over a closed manager
    prev = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: prev(signum, frame))
    a.manager.close()
else:  # two managers, both closed off the main thread: their handlers stay installed, retired
    b = make_job(os.path.join(out, "b"), save_interval=0)
    for m in (b.manager, a.manager):
        t = threading.Thread(target=m.close)
        t.start()
        t.join()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(2)
print("the signal was swallowed")
"""


@pytest.mark.parametrize("how", ["user_handler", "both_closed_off_main_thread"])
def test_sigterm_ends_the_process_when_no_live_manager_is_left(tmp_path, how):
    child = subprocess.run([sys.executable, "-c", _NO_LIVE_MANAGER, str(tmp_path), how], env=_env(),
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGTERM, (child.returncode, child.stdout, child.stderr)
