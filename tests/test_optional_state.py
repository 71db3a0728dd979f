"""Optional registered state: absent from a checkpoint, it is not "missing" under strict loading.
The CheckpointManager's global_step is such state, so a manager warm-starts from (and restores) runs
written by a plain Saver."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_jobs_equal, job_state, make_job, model_state

from recsave import ConfigError, Saver


class Counter:
    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def plain_run(out, ckpt_id="ckpt_6", steps=6):
    """A job saved by a plain Saver (no manager, so no global_step extra)."""
    job = make_job(str(out))
    job.train(steps)
    job.saver.save(ckpt_id)
    job.saver.close()
    return job


def test_model_bank_from_a_plain_saver_run_under_strict(tmp_path):
    src = plain_run(tmp_path / "plain")
    target = make_job(str(tmp_path / "t"), save_interval=10)
    target.manager.global_step = 3
    report = target.manager.load_model_bank([{"path": str(tmp_path / "plain")}])  # strict by default
    assert report.missing == []
    assert "global_step" not in report.loaded
    assert target.manager.global_step == 3  # the manager's own bookkeeping is left alone
    assert_jobs_equal(job_state(target), job_state(src))


def test_a_required_extra_missing_still_fails_strict(tmp_path):
    plain_run(tmp_path / "plain")
    target = make_job(str(tmp_path / "t"), save_interval=10)
    target.saver.register_for_checkpointing("counter", Counter())
    with pytest.raises(ConfigError, match=r"lacks 1 selected name\(s\) of the model: \['counter'\]"):
        target.manager.load_model_bank([{"path": str(tmp_path / "plain")}])


def test_optional_extra_is_loaded_when_present(tmp_path):
    out = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    saver = Saver(model, output_dir=str(out))
    saver.register_for_checkpointing("counter", Counter(7), optional=True)
    saver.save("a")
    fresh = Counter()
    saver2 = Saver(torch.nn.Linear(2, 2), output_dir=str(out))
    saver2.register_for_checkpointing("counter", fresh, optional=True)
    report = saver2.load()
    assert "counter" in report.loaded and fresh.n == 7 and report.notes == []


def test_manager_restores_a_plain_saver_run_with_the_step_of_its_id(tmp_path):
    src = plain_run(tmp_path / "plain")
    fresh = make_job(str(tmp_path / "plain"), save_interval=2)
    before_opt = model_state(fresh.model)
    assert fresh.manager.restore() == 6
    assert fresh.manager.global_step == 6
    report = fresh.manager.last_report
    assert "global_step" in report.skipped and report.missing == []
    assert any("global_step" in n and "6" in n and "ckpt_6" in n for n in report.notes)
    assert_jobs_equal(job_state(fresh), job_state(src))
    assert model_state(fresh.model).keys() == before_opt.keys()
    # Training goes on from there and the next autosave is ckpt_8.
    fresh.train(2)
    assert fresh.saver.latest_checkpoint().endswith("ckpt_8")
    fresh.manager.close()


def test_manager_restore_of_a_run_whose_id_has_no_step_starts_at_0(tmp_path):
    plain_run(tmp_path / "plain", ckpt_id="final")
    fresh = make_job(str(tmp_path / "plain"), save_interval=0)
    fresh.manager.global_step = 5
    assert fresh.manager.restore() == 0
    assert fresh.manager.global_step == 0
    assert any("global_step" in n and "0" in n for n in fresh.manager.last_report.notes)
    fresh.manager.close()


def test_a_restore_whose_load_conf_leaves_out_global_step_does_not_call_it_absent(tmp_path):
    """The checkpoint holds the manager's global_step; load_conf excludes the extras. The step comes
    from the index, and the note must not say the checkpoint lacks it (a user would go looking for a
    damaged or foreign save)."""
    out = str(tmp_path / "run")
    make_job(out, save_interval=4).train(8)
    fresh = make_job(out, save_interval=4)
    assert fresh.manager.restore(load_conf={"exclude": ["extra"]}) == 8
    assert fresh.manager.last_report.notes == [
        f"{out}/ckpt_8: global_step set to 8 (the step its index records); no global_step was loaded from it"]
    fresh.manager.close()


def test_optional_must_be_a_bool(tmp_path):
    from recsave import ArgumentTypeError

    saver = Saver(torch.nn.Linear(2, 2), output_dir=str(tmp_path))
    with pytest.raises(ArgumentTypeError, match="optional must be a bool, got str"):
        saver.register_for_checkpointing("counter", Counter(), optional="yes")
