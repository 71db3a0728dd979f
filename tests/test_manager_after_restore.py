"""What a CheckpointManager takes for the model's state after a restore, a rewind or a failed
save: a checkpoint that does not hold the state must never be returned (or listed latest) by a
save of its step in place of writing it."""
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


@pytest.mark.parametrize("load_conf", [{"exclude": ["dense"]}, {"load": ["sparse"]},
                                       {"hashtable_clear": False}])
def test_a_partial_restore_is_not_taken_for_the_state_it_left(tmp_path, load_conf):
    """restore(global_step=2, load_conf=...) that keeps the model's own dense part (or merges
    rows into the live tables): ckpt_2 does not hold the model's state, yet save() listed it as the
    latest without writing (a restart then resumes from ckpt_2's dense part, and the state the
    restore built is lost). Like any other committed id that does not hold the state, it refuses."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=None, manager_kw={"save_on_preemption": False})
    job.train(4)
    job.manager.close()
    again = make_job(out, save_interval=2, max_keep=None, seed=5, manager_kw={"save_on_preemption": False})
    assert again.manager.restore(global_step=2, load_conf=load_conf) == 2
    with pytest.raises(CheckpointExistsError):
        again.manager.save()
    assert _list(out) == ["ckpt_2", "ckpt_4"]
    again.manager.close()


def test_a_restore_without_io_states_still_holds_the_state(tmp_path):
    """The documented restart on another number of workers (io states excluded): the restored
    checkpoint still counts as holding the state, so save() right after lists it as the latest."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=None, manager_kw={"save_on_preemption": False})
    job.train(4)
    job.manager.close()
    again = make_job(out, save_interval=2, max_keep=None, manager_kw={"save_on_preemption": False})
    assert again.manager.restore(global_step=2, load_conf={"exclude": ["io_state"]}) == 2
    assert again.manager.save() == os.path.join(out, "ckpt_2")
    assert _list(out) == ["ckpt_4", "ckpt_2"]
    again.manager.close()


def test_a_change_of_global_step_after_a_restore_forgets_the_restored_state(tmp_path):
    """restore(global_step=2), global_step moved on (training without step()) and set back to 2:
    as for a checkpoint the manager saved (test_preempt: the step set back), ckpt_2 is no longer
    known to hold the state. save() listed it as the latest without writing; it must refuse."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=None, manager_kw={"save_on_preemption": False})
    job.train(4)
    job.manager.close()
    again = make_job(out, save_interval=0, max_keep=None, manager_kw={"save_on_preemption": False})
    assert again.manager.restore(global_step=2) == 2
    again.manager.global_step = 3
    again.manager.global_step = 2
    with pytest.raises(CheckpointExistsError):
        again.manager.save()
    assert _list(out) == ["ckpt_2", "ckpt_4"]
    again.manager.close()
