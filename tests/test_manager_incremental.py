"""CheckpointManager's incremental policy (recsave/save/policy.py): full_every, rebase_ratio and
evict drive which autosaves are deltas, across restarts and in async mode."""
import os

import pytest
from helpers import assert_jobs_equal, job_state, make_job, tables_of

from recsave import CheckpointExistsError, CheckpointManager
from recsave.errors import ArgumentTypeError, UsageError
from recsave.format import index as index_mod
from recsave.save.policy import wants_delta


def _kinds(out: str, ids):
    return [index_mod.read(os.path.join(out, i)).kind for i in ids]


def _ids(out: str):
    with open(os.path.join(out, "checkpoint")) as f:
        return [line.strip() for line in f if line.strip()]


def test_wants_delta_rules():
    assert wants_delta(None, 0.3, [100]) == (False, "full_every is None")
    assert not wants_delta(3, 0.3, [])[0]  # nothing to be a delta of
    assert wants_delta(3, 0.3, [100])[0]  # base only: the next is delta #1
    assert wants_delta(3, 0.3, [100, 10])[0]  # delta #2 of 3
    assert not wants_delta(3, 0.3, [100, 10, 10])[0]  # the 3rd save after a base is full
    # rebase: 10 + 10 (the next taken as large as the last) <= 30 ... but 25 + 25 > 30
    assert wants_delta(10, 0.3, [100, 10])[0]
    ok, why = wants_delta(10, 0.3, [100, 25])
    assert not ok and "rebase_ratio" in why
    assert wants_delta(1, 0.3, [100]) == (False, "every 1th save is full")


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_full_every_makes_every_kth_save_full(tmp_path, async_mode):
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=None, async_mode=async_mode,
                   manager_kw={"full_every": 3, "rebase_ratio": 100.0})
    job.train(14)
    job.manager.wait()
    ids = _ids(out)
    assert ids == [f"ckpt_{s}" for s in range(2, 15, 2)]
    assert _kinds(out, ids) == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    live = job_state(job)
    job.manager.close()
    again = make_job(out, save_interval=2, max_keep=None)
    assert again.manager.restore() == 14
    assert_jobs_equal(job_state(again), live)


def test_restore_continues_the_chain(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=2, max_keep=None, manager_kw={"full_every": 4, "rebase_ratio": 100.0})
    job.train(4)  # ckpt_2 full, ckpt_4 delta
    job.manager.close()
    job2 = make_job(out, save_interval=2, max_keep=None, manager_kw={"full_every": 4, "rebase_ratio": 100.0})
    assert job2.manager.restore() == 4
    job2.train(6)  # ckpt_6, ckpt_8 deltas (3rd and 4th of the chain), then ckpt_10 full
    assert _kinds(out, _ids(out)) == ["full", "delta", "delta", "delta", "full"]
    live = job_state(job2)
    job2.manager.close()
    job4 = make_job(out, save_interval=2, max_keep=None)
    job4.manager.restore()
    assert_jobs_equal(job_state(job4), live)


def test_full_every_counts_the_chain_of_the_restored_checkpoint(tmp_path):
    """After restoring an older step, the next save is a delta of the restored checkpoint, so
    full_every counts that checkpoint's chain, not the latest listed one's: with full_every=3 a
    restore of ckpt_6 (full 2, delta 4, delta 6) makes the next save full, not a third delta."""
    out = str(tmp_path / "run")
    kw = {"full_every": 3, "rebase_ratio": 100.0}
    job = make_job(out, save_interval=2, max_keep=None, manager_kw=kw)
    job.train(10)  # 2 full, 4 delta, 6 delta, 8 full, 10 delta
    assert _kinds(out, _ids(out)) == ["full", "delta", "delta", "full", "delta"]
    job.manager.close()
    again = make_job(out, save_interval=2, max_keep=None, manager_kw=kw)
    assert again.manager.restore(global_step=6) == 6
    assert again.saver.delta_parent == os.path.join(out, "ckpt_6")
    again.train(1)
    again.manager.save()
    assert _kinds(out, ["ckpt_7"]) == ["full"]
    again.manager.close()

    once = make_job(out, save_interval=2, max_keep=None, manager_kw=kw)  # a chain with room left
    assert once.manager.restore(global_step=4) == 4
    once.train(1)
    once.manager.save()
    assert _kinds(out, ["ckpt_5"]) == ["delta"] and index_mod.read(os.path.join(out, "ckpt_5")).parent.id == "ckpt_4"
    once.manager.close()


def test_rebase_ratio_forces_full_saves(tmp_path):
    out = str(tmp_path / "run")
    # every step touches a large share of the small tables: deltas are big next to the base
    job = make_job(out, save_interval=1, max_keep=None, manager_kw={"full_every": 100, "rebase_ratio": 0.01})
    job.train(4)
    assert _kinds(out, _ids(out)) == ["full"] * 4
    job.manager.close()


def test_evict_before_each_save(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=3, max_keep=None,
                   manager_kw={"full_every": 10, "rebase_ratio": 100.0, "evict": {"older_than_steps": 1}})
    job.train(3)
    tables = tables_of(job.model)
    # every id left is one looked up in the last table step before the save
    for table in tables.values():
        ids, rows = table.id_rows()
        assert bool((table.row_meta(rows)["last_step"] >= table.step - 1).all())
    before = {n: set(t.ids().tolist()) for n, t in tables.items()}
    job.train(3)
    delta = index_mod.read(os.path.join(out, "ckpt_6"))
    assert delta.kind == "delta"
    gone = {n: before[n] - set(t.ids().tolist()) for n, t in tables.items()}
    assert any(gone.values())
    for name, meta in delta.meta.tables.items():
        # ids inserted after ckpt_3 and evicted again are tombstones too (harmless: not in the parent)
        assert meta.tombstones >= len(gone[name])
    live = job_state(job)
    job.manager.close()
    fresh = make_job(out, save_interval=3, max_keep=None)
    fresh.manager.restore()
    assert_jobs_equal(job_state(fresh), live)


def test_settings_are_checked(tmp_path):
    job = make_job(str(tmp_path / "a"), save_interval=None)
    with pytest.raises(UsageError, match="full_every"):
        CheckpointManager(job.saver, 1, full_every=0)
    with pytest.raises(UsageError, match="rebase_ratio"):
        CheckpointManager(job.saver, 1, full_every=2, rebase_ratio=float("nan"))
    with pytest.raises(UsageError, match="evict"):
        CheckpointManager(job.saver, 1, evict={"older": 1})
    with pytest.raises(ArgumentTypeError):
        CheckpointManager(job.saver, 1, full_every="2")


def test_a_refused_save_evicts_nothing(tmp_path):
    """A save refused because its id is committed (here: global_step set back to a saved step
    after more training) raises before the eviction: the rows it would have dropped stay."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=3, max_keep=None,
                   manager_kw={"full_every": 10, "evict": {"older_than_steps": 1}})
    job.train(3)
    job.train(2)
    before = {n: sorted(t.ids().tolist()) for n, t in tables_of(job.model).items()}
    job.manager.global_step = 3
    with pytest.raises(CheckpointExistsError):
        job.manager.save()
    assert {n: sorted(t.ids().tolist()) for n, t in tables_of(job.model).items()} == before
    job.manager.close()


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_the_save_keep_every_n_steps_keeps_for_good_is_full(tmp_path, async_mode):
    """keep_every_n_steps keeps the first checkpoint of each window; as a delta it kept its whole
    chain too, so with full_every=10 nearly every checkpoint stayed (28 of 30). Those saves are
    full now: the windows' first saves, the latest and its chain are kept, each restorable."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=1, max_keep=1, async_mode=async_mode,
                   manager_kw={"full_every": 10, "rebase_ratio": 100.0, "keep_every_n_steps": 4})
    job.train(30)
    job.manager.wait()
    ids = _ids(out)
    kept = [f"ckpt_{s}" for s in (1, 4, 8, 12, 16, 20, 24, 28, 29, 30)]
    assert ids == kept
    assert sorted(d for d in os.listdir(out) if d.startswith("ckpt_")) == sorted(kept)
    assert _kinds(out, ids) == ["full"] * 8 + ["delta", "delta"]
    live = job_state(job)
    job.manager.close()
    again = make_job(out, save_interval=1, max_keep=1)
    assert again.manager.restore() == 30
    assert_jobs_equal(job_state(again), live)
    assert again.manager.restore(global_step=12) == 12
    again.manager.close()


def test_a_list_that_cannot_be_read_makes_the_save_full_not_failed(tmp_path):
    """Whether a save opens a keep_every_n_steps window needs the list; read on each rank alone,
    a failure there must not stop that rank before the save's collectives: the save is full."""
    from recsave.errors import StorageError

    out = str(tmp_path / "run")
    job = make_job(out, save_interval=1, max_keep=None,
                   manager_kw={"full_every": 10, "rebase_ratio": 100.0, "keep_every_n_steps": 4})
    job.train(2)
    real = job.saver.checkpoints

    def failing():
        raise StorageError(f"{out}/checkpoint: read timed out")
    job.saver.checkpoints = failing
    job.train(1)  # ckpt_3 would be a delta (window [0, 4) opened by ckpt_1)
    job.saver.checkpoints = real
    job.train(1)
    assert _kinds(out, _ids(out)) == ["full", "delta", "full", "full"]
    job.manager.close()
