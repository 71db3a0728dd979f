"""Retention: max_keep + keep_every_n_steps + keep_best (recsave/format/retention.py), the same
selection in the Saver's rotation, `recsave gc` and `recsave ls`, across a restart."""
from __future__ import annotations

import json
import os

import pytest
from helpers import listing, make_job, read_index_json, write_index_json

from recsave import ArgumentTypeError, CheckpointManager, CorruptCheckpointError, Saver, UsageError
from recsave.format import read_index
from recsave.format.retention import select
from recsave.tools.catalog import clean_output_dir, list_checkpoints
from recsave.tools.cli import main

IDS = [f"c{i}" for i in range(10)]


def _steps(ckpt):
    return int(ckpt[1:]) * 5  # c0 -> 0, c1 -> 5, ...


def test_select_latest_only():
    assert select(IDS, max_keep=2) == {"c8": ["latest"], "c9": ["latest"]}
    assert select(IDS, max_keep=None) == {c: ["latest"] for c in IDS}
    assert select([], max_keep=3) == {}


def test_select_every_n_steps_keeps_the_first_of_each_window():
    # steps 0, 5, ..., 45; windows of 15: [0,15) -> c0, [15,30) -> c3, [30,45) -> c6, [45,60) -> c9
    got = select(IDS, max_keep=1, keep_every_n_steps=15, step_of=_steps)
    assert got == {"c0": ["every_n_steps"], "c3": ["every_n_steps"], "c6": ["every_n_steps"],
                   "c9": ["latest", "every_n_steps"]}
    # A checkpoint without a step is never kept for its step.
    got = select(["a", "b", "c"], max_keep=1, keep_every_n_steps=2, step_of=lambda c: None)
    assert got == {"c": ["latest"]}


@pytest.mark.parametrize("mode,best", [("max", {"c2", "c7"}), ("min", {"c4", "c5"})])
def test_select_best_by_mode(mode, best):
    values = {"c2": 0.9, "c7": 0.8, "c4": 0.1, "c5": 0.2, "c1": 0.5}
    got = select(IDS, max_keep=1, keep_best=2, best_metric="auc", best_mode=mode,
                 metrics_of=lambda c: {"auc": values[c]} if c in values else {"loss": 0.0})
    assert got == {**{c: ["best"] for c in sorted(best, key=IDS.index)}, "c9": ["latest"]}


def test_select_best_ties_go_to_the_newer_and_ignore_non_finite():
    metrics = {"c1": 0.5, "c2": 0.5, "c3": float("nan"), "c4": True}
    got = select(IDS[:6], max_keep=1, keep_best=1, best_metric="m", metrics_of=lambda c: {"m": metrics.get(c)})
    assert got == {"c2": ["best"], "c5": ["latest"]}


def test_select_keeps_what_kept_ones_need_transitively():
    parents = {"c9": ["c8"], "c8": ["c5"], "c5": ["c0"], "c3": ["c2"]}
    got = select(IDS, max_keep=1, depends_on=lambda c: parents.get(c, ()))
    assert got == {"c0": ["needed by c5"], "c5": ["needed by c8"], "c8": ["needed by c9"], "c9": ["latest"]}
    # A dependency that is not listed is ignored (it is not a committed checkpoint).
    assert select(["x", "y"], max_keep=1, depends_on=lambda c: ["gone"]) == {"y": ["latest"]}


def test_select_calls_step_and_metric_lookups_only_when_a_rule_needs_them():
    def boom(ckpt):
        raise AssertionError("not needed")
    assert select(IDS, max_keep=2, step_of=boom, metrics_of=boom) == {"c8": ["latest"], "c9": ["latest"]}


# ------------------------------------------------------------------------- 30 saves, a restart, gc
AUC = {14: 0.91, 36: 0.95, 50: 0.93}  # every other step: 0.5
EXPECTED = {  # steps 2, 4, ..., 60 with max_keep=3, keep_every_n_steps=10, keep_best=2 (auc, max)
    "ckpt_2": ["every_n_steps"], "ckpt_10": ["every_n_steps"], "ckpt_20": ["every_n_steps"],
    "ckpt_30": ["every_n_steps"], "ckpt_36": ["best"], "ckpt_40": ["every_n_steps"],
    "ckpt_50": ["every_n_steps", "best"], "ckpt_56": ["latest"], "ckpt_58": ["latest"],
    "ckpt_60": ["latest", "every_n_steps"],
}


def _manager(out):
    job = make_job(out, max_keep=3, save_interval=None)
    mgr = CheckpointManager(job.saver, 2, keep_every_n_steps=10, keep_best=2, best_metric="auc",
                            save_on_preemption=False)
    return job, mgr


def _train(job, mgr, until):
    while mgr.global_step < until:
        job.train(1)
        step = mgr.global_step + 1  # metrics on the saving steps (save_interval 2), as documented
        mgr.step(metrics={"auc": AUC.get(step, 0.5), "loss": 1.0 / step} if step % 2 == 0 else None)


def test_thirty_saves_keep_exactly_the_expected_set_across_a_restart(tmp_path, capsys):
    out = str(tmp_path / "run")
    job, mgr = _manager(out)
    _train(job, mgr, 32)  # 16 saves; ckpt_14 is still among the best two
    assert "ckpt_14" in [e["id"] for e in list_checkpoints(out)]
    mgr.close()

    job, mgr = _manager(out)  # a restart: a new Saver and manager over the same dir
    assert mgr.restore() == 32
    _train(job, mgr, 60)  # 14 more saves: 30 in all
    mgr.close()

    with open(os.path.join(out, "checkpoint")) as f:
        assert f.read().split() == list(EXPECTED)  # oldest first
    assert listing(out) == sorted(["checkpoint", *EXPECTED])
    assert {e["id"]: e["kept"] for e in list_checkpoints(out)} == EXPECTED
    assert read_index(os.path.join(out, "ckpt_36")).metrics == {"auc": 0.95, "loss": 1.0 / 36}
    assert read_index(os.path.join(out, "ckpt_36")).retention.to_json() == {
        "max_keep": 3, "keep_every_n_steps": 10, "keep_best": 2, "best_metric": "auc", "best_mode": "max"}

    # gc agrees: nothing to remove, the list stays.
    assert clean_output_dir(out) == {"removed_checkpoints": [], "removed_temp_files": [], "aborted_uploads": [],
                                     "kept_broken": {}}
    assert listing(out) == sorted(["checkpoint", *EXPECTED])

    assert main(["ls", "--json", out]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {c["id"]: c["kept"] for c in doc["checkpoints"]} == EXPECTED
    assert main(["ls", out]) == 0
    text = capsys.readouterr().out
    assert "every_n_steps, best" in text.splitlines()[[c["id"] for c in doc["checkpoints"]].index("ckpt_50") + 1]


def test_a_manager_given_no_retention_keeps_the_savers(tmp_path):
    """Retention set on the Saver, then a manager made without retention arguments: the manager used
    to reset it to plain max_keep, and rotation pruned the best checkpoint the user asked to keep."""
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=3, save_interval=None)
    job.saver.set_retention(keep_every_n_steps=10, keep_best=2, best_metric="auc")
    mgr = CheckpointManager(job.saver, 2, save_on_preemption=False)
    assert (mgr.keep_every_n_steps, mgr.keep_best, mgr.best_metric, mgr.best_mode) == (10, 2, "auc", "max")
    _train(job, mgr, 60)
    mgr.close()
    assert {e["id"]: e["kept"] for e in list_checkpoints(out)} == EXPECTED
    # Given any retention argument, the manager's settings apply, as documented.
    other = make_job(str(tmp_path / "other"), max_keep=3, save_interval=None)
    other.saver.set_retention(keep_every_n_steps=10, keep_best=2, best_metric="auc")
    CheckpointManager(other.saver, 2, keep_best=1, best_metric="loss", best_mode="min", save_on_preemption=False)
    assert other.saver.retention.to_json() == {"max_keep": 3, "keep_every_n_steps": None, "keep_best": 1,
                                               "best_metric": "loss", "best_mode": "min"}


KEPT_AT_20 = ["ckpt_2", "ckpt_10", "ckpt_14", "ckpt_16", "ckpt_18", "ckpt_20"]


def _left_unpruned(tmp_path, after=()) -> str:
    """The output dir of 20 steps (_manager's policy keeps KEPT_AT_20) with the pruned ckpt_12 put
    back and listed, as a crash between the list and the pruning leaves it, and the ids `after`
    listed last (saved by another job, whose directory tmp_path/other keeps them)."""
    out = str(tmp_path / "run")
    job, mgr = _manager(out)
    _train(job, mgr, 20)
    mgr.close()
    assert [e["id"] for e in list_checkpoints(out)] == KEPT_AT_20
    job2 = make_job(str(tmp_path / "other"), max_keep=None, save_interval=None)
    for ckpt_id in ("ckpt_12", *after):
        job2.saver.save(ckpt_id)
    job2.saver.close()
    os.rename(tmp_path / "other" / "ckpt_12", tmp_path / "run" / "ckpt_12")
    with open(os.path.join(out, "checkpoint"), "w") as f:
        f.write("".join(f"{i}\n" for i in [*KEPT_AT_20[:2], "ckpt_12", *KEPT_AT_20[2:], *after]))
    return out


def test_gc_applies_the_recorded_policy_to_a_list_left_unpruned(tmp_path):
    """A save that died after listing its checkpoint but before pruning leaves more listed than the
    policy keeps: gc finishes the rotation the same way."""
    out = _left_unpruned(tmp_path)
    assert clean_output_dir(out)["removed_checkpoints"] == ["ckpt_12"]
    assert [e["id"] for e in list_checkpoints(out)] == KEPT_AT_20


def test_ls_says_what_gc_keeps_when_the_latest_listed_is_gone(tmp_path):
    """The list names ckpt_12 (pruned, put back) and, last, a ckpt_22 whose directory is gone. ls
    took the policy from ckpt_22 (unreadable: "keep all") and showed every checkpoint kept, while
    gc, which drops ckpt_22 first, removed ckpt_12."""
    import shutil
    out = _left_unpruned(tmp_path, after=["ckpt_22"])
    shutil.rmtree(tmp_path / "other")
    shown = {e["id"]: e["kept"] for e in list_checkpoints(out)}
    assert shown["ckpt_12"] == [] and shown["ckpt_22"] == [] and "latest" in shown["ckpt_20"]
    assert clean_output_dir(out)["removed_checkpoints"] == ["ckpt_12"]
    assert [e["id"] for e in list_checkpoints(out) if e["kept"]] == KEPT_AT_20


def test_gc_keeps_every_listed_checkpoint_when_the_latest_is_a_newer_recsaves(tmp_path):
    """The latest index names no policy this recsave can read (a newer recsave wrote it): gc keeps
    the list as it is rather than apply an older checkpoint's policy (which would delete what the
    newer writer keeps)."""
    out = _left_unpruned(tmp_path)
    with open(os.path.join(out, "checkpoint")) as f:
        ids = f.read().split()
    index = read_index_json(os.path.join(out, "ckpt_20"))
    index["format_version"] = 99
    write_index_json(os.path.join(out, "ckpt_20"), index)
    assert clean_output_dir(out)["removed_checkpoints"] == []
    with open(os.path.join(out, "checkpoint")) as f:
        assert f.read().split() == ids


def test_a_plain_saver_records_no_policy_and_gc_keeps_its_list(tmp_path):
    out = str(tmp_path / "run")
    saver = make_job(out, max_keep=2).saver
    for i in range(3):
        saver.save(f"s{i}", metrics={"auc": float(i)})
    saver.close()
    index = read_index(os.path.join(out, "s2"))
    assert index.retention is None and index.metrics == {"auc": 2.0}
    raw = read_index_json(os.path.join(out, "s2"))  # the seal left out
    assert list(raw)[-2:] == ["meta", "metrics"]  # after "meta"; no "retention" key
    assert [(e["id"], e["kept"]) for e in list_checkpoints(out)] == [("s1", ["latest"]), ("s2", ["latest"])]
    assert clean_output_dir(out)["removed_checkpoints"] == []


def test_a_checkpoint_without_metrics_has_no_metrics_key(tmp_path):
    out = str(tmp_path / "run")
    saver = make_job(out).saver
    saver.save("a")
    with open(os.path.join(out, "a", "index")) as f:
        assert "metrics" not in json.load(f)


def test_bad_metrics_in_an_index_are_corrupt(tmp_path):
    out = str(tmp_path / "run")
    make_job(out).saver.save("a", metrics={"auc": 0.5})
    raw = read_index_json(os.path.join(out, "a"))
    raw["metrics"] = {"auc": "high"}
    write_index_json(os.path.join(out, "a"), raw)
    with pytest.raises(CorruptCheckpointError, match="metric 'auc' must be a finite number"):
        read_index(os.path.join(out, "a"))


@pytest.mark.parametrize("metrics,error", [
    ("auc", ArgumentTypeError), ({"auc": "x"}, UsageError), ({"auc": float("inf")}, UsageError),
    ({"auc": True}, UsageError), ({1: 0.5}, UsageError), ({"": 0.5}, UsageError), ({"auc": 10 ** 400}, UsageError)])
def test_bad_metrics_are_refused_before_anything_is_written(tmp_path, metrics, error):
    out = tmp_path / "run"
    saver = make_job(str(out)).saver
    with pytest.raises(error):
        saver.save("a", metrics=metrics)
    assert not (out / "a").exists()


@pytest.mark.parametrize("kwargs,error", [
    ({"keep_every_n_steps": 0}, UsageError), ({"keep_every_n_steps": "10"}, ArgumentTypeError),
    ({"keep_best": -1}, UsageError), ({"keep_best": 2}, UsageError),  # no best_metric
    ({"keep_best": 1, "best_metric": "auc", "best_mode": "up"}, UsageError),
    ({"best_metric": 3}, ArgumentTypeError), ({"keep_best": True}, ArgumentTypeError)])
def test_bad_retention_settings(tmp_path, kwargs, error):
    saver = Saver(make_job(str(tmp_path)).model, output_dir=str(tmp_path / "x"))
    with pytest.raises(error):
        CheckpointManager(saver, 1, save_on_preemption=False, **kwargs)
    with pytest.raises(error):
        saver.set_retention(**kwargs)


@pytest.mark.parametrize("case", ["keep_best", "keep_every_n_steps", "delta_parent"])
def test_a_failed_index_read_during_rotation_deletes_nothing(tmp_path, monkeypatch, case):
    """A StorageError while rotation reads an index (a timeout, EIO) is no answer: taken as "no
    step, no metrics" or "no parent", the best / every-n checkpoint or a kept delta's parent fell
    out of the selection and the same save deleted it. Now that save keeps every checkpoint (with a
    warning) and the next one prunes."""
    from recsave.errors import StorageError
    from recsave.storage.local import LocalStorage

    out = str(tmp_path / "run")
    kw = {"keep_best": {"keep_best": 1, "best_metric": "auc"}, "keep_every_n_steps": {"keep_every_n_steps": 100},
          "delta_parent": {"full_every": 3}}[case]
    job = make_job(out, save_interval=0, max_keep=1 if case != "delta_parent" else 2, manager_kw=kw)
    for step, auc in [(2, 0.9), (4, 0.5)] + ([(6, 0.4)] if case != "delta_parent" else []):
        job.train(1)
        job.manager.global_step = step
        job.manager.save(metrics={"auc": auc})
    first = "ckpt_2" if case != "delta_parent" else "ckpt_4"  # the best / every-n one, or the delta
    job.manager.wait()  # the pruned directories deleted (save/pruning.py)
    before = listing(out)
    job.manager.close()

    job = make_job(out, save_interval=0, max_keep=1 if case != "delta_parent" else 2, manager_kw=kw)
    job.manager.restore()  # a new process: nothing cached
    real, failed = LocalStorage.read_bytes, []

    def flaky(self, path, limit):  # once, in rotation: after the new checkpoint's commit point
        if path.endswith(f"{first}/index") and not failed and os.path.exists(os.path.join(out, "ckpt_8", "index")):
            failed.append(path)
            raise StorageError(f"{path}: reading failed: Input/output error (injected)", path=path)
        return real(self, path, limit)

    monkeypatch.setattr(LocalStorage, "read_bytes", flaky)
    job.train(1)
    job.manager.global_step = 8
    with pytest.warns(RuntimeWarning, match="every checkpoint is kept this time"):
        job.manager.save(metrics={"auc": 0.1})
    assert failed and listing(out) == sorted({*before, "ckpt_8"})
    monkeypatch.setattr(LocalStorage, "read_bytes", real)
    job.train(1)
    job.manager.global_step = 10
    job.manager.save(metrics={"auc": 0.2})  # reads succeed: rotation prunes as the policy says
    job.manager.wait()
    kept = [n for n in listing(out) if n != "checkpoint"]
    if case != "delta_parent":  # the latest and the best / every-n one
        assert kept == ["ckpt_10", "ckpt_2"]
    for name in kept:  # every listed checkpoint loads: no chain lost a member
        assert job.manager.restore(global_step=int(name.split("_")[1])) == int(name.split("_")[1])
    job.manager.close()


def test_gc_stops_on_a_failed_index_read_and_deletes_nothing(tmp_path, monkeypatch):
    """`recsave gc` applies the recorded policy; a StorageError while it reads the keep_best
    checkpoint's index is raised, not taken as "no metrics" (which dropped that checkpoint from
    the selection and deleted it)."""
    from recsave.errors import StorageError
    from recsave.storage.local import LocalStorage

    out = str(tmp_path / "run")
    job = make_job(out, save_interval=0, max_keep=1, manager_kw={"keep_best": 1, "best_metric": "auc"})
    for step, auc in [(2, 0.9), (4, 0.5), (6, 0.4)]:
        job.train(1)
        job.manager.global_step = step
        job.manager.save(metrics={"auc": auc})
    job.manager.close()
    before = listing(out)
    real, failed = LocalStorage.read_bytes, []

    def flaky(self, path, limit):
        if path.endswith(os.path.join("ckpt_2", "index")) and not failed:
            failed.append(path)
            raise StorageError(f"{path}: Input/output error (injected)", path=path)
        return real(self, path, limit)

    monkeypatch.setattr(LocalStorage, "read_bytes", flaky)
    with pytest.raises(StorageError, match="injected"):
        clean_output_dir(out)
    assert failed and listing(out) == before
    assert clean_output_dir(out)["removed_checkpoints"] == []  # read fine now: the best one stays
    assert "ckpt_2" in listing(out)


def test_rotation_keeps_a_chains_base_past_a_member_it_cannot_read(tmp_path):
    """Chain ckpt_1 <- ckpt_2 <- ckpt_3 <- ckpt_4 with ckpt_2's index damaged: following parents
    stops at ckpt_2, but each delta also names its base, so rotation (max_keep=2, keeping ckpt_4)
    never deletes ckpt_1, which ckpt_4 needs once ckpt_2's index is restored from a backup."""
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=2)
    for step in range(1, 5):
        job.train(1)
        job.saver.save(f"ckpt_{step}", incremental=step > 1)
    assert read_index(os.path.join(out, "ckpt_4")).base == "ckpt_1"
    job.saver.close()
    index = os.path.join(out, "ckpt_2", "index")
    with open(index, "rb") as f:
        good = f.read()
    with open(index, "wb") as f:
        f.write(good[: len(good) // 2])  # torn
    again = make_job(out, max_keep=2)
    again.train(1)
    again.saver.save("ckpt_5")
    again.saver.close()
    assert os.path.isdir(os.path.join(out, "ckpt_1"))
    with open(index, "wb") as f:
        f.write(good)
    fresh = make_job(out)
    fresh.saver.load(os.path.join(out, "ckpt_4"), direct_path=True)  # the whole chain is there
    fresh.saver.close()


def test_metrics_of_a_step_that_does_not_save_are_dropped_with_one_warning(tmp_path):
    """Only a saving step stores metrics: on another step they would describe another model
    state than the next checkpoint's. The manager says so once, and stores a saving step's own."""
    import warnings

    out = str(tmp_path / "run")
    job, mgr = _manager(out)
    job.train(1)
    with pytest.warns(RuntimeWarning, match=r"metrics \['auc'\] were passed on global step 1, which does "
                                            r"not save"):
        assert mgr.step(metrics={"auc": 0.9}) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = mgr.step(metrics={"auc": 0.7})
        assert mgr.step(metrics={"auc": 0.8}) is None  # warned once per manager
    assert read_index(path).metrics == {"auc": 0.7}
    mgr.close()


def test_no_warning_for_metrics_when_time_based_saves_decide_in_step(tmp_path):
    import warnings

    job = make_job(str(tmp_path / "run"), max_keep=3, save_interval=None)
    mgr = CheckpointManager(job.saver, 0, save_interval_seconds=3600.0, save_on_preemption=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.step(metrics={"auc": 0.9}) is None
    mgr.close()


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_metrics_a_save_cannot_record_are_not_dropped_silently(tmp_path, mode):
    """save(metrics=...) after the step's autosave (an evaluation after a saving step) returns that
    checkpoint, whose index cannot change: keep_best never ranks it by them, and rotation prunes it
    even when it is the best. The manager says so; metrics it does record, or none, are quiet."""
    import warnings

    out = str(tmp_path / "run")
    job = make_job(out, max_keep=1, save_interval=2, async_mode=mode,
                   manager_kw=dict(keep_best=1, best_metric="auc"))
    mgr = job.manager
    job.train(2)
    with pytest.warns(RuntimeWarning, match=r"ckpt_2 holds this state already and is not written again, so "
                                            r"metrics \['auc'\] are not recorded in it \(it records none\)"):
        assert mgr.save(metrics={"auc": 0.9}) == os.path.join(out, "ckpt_2")
    assert read_index(os.path.join(out, "ckpt_2")).metrics is None
    job.train(1)
    path = mgr.step(metrics={"auc": 0.7})
    mgr.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.save(metrics={"auc": 0.7}) == path  # what it records
        assert mgr.save() == path
    with pytest.warns(RuntimeWarning, match=r"it records \{'auc': 0.7\}"):
        mgr.save(metrics={"auc": 0.8})
    mgr.close()
    again = make_job(out, max_keep=1, save_interval=2, manager_kw=dict(keep_best=1, best_metric="auc"))
    assert again.manager.restore() == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.manager.save(metrics={"auc": 0.7})
    with pytest.warns(RuntimeWarning, match=r"ckpt_4 holds this state already"):
        again.manager.save(metrics={"auc": 0.1})
    again.manager.close()


def test_an_index_over_max_index_bytes_never_lets_gc_or_rotation_delete_what_it_needs(tmp_path):
    """ckpt_2, a delta of ckpt_1, is kept as the best; its index is over the knob max_index_bytes
    here (a job that raised the knob wrote it). Read as "no metrics, no parent", gc unlisted it and
    deleted ckpt_1, its base: ckpt_2 could no longer be restored. Its metrics and parent are
    unknown, not absent: gc refuses (deleting nothing), ls shows every checkpoint kept, and a save's
    rotation keeps everything with a warning."""
    from recsave import knobs
    from recsave.errors import OverLimitError

    out = str(tmp_path / "run")

    def manager(job):
        return CheckpointManager(job.saver, 0, full_every=2, rebase_ratio=100.0, keep_best=1,
                                 best_metric="auc", save_on_preemption=False)
    job = make_job(out, max_keep=1, save_interval=None)
    mgr = manager(job)
    for step, auc in ((1, 0.05), (2, 0.9), (3, 0.1)):
        job.train(1)
        mgr.global_step = step
        mgr.save(metrics={"auc": auc})
    mgr.close()
    assert [read_index(os.path.join(out, i)).kind for i in ("ckpt_1", "ckpt_2", "ckpt_3")] == ["full", "delta", "full"]
    assert listing(out) == ["checkpoint", "ckpt_1", "ckpt_2", "ckpt_3"]
    index_path = os.path.join(out, "ckpt_2", "index")
    with open(index_path, "rb") as f:
        original = f.read()
    limit = max(os.path.getsize(os.path.join(out, i, "index")) for i in ("ckpt_1", "ckpt_3")) + 100
    with open(index_path, "ab") as f:
        f.write(b" " * (limit + 1 - len(original)))  # over the limit: never parsed, so maybe intact
    with knobs.override(max_index_bytes=limit):
        with pytest.raises(OverLimitError, match="max_index_bytes"):
            clean_output_dir(out)
        assert listing(out) == ["checkpoint", "ckpt_1", "ckpt_2", "ckpt_3"]
        assert {e["id"]: e["kept"] for e in list_checkpoints(out)} == {
            "ckpt_1": ["latest"], "ckpt_2": ["latest"], "ckpt_3": ["latest"]}
        assert main(["gc", out]) == 2
        later = make_job(out, max_keep=1, save_interval=None)
        mgr = manager(later)
        mgr.global_step = 4
        with pytest.warns(RuntimeWarning, match="every checkpoint is kept this time"):
            mgr.save(metrics={"auc": 0.2})
        mgr.close()
        assert listing(out) == ["checkpoint", "ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"]
    with open(index_path, "wb") as f:
        f.write(original)
    again = make_job(out, max_keep=1, save_interval=1)
    assert again.manager.restore(global_step=2) == 2
    again.manager.close()
