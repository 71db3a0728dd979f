"""Loads that reshape or partly reload tables, found losing data silently by a search of the load
side: a padded / truncated / cast restore must not become a delta baseline (a delta of it would mix
shapes or dtypes with its parent: unloadable, or values the model never held); a bank update that
reloads a table must reload the slots other entries won too; padding under dtype_policy cast takes
the table's dtype, not the checkpoint's rounding."""
from __future__ import annotations

import torch
from helpers import make_job, tables_of

from recsave import CheckpointManager, HashTable, Saver


def test_a_padded_restore_is_no_delta_baseline(tmp_path):
    out = str(tmp_path / "out")
    job = make_job(out)
    job.train(5)
    job.saver.save("ckpt_5")
    job.saver.close()
    wider = make_job(out, item_dim=12)
    report = wider.saver.load(load_conf={"dim_policy": "pad", "exclude": ["dense", "dense_opt"]})
    assert "item" in report.loaded
    wider.train(3)
    wider.saver.save("ckpt_8", incremental=True)
    assert wider.saver.last_save_kind == "full"  # not a delta of a checkpoint of another width
    expect = {n: t.export(torch.sort(t.ids()).values) for n, t in tables_of(wider.model).items()}
    wider.saver.close()
    again = make_job(out, item_dim=12)
    again.saver.load(ckpt_id="ckpt_8")  # the newest checkpoint restores
    for name, table in tables_of(again.model).items():
        ids, values, slots = expect[name]
        _, got, got_slots = table.export(ids)
        assert torch.equal(got, values) and all(torch.equal(got_slots[s], slots[s]) for s in slots)
    again.saver.close()


def _table_model(dtype: torch.dtype, dim: int, seed: int) -> torch.nn.Module:
    model = torch.nn.Module()
    model.t = HashTable(dim, name="t", dtype=dtype, seed=seed)
    model.t.add_slot("acc", 0.25)
    return model


def test_a_cast_restore_is_no_delta_baseline(tmp_path):
    out = str(tmp_path / "out")
    src = _table_model(torch.float32, 4, 1)
    src.t.lookup(torch.arange(50), insert=True)
    Saver(src, output_dir=out).save("ckpt_1")
    low = _table_model(torch.bfloat16, 4, 1)
    saver = Saver(low, output_dir=out)
    saver.load(load_conf={"dtype_policy": "cast"})
    with torch.no_grad():
        low.t.weight[:5] += 1.0
    low.t.mark_changed(torch.arange(5))
    saver.save("ckpt_2", incremental=True)
    assert saver.last_save_kind == "full"
    saver.close()


def test_padding_under_cast_takes_the_tables_dtype(tmp_path):
    out = str(tmp_path / "out")
    src = _table_model(torch.bfloat16, 4, 1)
    ids = torch.arange(40)
    src.t.lookup(ids, insert=True)
    Saver(src, output_dir=out).save("ckpt_1")
    wide = _table_model(torch.float32, 6, 1)
    Saver(wide, output_dir=out).load(load_conf={"dtype_policy": "cast", "dim_policy": "pad"})
    values, slots = wide.t.export(ids)[1:]
    assert torch.equal(values[:, :4], src.t.export(ids)[1].float())
    assert torch.equal(values[:, 4:], wide.t.initial_rows(ids)[:, 4:])  # exact fp32, not bf16-rounded
    assert torch.equal(slots["acc"][:, 4:], torch.full((40, 2), 0.25))


def test_a_bank_update_reloads_the_slots_of_the_tables_it_reloads(tmp_path):
    def filled(seed: int) -> torch.nn.Module:
        model = _table_model(torch.float32, 4, 0)
        model.t.lookup(torch.arange(10), insert=True)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            model.t.weight[:] = torch.rand(model.t.weight.shape, generator=g)
            model.t.slot("acc")[:] = torch.rand(model.t.weight.shape, generator=g)
        return model
    a, b = filled(1), filled(2)
    saver_a = Saver(a, output_dir=str(tmp_path / "a"))
    saver_a.save("ckpt_1")
    Saver(b, output_dir=str(tmp_path / "b")).save("ckpt_1")
    model = _table_model(torch.float32, 4, 0)
    manager = CheckpointManager(Saver(model, output_dir=str(tmp_path / "job")), 0)
    manager.load_model_bank([{"path": str(tmp_path / "a"), "is_dynamic": True},
                             {"path": str(tmp_path / "b"), "load": ["t@acc"]}])
    ids = torch.arange(10)
    b_acc = b.t.export(ids)[2]["acc"]
    assert torch.equal(model.t.export(ids)[2]["acc"], b_acc)
    with torch.no_grad():
        a.t.weight[:] += 1.0
    saver_a.save("ckpt_2")  # the dynamic entry has a newer checkpoint
    report = manager.update_model_bank()
    assert "t" in report.loaded
    assert torch.equal(model.t.export(ids)[1], a.t.export(ids)[1])  # the table from the new checkpoint
    assert torch.equal(model.t.export(ids)[2]["acc"], b_acc)  # its slot still from the static entry


def test_a_bank_update_that_merges_a_table_keeps_its_trained_slots(tmp_path):
    """A merge (hashtable_clear=False) keeps the live rows and their slots: reloading the static
    entry's slot too would revert optimizer state trained since the warm start."""
    def filled(seed: int, ids: torch.Tensor) -> torch.nn.Module:
        model = _table_model(torch.float32, 4, 0)
        model.t.lookup(ids, insert=True)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            model.t.weight[:] = torch.rand(model.t.weight.shape, generator=g)
            model.t.slot("acc")[:] = torch.rand(model.t.weight.shape, generator=g)
        return model
    ids = torch.arange(10)
    a, b = filled(1, ids), filled(2, ids)
    saver_a = Saver(a, output_dir=str(tmp_path / "a"), max_keep=None)
    saver_a.save("ckpt_1")
    Saver(b, output_dir=str(tmp_path / "b")).save("ckpt_1")
    model = _table_model(torch.float32, 4, 0)
    manager = CheckpointManager(Saver(model, output_dir=str(tmp_path / "job")), 0)
    manager.load_model_bank([{"path": str(tmp_path / "b"), "load": ["t@acc"]},
                             {"path": str(tmp_path / "a"), "load": ["t"], "is_dynamic": True,
                              "hashtable_clear": False}])
    with torch.no_grad():  # training changes the optimizer state
        model.t.slot("acc")[model.t.lookup(ids, insert=False)] = 99.0
    a.t.lookup(torch.tensor([100]), insert=True)
    saver_a.save("ckpt_2")  # the dynamic entry has a newer checkpoint
    report = manager.update_model_bank()
    assert sorted(report.loaded) == ["t"]
    assert torch.equal(model.t.export(ids)[1], a.t.export(ids)[1])  # rows merged from the new checkpoint
    assert torch.equal(model.t.export(ids)[2]["acc"], torch.full((10, 4), 99.0))  # trained slots kept


def test_execute_plan_only_a_table_keeps_its_slots(tmp_path):
    src = _table_model(torch.float32, 4, 0)
    src.t.lookup(torch.arange(10), insert=True)
    with torch.no_grad():
        src.t.slot("acc")[:] = 3.0
    Saver(src, output_dir=str(tmp_path / "src")).save("ckpt_1")
    model = _table_model(torch.float32, 4, 0)
    saver = Saver(model, output_dir=str(tmp_path / "job"))
    plan = saver.plan_model_bank([{"path": str(tmp_path / "src")}])
    saver.execute_plan(plan)
    saver.execute_plan(plan, only={"t"})
    assert torch.equal(model.t.export(torch.arange(10))[2]["acc"], torch.full((10, 4), 3.0))


def test_a_slot_of_another_dtype_needs_dtype_policy_cast(tmp_path):
    """torch.save and Parquet sources may hold optimizer slots of another dtype than their
    embedding: the slot's own dtype is checked against the model's (silently rounding a float64
    slot into a float32 table is what dtype_policy='error' exists to refuse)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    from recsave import ShapeMismatchError

    ids = torch.tensor([1, 2, 3])
    emb = torch.randn(3, 4)
    acc = torch.full((3, 4), 1.0 + 2.0 ** -40, dtype=torch.float64)  # not a float32 value
    pt = str(tmp_path / "t.pt")
    torch.save({"t.weight": emb, "t.ids": ids, "t.acc": acc}, pt)
    pq_dir = tmp_path / "pq" / "t"
    pq_dir.mkdir(parents=True)
    pq.write_table(pa.table({"id": pa.array(ids.numpy()),
                             "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1).numpy()), 4),
                             "acc": pa.FixedSizeListArray.from_arrays(pa.array(acc.reshape(-1).numpy()), 4)}),
                   str(pq_dir / "part-0.parquet"))
    for source in (pt, str(pq_dir)):
        model = _table_model(torch.float32, 4, 1)
        saver = Saver(model, output_dir=str(tmp_path / "out"))
        with pytest.raises(ShapeMismatchError, match=r"slot 't@acc' is float64 but the model's 't@acc' is float32"):
            saver.load(source, load_conf={"load": ["sparse", "sparse_opt"]})
        assert len(model.t) == 0  # refused before anything loaded
        saver.load(source, load_conf={"load": ["sparse", "sparse_opt"], "dtype_policy": "cast"})
        _, values, slots = model.t.export(ids)
        assert torch.equal(values, emb) and torch.equal(slots["acc"], acc.float())
        saver.close()
