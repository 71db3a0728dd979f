"""Load / model-bank configuration (docs/API.md, "Load / model-bank config"): every key, every category,
patterns, renames, merges, entry priority, and every documented error — after which nothing of the
model, its optimizers or its io state has changed."""
from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_jobs_equal, assert_obj_equal, job_state, make_job, same_bits, train

from recsave import (
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    HashTable,
    Saver,
    ShapeMismatchError,
    UsageError,
)
from recsave.optim import SparseAdagrad

SLOT = "adagrad_acc"
SLOT_INIT = 0.1  # make_job's SparseAdagrad initial_accumulator_value
DENSE = ["bn.bias", "bn.num_batches_tracked", "bn.running_mean", "bn.running_var", "bn.weight",
         "mlp.0.bias", "mlp.0.weight", "mlp.2.bias", "mlp.2.weight"]


@pytest.fixture
def saved(tmp_path):
    """A committed checkpoint of a trained job: (output dir, checkpoint dir, its full state)."""
    out = str(tmp_path / "src")
    job = make_job(out)
    job.train(8)
    ckpt = job.saver.save("ckpt_8")
    return out, ckpt, job_state(job)


def live_job(tmp_path, name="live", **kw):
    """A job that trained on other batches: its ids overlap the checkpoint's only partly, and all of
    its values differ."""
    job = make_job(str(tmp_path / name), **kw)
    train(job.model, job.opts, 3, start=777)
    job.reader.offset = 123
    return job


def with_counts(sparse_opt, **counts):
    """A sparse optimizer's state_dict with some tables' step counts replaced."""
    return {**sparse_opt, "steps": {**sparse_opt["steps"], **counts}}


def table(state, name):
    """{id: (embedding row, slot row)} of a table in a job_state()."""
    m = state["model"]
    ids = m[f"{name}@id"].tolist()
    return {i: (m[f"{name}@embedding"][k], m[f"{name}@{SLOT}"][k]) for k, i in enumerate(ids)}


def assert_table(after, name, expected):
    got = table(after, name)
    assert sorted(got) == sorted(expected), f"{name}: id sets differ"
    for i, (emb, slot) in expected.items():
        assert same_bits(got[i][0], emb), f"{name}[{i}] embedding"
        assert same_bits(got[i][1], slot), f"{name}[{i}] {SLOT}"


def assert_dense(after, source, names=DENSE):
    for n in names:
        assert same_bits(after["model"][n], source["model"][n]), n


def with_slot(rows, value):
    return {i: (emb, torch.full_like(slot, value)) for i, (emb, slot) in rows.items()}


# ------------------------------------------------------------------------------------ errors
ERROR_CONFS = {
    "unknown_key": ({"lod": ["*"]}, ConfigError),
    "unknown_category_like": ({"load": ["sparse_optimizer"]}, ConfigError),
    "unknown_category_in_exclude": ({"exclude": ["denseparams"]}, ConfigError),
    "pattern_matches_nothing": ({"load": ["user", "nosuch.*"]}, ConfigError),
    "strict_not_bool": ({"strict": "yes"}, ConfigError),
    "strict_int": ({"strict": 1}, ConfigError),
    "hashtable_clear_not_bool": ({"hashtable_clear": "false"}, ConfigError),
    "ignore_error_not_bool": ({"ignore_error": None}, ConfigError),
    "skip_not_bool": ({"skip": 0}, ConfigError),
    "load_not_a_list": ({"load": 3}, ConfigError),
    "oname_star_model_side_only": ({"oname": [{"user*": "item"}]}, ConfigError),
    "oname_star_ckpt_side_only": ({"oname": [{"user": "it*"}]}, ConfigError),
    "oname_not_a_mapping": ({"oname": ["user"]}, ConfigError),
    "oname_rename_to_absent": ({"oname": [{"user": "nosuch"}]}, ConfigError),  # strict: user missing
    # a slot rename matched nothing and loaded the slot under its own name
    "oname_slot_rename": ({"oname": [{"user@adagrad_acc": "user@adagrad_acc_old"}]}, ConfigError),
}


@pytest.mark.parametrize("case", sorted(ERROR_CONFS))
def test_config_errors_change_nothing(tmp_path, saved, case):
    out, ckpt, _ = saved
    conf, error = ERROR_CONFS[case]
    job = live_job(tmp_path)
    before = job_state(job)
    with pytest.raises(error):
        job.saver.load(out, load_conf=conf)
    assert_jobs_equal(job_state(job), before)
    assert job.reader.loaded == []
    # The same entry in a model bank, after a valid entry: still nothing applied.
    with pytest.raises(error):
        job.saver.load_model_bank([{"path": ckpt}, dict(conf, path=out)])
    assert_jobs_equal(job_state(job), before)


def test_config_error_messages_name_the_key(tmp_path, saved):
    out, _, _ = saved
    job = live_job(tmp_path)
    with pytest.raises(ConfigError, match="lod"):
        job.saver.load(out, load_conf={"lod": ["*"]})
    with pytest.raises(ConfigError, match="sparse_optimizer"):
        job.saver.load(out, load_conf={"load": ["sparse_optimizer"]})
    with pytest.raises(ConfigError, match="strict"):
        job.saver.load(out, load_conf={"strict": "yes"})


def test_table_dim_mismatch(tmp_path, saved):
    out, _, _ = saved
    job = live_job(tmp_path, item_dim=4)
    before = job_state(job)
    for conf in ({"load": ["sparse"]}, {"load": ["item"]}, {}):
        with pytest.raises(ShapeMismatchError) as exc:
            job.saver.load(out, load_conf=conf)
        assert isinstance(exc.value, ValueError)
        assert_jobs_equal(job_state(job), before)
    with pytest.raises(ShapeMismatchError, match="item"):
        job.saver.load(out, load_conf={"load": ["item"]})
    # Excluding the mismatching table (and the dense shapes it changes) loads the rest.
    report = job.saver.load(out, load_conf={"load": ["user*"]})
    assert sorted(report.loaded) == ["user", f"user@{SLOT}"]


def test_table_dtype_mismatch(tmp_path, saved):
    out, _, _ = saved

    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.user = HashTable(8, name="user", dtype=torch.float64)

    model = Wide()
    model.user(torch.arange(10))
    saver = Saver(model, output_dir=str(tmp_path / "wide"))
    before = model.user.export()
    with pytest.raises(ShapeMismatchError):
        saver.load(out, load_conf={"load": ["user"], "strict": False})
    after = model.user.export()
    assert same_bits(before[0], after[0]) and same_bits(before[1], after[1])


def test_dense_shape_mismatch(tmp_path, saved):
    out, _, _ = saved
    job = live_job(tmp_path, hidden=12)
    before = job_state(job)
    for conf in ({}, {"load": ["dense"]}, {"load": ["mlp.*"]}):
        with pytest.raises(ShapeMismatchError):
            job.saver.load(out, load_conf=conf)
        assert_jobs_equal(job_state(job), before)
    with pytest.raises(ShapeMismatchError, match=r"mlp\.0\."):
        job.saver.load(out, load_conf={"load": ["mlp.0.weight"]})
    job.saver.load(out, load_conf={"load": ["bn.*"]})  # same shapes there


@pytest.mark.parametrize("where", ["nonexistent", "empty_dir", "ckpt_id"])
def test_missing_path(tmp_path, saved, where):
    out, _, _ = saved
    job = live_job(tmp_path)
    before = job_state(job)
    with pytest.raises(CheckpointNotFoundError) as exc:
        if where == "nonexistent":
            job.saver.load(str(tmp_path / "nope"))
        elif where == "empty_dir":
            os.makedirs(tmp_path / "empty")
            job.saver.load_by_config(str(tmp_path / "empty"), {"load": ["*"]})
        else:
            job.saver.load(out, ckpt_id="ckpt_999")
    assert isinstance(exc.value, FileNotFoundError)
    assert_jobs_equal(job_state(job), before)
    with pytest.raises(CheckpointNotFoundError):
        job.saver.load_model_bank([{"path": str(tmp_path / "nope")}])
    assert_jobs_equal(job_state(job), before)


def test_strict_missing_names(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path, extra_table="extra_tab")
    before = job_state(job)
    with pytest.raises(ConfigError, match="extra_tab"):
        job.saver.load(out)
    assert_jobs_equal(job_state(job), before)

    report = job.saver.load(out, load_conf={"strict": False})
    assert sorted(report.missing) == ["extra_tab", f"extra_tab@{SLOT}"]
    assert report.unexpected == []
    after = job_state(job)
    for name in ("user", "item"):
        assert_table(after, name, table(src, name))
    assert_table(after, "extra_tab", table(before, "extra_tab"))
    assert_dense(after, src)
    # Excluding the missing names makes the strict load valid.
    job.saver.load(out, load_conf={"exclude": ["extra_tab*"]})


def test_pattern_matching_nothing_with_ignore_error(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    report = job.saver.load(out, load_conf={"load": ["nosuch*"], "ignore_error": True})
    assert report.loaded == {}
    assert_jobs_equal(job_state(job), before)
    job.saver.load(out, load_conf={"exclude": ["nosuch"], "ignore_error": True})
    assert_jobs_equal(job_state(job), src)


# -------------------------------------------------------------------------------- categories
def test_category_sparse(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    report = job.saver.load(out, load_conf={"load": ["sparse"]})
    assert sorted(report.loaded) == ["item", "user"]
    after = job_state(job)
    for name in ("user", "item"):  # cleared, then the checkpoint's rows; slots not loaded: init value
        assert_table(after, name, with_slot(table(src, name), SLOT_INIT))
    assert_dense(after, before)
    assert_obj_equal(after["dense_opt"], before["dense_opt"])
    # the step counts go with the slots: at their init, the tables count from 0 again
    assert after["sparse_opt"] == with_counts(before["sparse_opt"], user=0, item=0)
    assert after["reader"] == before["reader"]


def test_category_dense(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    report = job.saver.load(out, load_conf={"load": ["dense"]})
    assert sorted(report.loaded) == DENSE
    after = job_state(job)
    assert_dense(after, src)
    for name in ("user", "item"):
        assert_table(after, name, table(before, name))
    assert_obj_equal(after["dense_opt"], before["dense_opt"])
    assert after["sparse_opt"] == before["sparse_opt"] and after["reader"] == before["reader"]


def test_category_extra(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    report = job.saver.load(out, load_conf={"load": ["extra"]})
    assert sorted(report.loaded) == ["dense_opt"]
    after = job_state(job)
    assert_obj_equal(after["dense_opt"], src["dense_opt"])
    assert after["sparse_opt"] == before["sparse_opt"]  # sparse_optim is category sparse_opt
    assert_dense(after, before)
    assert after["reader"] == before["reader"]


def test_category_sparse_opt_updates_only_live_ids(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    report = job.saver.load(out, load_conf={"load": ["sparse_opt"]})
    assert sorted(report.loaded) == ["item@" + SLOT, "sparse_optim", "user@" + SLOT]
    after = job_state(job)
    for name in ("user", "item"):
        live, ckpt = table(before, name), table(src, name)
        both = set(live) & set(ckpt)
        assert both and set(live) - set(ckpt) and set(ckpt) - set(live), "test data must overlap partly"
        expected = {i: (emb, ckpt[i][1] if i in ckpt else slot) for i, (emb, slot) in live.items()}
        assert_table(after, name, expected)  # no id of the checkpoint was inserted
        assert report.loaded[f"{name}@{SLOT}"].rows == len(ckpt)  # the rows read, not the len(both) set
    assert after["sparse_opt"] == src["sparse_opt"]
    assert_dense(after, before)
    assert_obj_equal(after["dense_opt"], before["dense_opt"])


def test_category_io_state(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    report = job.saver.load(out, load_conf={"load": ["io_state"]})
    assert sorted(report.loaded) == ["reader"]
    assert job.reader.loaded == [{"offset": 8}]
    after = job_state(job)
    assert after["reader"] == src["reader"] == 8
    assert_dense(after, before)
    assert_table(after, "user", table(before, "user"))


def test_category_star_and_exclude_categories(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    report = job.saver.load(out, load_conf={"load": ["*"], "exclude": ["dense", "io_state", "extra"]})
    assert sorted(report.loaded) == ["item", f"item@{SLOT}", "sparse_optim", "user", f"user@{SLOT}"]
    after = job_state(job)
    for name in ("user", "item"):
        assert_table(after, name, table(src, name))
    assert after["sparse_opt"] == src["sparse_opt"]
    assert_dense(after, before)
    assert after["reader"] == before["reader"]


# ---------------------------------------------------------------------------------- patterns
def test_pattern_table_with_its_slots(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    report = job.saver.load(out, load_conf={"load": ["user*"]})
    assert sorted(report.loaded) == ["user", f"user@{SLOT}"]
    after = job_state(job)
    assert_table(after, "user", table(src, "user"))
    assert_table(after, "item", table(before, "item"))
    assert_dense(after, before)
    assert after["sparse_opt"] == with_counts(before["sparse_opt"], user=src["sparse_opt"]["steps"]["user"])


def test_pattern_dense_prefix(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    report = job.saver.load(out, load_conf={"load": ["mlp.*"]})
    mlp = [n for n in DENSE if n.startswith("mlp.")]
    assert sorted(report.loaded) == mlp
    assert sorted(report.skipped) == sorted(set(DENSE) - set(mlp) | {
        "user", "item", f"user@{SLOT}", f"item@{SLOT}", "sparse_optim", "dense_opt", "reader"})
    after = job_state(job)
    assert_dense(after, src, mlp)
    assert_dense(after, before, [n for n in DENSE if n.startswith("bn.")])
    assert_table(after, "user", table(before, "user"))


def test_pattern_slot_only(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    report = job.saver.load(out, load_conf={"load": ["user@adagrad*"]})
    assert sorted(report.loaded) == [f"user@{SLOT}"]
    after = job_state(job)
    live, ckpt = table(before, "user"), table(src, "user")
    assert_table(after, "user", {i: (e, ckpt[i][1] if i in ckpt else s) for i, (e, s) in live.items()})
    assert_table(after, "item", table(before, "item"))
    assert after["sparse_opt"] == with_counts(before["sparse_opt"], user=src["sparse_opt"]["steps"]["user"])


def test_exclude_slots_leaves_them_at_init(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    report = job.saver.load(out, load_conf={"exclude": ["*@adagrad*"]})
    assert f"user@{SLOT}" not in report.loaded and f"user@{SLOT}" in report.skipped
    after = job_state(job)
    for name in ("user", "item"):
        assert_table(after, name, with_slot(table(src, name), SLOT_INIT))
    assert_dense(after, src)
    assert after["sparse_opt"] == with_counts(src["sparse_opt"], user=0, item=0)  # slots at init
    assert_obj_equal(after["dense_opt"], src["dense_opt"])
    assert after["reader"] == src["reader"]


def test_excluding_a_table_by_name_warns_that_its_slots_still_load(tmp_path, saved):
    """`exclude: ["user"]` names the table's rows only (its slots are category sparse_opt): the
    slots still load onto the live rows, as documented, with one warning naming them and the way
    to leave the table out whole, which then loads nothing of it and warns no more."""
    import warnings

    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    with pytest.warns(RuntimeWarning, match=r"'exclude' leaves out table\(s\) \['user'\] but not their "
                                            rf"slots, which load onto the live rows: \['user@{SLOT}'\]; to "
                                            r"leave a table out whole, exclude '<table>@\*' too \(e.g. 'user@\*'\)"):
        report = job.saver.load(out, load_conf={"exclude": ["user", "io_state"]})
    assert f"user@{SLOT}" in report.loaded and "user" in report.skipped
    job = live_job(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = job.saver.load(out, load_conf={"exclude": ["user", "user@*", "io_state"]})
    assert not any(n.startswith("user") for n in report.loaded)
    assert_table(job_state(job), "user", table(before, "user"))
    with warnings.catch_warnings():  # a slot-only load the author asked for says nothing
        warnings.simplefilter("error")
        live_job(tmp_path).saver.load(out, load_conf={"load": ["user@adagrad*"]})


def test_the_slots_warning_follows_what_exclude_and_load_select(tmp_path, saved):
    """The warning for a table excluded by name whose slots still load: also when the pattern
    names the table by its source name through `oname` (documented to select it), and not when
    `load` itself asked for the slots only (the table is not loaded either way)."""
    import warnings

    class Renamed(torch.nn.Module):
        def __init__(self, name: str):
            super().__init__()
            setattr(self, name, HashTable(4, name=name))
            getattr(self, name).add_slot("acc", 0.0)
            self.lin = torch.nn.Linear(2, 2)

    src = Renamed("u")
    src.u.load_rows(torch.arange(3), torch.randn(3, 4), {"acc": torch.rand(3, 4)})
    ckpt = Saver(src, output_dir=str(tmp_path / "renamed")).save("ckpt_1")
    model = Renamed("user")
    with pytest.warns(RuntimeWarning, match=r"leaves out table\(s\) \['user'\] but not their slots"):
        report = Saver(model, output_dir=str(tmp_path / "x")).load(
            ckpt, load_conf={"exclude": ["u"], "oname": {"user": "u"}})
    assert "user@acc" in report.loaded and "user" in report.skipped
    out, _, _ = saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = live_job(tmp_path).saver.load(out, load_conf={"load": ["user@adagrad*"], "exclude": ["user"]})
    assert sorted(report.loaded) == [f"user@{SLOT}"]


# ------------------------------------------------------------------------------------- oname
def test_oname_swaps_two_tables_with_their_slots(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    report = job.saver.load(out, load_conf={"load": ["sparse", "sparse_opt"], "exclude": ["sparse_optim"],
                                            "oname": [{"user": "item"}, {"item": "user"}]})
    assert report.loaded["user"].source == "item" and report.loaded["item"].source == "user"
    assert report.loaded[f"user@{SLOT}"].source == f"item@{SLOT}"
    after = job_state(job)
    assert_table(after, "user", table(src, "item"))
    assert_table(after, "item", table(src, "user"))
    assert_dense(after, before)



def test_a_pattern_naming_only_a_renamed_source_selects_what_loads_from_it(tmp_path):
    """`exclude: ["user@*"]` with `oname: {"u": "user"}`, where the model has no `user`: the
    pattern names the source of `u`, so `u`'s slots stay out (they were loaded, silently, while
    patterns named model names only); `load: ["user"]` takes `u`."""
    class One(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.add_module(name, HashTable(4, name=name))

    src = One("user")
    opt = SparseAdagrad(src, lr=0.1)
    src.user(torch.arange(10)).sum().backward()
    opt.step()
    Saver(src, sparse_optim=opt, output_dir=str(tmp_path / "a")).save("ckpt_1")
    dst = One("u")
    saver = Saver(dst, sparse_optim=SparseAdagrad(dst, lr=0.1), output_dir=str(tmp_path / "t"))
    report = saver.load_model_bank([{"path": str(tmp_path / "a"), "oname": {"u": "user"}, "exclude": ["user@*"]}])
    assert "u" in report.loaded and f"u@{SLOT}" not in report.loaded and f"u@{SLOT}" in report.skipped
    assert len(dst.u) == 10 and float(dst.u.slot(SLOT)[:10].abs().sum()) == 0.0
    report = saver.load_model_bank([{"path": str(tmp_path / "a"), "oname": {"u": "user"}, "load": ["user"]}])
    assert sorted(report.loaded) == ["u"] and report.loaded["u"].source == "user"


def test_a_pattern_naming_a_model_name_keeps_to_the_model_side(tmp_path, saved):
    """With user and item swapped, `exclude: ["user@*"]` names the model's user@ slots (which load
    from item@), not item@'s slots whose source is user@."""
    out, _, src = saved
    job = live_job(tmp_path)
    report = job.saver.load(out, load_conf={"load": ["sparse", "sparse_opt"], "exclude": ["sparse_optim", "user@*"],
                                            "oname": [{"user": "item"}, {"item": "user"}]})
    assert sorted(report.loaded) == ["item", f"item@{SLOT}", "user"]
    assert report.loaded[f"item@{SLOT}"].source == f"user@{SLOT}"
    assert_table(job_state(job), "user", with_slot(table(src, "item"), SLOT_INIT))

def test_oname_renames_a_dense_prefix(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path, head="head")
    before = job_state(job)
    with pytest.raises(ConfigError):  # head.* are not in the checkpoint
        job.saver.load(out, load_conf={"load": ["dense"]})
    assert_jobs_equal(job_state(job), before)
    report = job.saver.load(out, load_conf={"load": ["dense"], "oname": [{"head.*": "mlp.*"}]})
    assert report.loaded["head.0.weight"].source == "mlp.0.weight"
    after = job_state(job)
    for n in DENSE:
        mine = n.replace("mlp.", "head.")
        assert same_bits(after["model"][mine], src["model"][n]), n
    assert_table(after, "user", table(before, "user"))


# --------------------------------------------------------------------------- hashtable_clear
def test_hashtable_clear_false_merges(tmp_path, saved):
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    job.saver.load(out, load_conf={"load": ["user*"], "hashtable_clear": False})
    after = job_state(job)
    live, ckpt = table(before, "user"), table(src, "user")
    assert set(live) - set(ckpt) and set(live) & set(ckpt), "test data must overlap partly"
    assert_table(after, "user", {**live, **ckpt})  # live-only ids survive, shared ids take the ckpt
    assert_table(after, "item", table(before, "item"))

    # Embedding only, without its slot: merged ids keep their live slot, new ids get the init value.
    job2 = live_job(tmp_path, name="live2")
    before2 = job_state(job2)
    job2.saver.load(out, load_conf={"load": ["user"], "hashtable_clear": False})
    live2 = table(before2, "user")
    expected = dict(live2)
    for i, (emb, slot) in ckpt.items():
        expected[i] = (emb, live2[i][1] if i in live2 else torch.full_like(slot, SLOT_INIT))
    assert_table(job_state(job2), "user", expected)


def _stepped_table_model(step, ids, steps_ago=0):
    """A model of one 4-dim table at table step `step`, whose `ids` were last looked up
    `steps_ago` steps before it (the rest of the ids at `step`)."""
    model = torch.nn.Module()
    model.user = HashTable(4, name="user")
    model.train()
    model.user.step = step - steps_ago
    model.user.lookup(torch.tensor(ids[:2], dtype=torch.int64), insert=True)
    model.user.step = step
    model.user.lookup(torch.tensor(ids[2:], dtype=torch.int64), insert=True)
    return model


def _ages(table):
    ids, rows = table.id_rows()
    last = table.row_meta(rows)["last_step"].reshape(-1)
    return {int(i): table.step - int(s) for i, s in zip(ids, last)}


def test_hashtable_clear_false_keeps_the_live_step_and_row_ages(tmp_path):
    """A merge keeps the live table's step and moves the merged rows' last_step into it, so their
    ages (what evict reads) are those of the source (floored at 0); into a table never stepped a
    merge takes the source's step as a restore does."""
    src = _stepped_table_model(100, [1, 2, 3, 4], steps_ago=30)  # ids 1, 2: age 30; 3, 4: age 0
    ckpt = Saver(src, output_dir=str(tmp_path / "src")).save("ckpt_1")
    live = _stepped_table_model(500, [4, 5, 6, 7], steps_ago=20)  # 4, 5: age 20; 6, 7: age 0
    Saver(live, output_dir=str(tmp_path / "live")).load(ckpt, direct_path=True,
                                                         load_conf={"hashtable_clear": False})
    assert live.user.step == 500
    assert _ages(live.user) == {1: 30, 2: 30, 3: 0, 4: 0, 5: 20, 6: 0, 7: 0}
    assert live.user.evict(older_than_steps=25) == 2  # the merged ids 1 and 2, as in their source

    early = _stepped_table_model(10, [7, 8])  # a live table at a step below the merged rows' ages:
    Saver(early, output_dir=str(tmp_path / "early")).load(ckpt, direct_path=True,  # floored at 0
                                                           load_conf={"hashtable_clear": False})
    assert early.user.step == 10
    assert _ages(early.user) == {1: 10, 2: 10, 3: 0, 4: 0, 7: 0, 8: 0}

    for clear in (True, False):  # into a table never stepped: the checkpoint's step, whatever the mode
        empty = torch.nn.Module()
        empty.user = HashTable(4, name="user")
        Saver(empty, output_dir=str(tmp_path / f"empty{clear}")).load(
            ckpt, direct_path=True, load_conf={"hashtable_clear": clear})
        assert empty.user.step == 100 and _ages(empty.user) == {1: 30, 2: 30, 3: 0, 4: 0}
    stepped = torch.nn.Module()  # empty but stepped (a rank whose shard holds no rows yet): its step
    stepped.user = HashTable(4, name="user")
    stepped.user.step = 7
    Saver(stepped, output_dir=str(tmp_path / "stepped")).load(ckpt, direct_path=True,
                                                              load_conf={"hashtable_clear": False})
    assert stepped.user.step == 7 and _ages(stepped.user) == {1: 7, 2: 7, 3: 0, 4: 0}


# ------------------------------------------------------------------------------- model bank
@pytest.fixture
def second(tmp_path):
    """Another committed checkpoint with different values (other seed, other data)."""
    out = str(tmp_path / "src2")
    job = make_job(out, seed=3)
    train(job.model, job.opts, 5, start=300)
    job.reader.offset = 55
    ckpt = job.saver.save("ckpt_5")
    return out, ckpt, job_state(job)


def test_model_bank_later_entry_wins(tmp_path, saved, second):
    out1, ckpt1, s1 = saved
    out2, ckpt2, s2 = second
    job = live_job(tmp_path)
    mgr = CheckpointManager(job.saver, 0)
    report = mgr.load_model_bank([{"path": out2, "load": ["*"], "exclude": ["global_step"]},
                                  {"path": ckpt1, "load": ["user*", "mlp.*"]}])
    assert report.loaded["user"].checkpoint == ckpt1 and report.loaded["item"].checkpoint == ckpt2
    assert report.loaded["mlp.0.weight"].checkpoint == ckpt1 and report.loaded["bn.weight"].checkpoint == ckpt2
    after = job_state(job)
    assert_table(after, "user", table(s1, "user"))  # exactly ckpt1's rows: no leftovers of ckpt2
    assert_table(after, "item", table(s2, "item"))
    assert_dense(after, s1, [n for n in DENSE if n.startswith("mlp.")])
    assert_dense(after, s2, [n for n in DENSE if n.startswith("bn.")])
    assert_obj_equal(after["dense_opt"], s2["dense_opt"])
    assert after["reader"] == 55

    # The other order: ckpt2's entry comes last and wins the user table.
    job2 = live_job(tmp_path, name="live2")
    job2.saver.load_model_bank([{"path": ckpt1, "load": ["user*", "mlp.*"]},
                                {"path": out2, "load": ["user*", "item*"]}])
    after2 = job_state(job2)
    assert_table(after2, "user", table(s2, "user"))
    assert_table(after2, "item", table(s2, "item"))
    assert_dense(after2, s1, [n for n in DENSE if n.startswith("mlp.")])


def test_model_bank_slot_only_entry_applies_to_the_table_an_earlier_entry_loaded(tmp_path, saved, second):
    """Entry 1 loads the user embedding (its slot starts at init); entry 2 loads only the slot from
    another checkpoint: it lands on the ids entry 1 loaded that entry 2's checkpoint has too."""
    out1, ckpt1, s1 = saved
    out2, ckpt2, s2 = second
    job = live_job(tmp_path)
    report = job.saver.load_model_bank([{"path": out1, "load": ["user"]},
                                        {"path": out2, "load": ["user@*"]}])
    assert report.loaded["user"].checkpoint == ckpt1
    assert report.loaded[f"user@{SLOT}"].checkpoint == ckpt2
    emb, slot = table(s1, "user"), table(s2, "user")
    assert set(emb) & set(slot) and set(emb) - set(slot), "test data must overlap partly"
    expected = {i: (e, slot[i][1] if i in slot else torch.full_like(s, SLOT_INIT)) for i, (e, s) in emb.items()}
    assert_table(job_state(job), "user", expected)


def test_model_bank_skip(tmp_path, saved, second):
    out1, ckpt1, s1 = saved
    out2, ckpt2, s2 = second
    job = live_job(tmp_path)
    report = job.saver.load_model_bank([{"path": out1, "skip": False, "load": ["item*"]},
                                        {"path": out2, "skip": True},
                                        {"path": str(tmp_path / "does_not_exist"), "skip": True}])
    assert report.checkpoints == [ckpt1]
    assert sorted(report.loaded) == ["item", f"item@{SLOT}"]
    assert_table(job_state(job), "item", table(s1, "item"))


def test_model_bank_entry_needs_a_path(tmp_path, saved):
    job = live_job(tmp_path)
    before = job_state(job)
    with pytest.raises(ConfigError):
        job.saver.load_model_bank([{"load": ["*"]}])
    assert_jobs_equal(job_state(job), before)


def test_path_output_dir_uses_latest_and_checkpoint_dir_is_itself(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=None)
    job.train(2)
    c2 = job.saver.save("ckpt_2")
    at_2 = job_state(job)
    job.train(2)
    c4 = job.saver.save("ckpt_4")
    at_4 = job_state(job)

    a = live_job(tmp_path, name="a")
    assert a.saver.load_by_config(out).checkpoints == [c4]
    assert_jobs_equal(job_state(a), at_4)
    b = live_job(tmp_path, name="b")
    assert b.saver.load_by_config(c2).checkpoints == [c2]
    assert_jobs_equal(job_state(b), at_2)
    c = live_job(tmp_path, name="c")
    assert c.saver.load_model_bank([{"path": c2}]).checkpoints == [c2]
    assert_jobs_equal(job_state(c), at_2)
    d = live_job(tmp_path, name="d")
    assert d.saver.load(out, ckpt_id="ckpt_2").checkpoints == [c2]
    assert_jobs_equal(job_state(d), at_2)


def test_an_entry_that_selects_nothing_is_refused_unless_ignore_error(tmp_path, saved):
    """load: [], exclude: ["*"] or a load its exclude cancels would succeed having loaded nothing."""
    out, _, src = saved
    job = live_job(tmp_path)
    before = job_state(job)
    for conf in ({"load": []}, {"exclude": ["*"]}, {"load": ["sparse"], "exclude": ["sparse"]}):
        with pytest.raises(ConfigError, match="selects nothing of the model to load"):
            job.saver.load(out, load_conf=conf)
        with pytest.raises(ConfigError, match="selects nothing of the model to load"):
            job.saver.load_model_bank([{"path": out, **conf}])
    assert_jobs_equal(job_state(job), before)
    report = job.saver.load(out, load_conf={"exclude": ["*"], "ignore_error": True})
    assert report.loaded == {} and "user" in report.skipped


def test_manager_restore_takes_a_load_conf(tmp_path, saved):
    """restore(load_conf=...) selects what to load as Saver.load does (e.g. no io states when the
    number of workers changed); a 'path' there is refused before anything loads: a restore reads
    the manager's own output dir."""
    out, ckpt, state = saved
    job = make_job(out)
    job.reader.offset = 123
    before = job_state(job)
    mgr = CheckpointManager(job.saver, 0)
    with pytest.raises(UsageError, match="drop 'path'"):
        mgr.restore(load_conf={"path": ckpt})
    assert_obj_equal(job_state(job), before)
    assert mgr.restore(load_conf={"exclude": ["io_state"]}) == 8
    after = job_state(job)
    assert after["reader"] == 123  # excluded: left as it was
    assert_table(after, "user", table(state, "user"))
    assert_table(after, "item", table(state, "item"))
    assert_dense(after, state, DENSE)
    assert mgr.last_report.checkpoints == [ckpt]

