"""An async save's background write that fails with nobody hearing of it (no later save, wait(),
close() or read of its write future) sets the exit status of the process (knob
async_failure_exit_code): a job must not end "successfully" with its last checkpoint missing."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from recsave import HashTable, Saver, knobs
from recsave.errors import CheckpointExistsError, UsageError
from recsave.save import background, unheard

# The write fails for real: a file stands where the checkpoint's directory would go.
JOB = """
import os, sys, torch
exec(os.environ.get("ASYNC_EXIT_TEST_PRELUDE", ""))
from recsave import HashTable, Saver, knobs
table = HashTable(4, name="t")
table.lookup(torch.arange(1000, dtype=torch.int64), insert=True)
saver = Saver(torch.nn.ModuleDict({"t": table}), output_dir=sys.argv[1])
with knobs.override(**eval(sys.argv[3])):
    _, write = saver.async_save("ckpt_1")
exec(sys.argv[2])
print("main thread ends", flush=True)
"""


def run_job(out: str, then: str, overrides: str = "{}", **env: str) -> "subprocess.CompletedProcess[str]":
    """JOB in a new interpreter, with a file at out/ckpt_1; `then` runs after async_save."""
    os.makedirs(out)
    with open(os.path.join(out, "ckpt_1"), "w") as f:
        f.write("not a checkpoint")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", JOB, out, then, overrides], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=root, **env), timeout=300)
    assert proc.stdout == "main thread ends\n", proc.stderr
    with open(os.path.join(out, "ckpt_1")) as f:
        assert f.read() == "not a checkpoint"  # nothing on disk was touched
    return proc


def blocked_saver(tmp_path) -> Saver:
    """A Saver of a small table whose save of ckpt_1 fails: a file stands where its directory goes."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt_1").write_text("x")
    table = HashTable(4, name="t")
    table.lookup(torch.arange(10, dtype=torch.int64), insert=True)
    return Saver(torch.nn.ModuleDict({"t": table}), output_dir=str(out))


FINAL_LINE = ("recsave: exiting with status {code}: the background write of async_save('ckpt_1') failed "
              "(CheckpointExistsError: ")


def test_an_unheard_failure_makes_the_process_exit_with_status_1(tmp_path):
    proc = run_job(str(tmp_path / "run"), "pass")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("recsave: the background write of async_save('ckpt_1') failed")  # the ERROR log
    assert lines[-1].startswith(FINAL_LINE.format(code=1)), proc.stderr
    assert "no later save, wait(), close() or read of its write future took the error" in lines[-1]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("then", [
    "import contextlib\nwith contextlib.suppress(Exception): saver.wait()",
    "import contextlib\nwith contextlib.suppress(Exception): saver.close()",
    "assert write.exception(timeout=60) is not None",
    "import contextlib\nwith contextlib.suppress(Exception): write.result(timeout=60)",
])
def test_a_failure_someone_heard_of_leaves_the_exit_status_alone(tmp_path, then):
    proc = run_job(str(tmp_path / "run"), then)
    assert proc.returncode == 0, proc.stderr
    assert "exiting with status" not in proc.stderr


def test_the_knob_sets_the_status_and_zero_turns_it_off(tmp_path):
    off = run_job(str(tmp_path / "off"), "pass", RECSAVE_ASYNC_FAILURE_EXIT_CODE="0")
    assert off.returncode == 0 and "exiting with status" not in off.stderr
    assert "the background write of async_save('ckpt_1') failed" in off.stderr  # still logged
    # read at the call, from the knobs in force on the calling thread
    seven = run_job(str(tmp_path / "seven"), "pass", "{'async_failure_exit_code': 7}")
    assert seven.returncode == 7 and seven.stderr.splitlines()[-1].startswith(FINAL_LINE.format(code=7))


def test_the_exit_code_knob_takes_a_status_of_0_to_255():
    with pytest.raises(UsageError, match="async_failure_exit_code.*<= 255"):
        with knobs.override(async_failure_exit_code=256):
            pass
    with pytest.raises(UsageError, match=">= 0"):
        with knobs.override(async_failure_exit_code=-1):
            pass


def test_unheard_failures_are_listed_until_collected(tmp_path):
    saver = blocked_saver(tmp_path)
    _, write = saver.async_save("ckpt_1")
    saver.wait_for_pending()  # waits without taking the outcome: still unheard
    failures = unheard.unheard_failures()
    assert [(f.ckpt_id, f.exit_code, f.pid) for f in failures] == [("ckpt_1", 1, os.getpid())]
    assert failures[0].error.startswith("CheckpointExistsError: ")
    with pytest.raises(CheckpointExistsError):
        saver.wait()
    assert unheard.unheard_failures() == []
    saver.close()


def test_a_write_failed_without_running_counts_until_collected():
    """What a rank holds when another rank refused the save: a write failed with that error."""
    writes = background.BackgroundWrite()
    with knobs.override(async_failure_exit_code=3):
        writes.fail("ckpt_2", UsageError("refused on rank 1"))
    assert [(f.ckpt_id, f.error, f.exit_code) for f in unheard.unheard_failures()] == [
        ("ckpt_2", "UsageError: refused on rank 1", 3)]
    assert writes.collect(consume=False) is None  # a load's wait: the error stays pending, unheard
    assert len(unheard.unheard_failures()) == 1
    with pytest.raises(UsageError, match="refused on rank 1"):
        writes.collect(consume=True)
    assert unheard.unheard_failures() == []


SHUTDOWN_KEPT = """
import atexit, sys
atexit.register(lambda: print("handler registered before recsave ran", flush=True))
import multiprocessing, torch
from recsave import HashTable, Saver
log = open(sys.argv[2], "w")
log.write("step,loss\\n1,0.5\\n")  # buffered, never closed: flushed by the interpreter's shutdown
table = HashTable(4, name="t")
table.lookup(torch.arange(100, dtype=torch.int64), insert=True)
saver = Saver(torch.nn.ModuleDict({"t": table}), output_dir=sys.argv[1])
saver.async_save("ckpt_1")
"""


def test_the_status_is_set_after_the_whole_shutdown(tmp_path):
    """Exit handlers registered before recsave's import still run, and a file left open still has
    its buffered bytes written: the status is set after the interpreter's shutdown, not instead
    of it."""
    out, log = tmp_path / "run", tmp_path / "log.csv"
    out.mkdir()
    (out / "ckpt_1").write_text("x")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SHUTDOWN_KEPT, str(out), str(log)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=root), timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "handler registered before recsave ran\n"
    assert log.read_text() == "step,loss\n1,0.5\n"
    assert proc.stderr.splitlines()[-1].startswith(FINAL_LINE.format(code=1))


def test_a_dropped_savers_failure_stays_unheard_while_other_writes_come_and_go(tmp_path):
    """A failure is keyed by its future, not by the future's id: a later write's future taking the
    freed id must not take the failure with it when it is heard."""
    import gc
    saver = blocked_saver(tmp_path)
    model = saver.model
    saver.async_save("ckpt_1")
    saver.wait_for_pending()
    del saver
    gc.collect()
    other = Saver(model, output_dir=str(tmp_path / "good"), max_keep=1)
    for step in range(100):
        other.async_save(f"ckpt_{step}")
        other.wait()
    other.close()
    assert [f.ckpt_id for f in unheard.unheard_failures()] == ["ckpt_1"]


def test_a_wait_that_times_out_hears_nothing(tmp_path, monkeypatch):
    from recsave.save import pipeline
    saver = blocked_saver(tmp_path)
    release = __import__("threading").Event()
    real = pipeline.CheckpointWriter.write

    def held(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)
    monkeypatch.setattr(pipeline.CheckpointWriter, "write", held)
    _, write = saver.async_save("ckpt_1")
    for read in (write.result, write.exception):
        with pytest.raises(TimeoutError):
            read(timeout=0.01)
    release.set()
    saver.wait_for_pending()
    assert [f.ckpt_id for f in unheard.unheard_failures()] == ["ckpt_1"]
    assert isinstance(write.exception(timeout=60), CheckpointExistsError)
    assert unheard.unheard_failures() == []
    with pytest.raises(CheckpointExistsError):
        saver.close()


def test_a_bad_knob_value_is_refused_before_the_snapshot(tmp_path, monkeypatch):
    table = HashTable(4, name="t")
    table.lookup(torch.arange(10, dtype=torch.int64), insert=True)
    saver = Saver(torch.nn.ModuleDict({"t": table}), output_dir=str(tmp_path / "run"))
    monkeypatch.setenv("RECSAVE_ASYNC_FAILURE_EXIT_CODE", "300")
    with pytest.raises(UsageError, match="async_failure_exit_code"):
        saver.async_save("ckpt_1")
    assert saver.pending_checkpoint is None and not (tmp_path / "run").exists()


FORK_WHILE_HELD = """
import os, sys, threading, time
from recsave.save import unheard
taken, done = threading.Event(), threading.Event()

def hold():
    with unheard._lock:  # as a write thread recording its failure when the fork comes
        taken.set()
        done.wait()
threading.Thread(target=hold).start()
taken.wait()
pid = os.fork()
if pid == 0:
    unheard.unheard_failures()
    os._exit(7)
_, status = os.waitpid(pid, 0)
done.set()
print(os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_while_a_failure_was_being_recorded_does_not_hang():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", FORK_WHILE_HELD], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=root), timeout=120)
    assert proc.stdout.strip() == "7", proc.stderr


def test_without_an_exit_function_slot_the_failure_says_so(tmp_path):
    """The interpreter holds 32 Py_AtExit functions: with all taken, the status cannot be set, and
    the log says that instead of promising it."""
    fill = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
            "while ctypes.pythonapi.Py_AtExit(ctypes.cast(libc.getpid, ctypes.c_void_p)) == 0: pass\n")
    proc = run_job(str(tmp_path / "run"), "pass", "{}", ASYNC_EXIT_TEST_PRELUDE=fill)
    assert proc.returncode == 0, proc.stderr
    assert "cannot set the exit status for the failed background write of async_save('ckpt_1')" in proc.stderr
    assert "exiting with status" not in proc.stderr
