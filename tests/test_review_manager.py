"""Review findings for CheckpointManager and the retention / policy code behind it: each test
pins a case where a user silently lost or mis-took a checkpoint."""
from __future__ import annotations

import os
from typing import Any, Dict

import pytest
from helpers import make_job

from recsave import CheckpointExistsError


def _list(out: str):
    with open(os.path.join(out, "checkpoint")) as f:
        return f.read().split()


class _Flaky:
    """An extra whose state_dict() fails while `fail` is set (a transient error in user code)."""

    def __init__(self) -> None:
        self.fail = False

    def state_dict(self) -> Dict[str, Any]:
        if self.fail:
            raise RuntimeError("state_dict failed (injected)")
        return {"n": 1}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


def test_a_failed_snapshot_after_a_rewind_never_returns_the_abandoned_checkpoint(tmp_path):
    """ckpt_2, ckpt_4, ckpt_6 listed; restore(global_step=4), two steps of other batches, and the
    autosave at step 6 fails in its snapshot (an extra's state_dict raises) before the write could
    refuse the committed id. save() again at step 6 returned the abandoned branch's ckpt_6 as if it
    held the new state (a restart resumes from it, the two steps lost); it must refuse, as the
    autosave does when nothing fails (test_preempt: a rewind by one interval)."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=None, manager_kw={"save_on_preemption": False})
    flaky = _Flaky()
    job.manager.register_for_checkpointing("flaky", flaky)
    job.train(6)
    job.manager.close()
    again = make_job(out, save_interval=2, max_keep=None, manager_kw={"save_on_preemption": False})
    again.manager.register_for_checkpointing("flaky", flaky)
    assert again.manager.restore(global_step=4) == 4
    again.train(1)
    flaky.fail = True
    with pytest.raises((RuntimeError, CheckpointExistsError)):
        again.train(1)  # step 6: its autosave fails
    flaky.fail = False
    with pytest.raises(CheckpointExistsError):
        again.manager.save()
    assert _list(out) == ["ckpt_2", "ckpt_4", "ckpt_6"] and again.manager.last_save is None
    again.manager.close()

