"""The README's demo job keeps working: train with autosave, SIGKILL, restore in a new process,
warm-start a second model through the model bank (a shortened run)."""
import subprocess
import sys

import pytest


@pytest.mark.slow  # a training job in subprocesses, SIGKILLed
def test_demo_runs_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "recsave.tools.demo", "--dir", str(tmp_path), "--steps", "60",
                           "--kill-at", "55"], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "training process ended with SIGKILL" in out
    assert "restored ckpt_50: global_step 50, reader at batch 50" in out
    assert "finished at step 60" in out
    assert "loaded: ['item', 'item@adagrad_acc', 'user', 'user@adagrad_acc']" in out
    assert (tmp_path / "ctr_v1" / "checkpoint").read_text().split()[-1] == "ckpt_60"
