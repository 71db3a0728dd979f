"""Names that would overwrite or shadow each other in a checkpoint are refused with UsageError before
anything is written or loaded (load/contents.py check_names), instead of one of the two things
being skipped silently: a table and a dense key / extra / io state of one name, a name shaped like a
table's column, a table name with '@', a slot named like a checkpoint column. And two model tables
may load one checkpoint table (oname): both get its rows."""
from __future__ import annotations

import os

import pytest
import torch
from helpers import listing

from recsave import HashTable, Saver
from recsave.errors import UsageError
from recsave.tables.optim import SparseAdagrad
from recsave.tables.rows import RESERVED_COLUMNS


def _filled(table: HashTable, n: int, salt: float) -> HashTable:
    ids = torch.arange(n) * 7 + int(salt)
    table.load_rows(ids, torch.full((n, table.embedding_dim), salt) + torch.arange(n).unsqueeze(1))
    return table


class _TableAndParam(torch.nn.Module):
    def __init__(self, table_name: str, param_name: str):
        super().__init__()
        self.t = _filled(HashTable(4, name=table_name), 5, 1.0)
        self.register_parameter(param_name, torch.nn.Parameter(torch.ones(3)))


@pytest.mark.parametrize("table_name,param_name,message", [
    ("w", "w", "'w' is both a table and a dense state_dict key"),
    ("t", "t@acc", "named like a column of table 't'"),
])
def test_a_table_and_a_dense_key_of_one_name_are_refused_before_writing(tmp_path, table_name, param_name, message):
    out = str(tmp_path / "out")
    saver = Saver(_TableAndParam(table_name, param_name), output_dir=out)
    for call in (lambda: saver.save("ckpt_1"), lambda: saver.async_save("ckpt_1"), saver.prepare_async,
                 lambda: saver.load(out)):
        with pytest.raises(UsageError, match=message):
            call()
    assert not os.path.exists(out) or listing(out) == []  # nothing written
    saver.close()


def test_a_table_named_like_the_sparse_optimizer_is_refused(tmp_path):
    model = torch.nn.Module()
    model.t = _filled(HashTable(4, name="sparse_optim"), 5, 1.0)
    saver = Saver(model, sparse_optim=SparseAdagrad(model, lr=0.1), output_dir=str(tmp_path / "out"))
    with pytest.raises(UsageError, match="'sparse_optim' is both a table and a registered extra"):
        saver.save("ckpt_1")
    saver.close()


def test_an_io_state_registered_before_a_table_of_its_name_is_refused(tmp_path):
    class Reader:
        def dump_io_state(self):
            return {"offset": 1}

        def load_io_state(self, state):
            pass
    model = torch.nn.Module()
    saver = Saver(model, output_dir=str(tmp_path / "out"))
    saver.register_io_state("emb", Reader())  # no table "emb" yet: registration cannot know
    model.emb = _filled(HashTable(4, name="emb"), 5, 1.0)
    with pytest.raises(UsageError, match="'emb' is both a table and an io state"):
        saver.save("ckpt_1")
    saver.close()


def test_an_unnamed_table_whose_module_path_has_an_at_sign_is_refused(tmp_path):
    model = torch.nn.Module()
    model.add_module("a@b", _filled(HashTable(4), 5, 1.0))
    saver = Saver(model, output_dir=str(tmp_path / "out"))
    with pytest.raises(UsageError, match="table name 'a@b' contains '@'"):
        saver.save("ckpt_1")
    saver.close()


@pytest.mark.parametrize("slot", RESERVED_COLUMNS)
def test_slots_named_like_a_checkpoint_column_are_refused(slot):
    table = HashTable(4, name="t")
    with pytest.raises(UsageError, match="reserved or invalid"):
        table.add_slot(slot)
    assert table.slot_names() == []


def test_two_model_tables_load_one_checkpoint_table(tmp_path):
    model = torch.nn.Module()
    model.user = _filled(HashTable(4, name="user", seed=1), 20, 1.0)
    model.item = _filled(HashTable(4, name="item", seed=2), 30, 100.0)
    out = str(tmp_path / "out")
    Saver(model, output_dir=out).save("ckpt_1")
    want_ids = torch.sort(model.item.ids()).values
    _, want_rows, want_slots = model.item.export(want_ids)
    want_meta = model.item.row_meta(model.item.lookup(want_ids, insert=False))
    fresh = torch.nn.Module()
    fresh.user = HashTable(4, name="user", seed=5)
    fresh.item = HashTable(4, name="item", seed=6)
    report = Saver(fresh, output_dir=out).load(load_conf={"oname": {"user": "item"}})
    assert report.loaded["user"].source == report.loaded["item"].source == "item"
    for table in (fresh.user, fresh.item):  # both hold the checkpoint's item rows, bit for bit
        assert torch.equal(torch.sort(table.ids()).values, want_ids)
        _, rows, slots = table.export(want_ids)
        assert torch.equal(rows, want_rows) and slots.keys() == want_slots.keys()
        meta = table.row_meta(table.lookup(want_ids, insert=False))
        assert all(torch.equal(meta[m], want_meta[m]) for m in want_meta)


def test_execute_plan_checks_the_model_again(tmp_path):
    """A plan made before the model changed: execute_plan refuses names that now clash (a table and
    a parameter both 'w') instead of loading one of them silently."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t = HashTable(4, name="w")
            self.p = torch.nn.Parameter(torch.ones(3))

    src = Model()
    src.t.load_rows(torch.arange(5), torch.full((5, 4), 7.0))
    Saver(src, output_dir=str(tmp_path / "src")).save("ckpt_1")
    model = Model()
    saver = Saver(model, output_dir=str(tmp_path / "out"))
    plan = saver.plan_model_bank([{"path": str(tmp_path / "src")}])
    model.register_parameter("w", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(UsageError, match="both a table and a dense"):
        saver.execute_plan(plan)
    assert len(model.t) == 0  # nothing loaded
