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
from recsave.save import background

# The write fails for real: a file stands where the checkpoint's directory would go.
JOB = """
import sys, torch
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
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt_1").write_text("x")
    table = HashTable(4, name="t")
    table.lookup(torch.arange(10, dtype=torch.int64), insert=True)
    saver = Saver(torch.nn.ModuleDict({"t": table}), output_dir=str(out))
    _, write = saver.async_save("ckpt_1")
    saver.wait_for_pending()  # waits without taking the outcome: still unheard
    failures = background.unheard_failures()
    assert [(f.ckpt_id, f.exit_code, f.pid) for f in failures] == [("ckpt_1", 1, os.getpid())]
    assert failures[0].error.startswith("CheckpointExistsError: ")
    with pytest.raises(CheckpointExistsError):
        saver.wait()
    assert background.unheard_failures() == []
    saver.close()


def test_a_write_failed_without_running_counts_until_collected():
    """What a rank holds when another rank refused the save: a write failed with that error."""
    writes = background.BackgroundWrite()
    with knobs.override(async_failure_exit_code=3):
        writes.fail("ckpt_2", UsageError("refused on rank 1"))
    assert [(f.ckpt_id, f.error, f.exit_code) for f in background.unheard_failures()] == [
        ("ckpt_2", "UsageError: refused on rank 1", 3)]
    assert writes.collect(consume=False) is None  # a load's wait: the error stays pending, unheard
    assert len(background.unheard_failures()) == 1
    with pytest.raises(UsageError, match="refused on rank 1"):
        writes.collect(consume=True)
    assert background.unheard_failures() == []
