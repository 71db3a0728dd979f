"""recsave.TableLike: a table that is no HashTable is saved, loaded and bank-loaded like one."""
import pytest
import torch
from tablelike_table import TensorTable

import recsave
from recsave import HashTable, Saver, TableLike
from recsave.errors import UsageError
from recsave.format import read_index


class TTModel(torch.nn.Module):
    def __init__(self, table=None):
        super().__init__()
        self.tt = TensorTable(8) if table is None else table
        torch.manual_seed(1)
        self.mlp = torch.nn.Linear(8, 2)


def _filled(n=300, table=None):
    model = TTModel(table)
    ids = torch.randperm(n * 10)[:n].to(torch.int64) * 7 - 1000
    model.tt.load_rows(ids, torch.rand(n, 8), {"acc": torch.rand(n, 8)})
    with torch.no_grad():
        model.mlp.weight.add_(1.0)
    return model


def _hashtable_state(table):
    ids, values, slots = table.export()
    order = torch.argsort(ids)
    out = {"ids": ids[order], "weight": values[order]}
    out.update({s: v[order] for s, v in slots.items()})
    return out


def test_hashtable_and_the_test_table_are_tablelike():
    assert isinstance(HashTable(4), TableLike) and isinstance(TensorTable(4), TableLike)
    assert not isinstance(torch.nn.Embedding(3, 4), TableLike)
    assert recsave.TableLike is TableLike


def test_a_tablelike_table_saves_and_loads_like_a_hashtable(tmp_path):
    model = _filled()
    Saver(model, output_dir=str(tmp_path)).save("ckpt_1")
    index = read_index(str(tmp_path / "ckpt_1"))
    assert set(index.meta.tables) == {"tt"} and index.meta.tables["tt"].slots == ("acc",)
    assert index.meta.tables["tt"].rows == 300
    assert set(index.meta.dense) == {"mlp.weight", "mlp.bias"}  # the table's tensors are not dense

    fresh = TTModel()
    report = Saver(fresh, output_dir=str(tmp_path)).load()
    assert set(report.loaded) == {"tt", "tt@acc", "mlp.weight", "mlp.bias"}
    for k, v in model.tt.state().items():
        assert torch.equal(fresh.tt.state()[k], v), k
    assert torch.equal(fresh.mlp.weight, model.mlp.weight)

    # Bank-load it into a HashTable model, and a HashTable checkpoint back into the test table.
    hmodel = TTModel(table=HashTable(8))
    hmodel.tt.add_slot("acc")
    Saver(hmodel, output_dir=str(tmp_path / "h")).load_model_bank([{"path": str(tmp_path)}])
    for k, v in model.tt.state().items():
        assert torch.equal(_hashtable_state(hmodel.tt)[k], v), k
    Saver(hmodel, output_dir=str(tmp_path / "h")).save("ckpt_2")
    back = TTModel()
    plan = Saver(back, output_dir=str(tmp_path / "b")).plan_model_bank([{"path": str(tmp_path / "h")}])
    assert plan.items["tt"].rows == 300 and len(back.tt) == 0
    Saver(back, output_dir=str(tmp_path / "b")).execute_plan(plan)
    for k, v in model.tt.state().items():
        assert torch.equal(back.tt.state()[k], v), k


class Stateful:
    def __init__(self, fail=False):
        self.fail = fail

    def state_dict(self):
        return {"v": 1}

    def load_state_dict(self, state):
        if self.fail:
            raise RuntimeError("injected")


def test_a_failed_load_leaves_the_tablelike_table_as_it_was(tmp_path):
    model = _filled()
    saver = Saver(model, output_dir=str(tmp_path))
    saver.register_for_checkpointing("x", Stateful())
    saver.save("ckpt_1")
    other = TTModel(table=TensorTable(8))
    other.tt.load_rows(torch.tensor([1, 2]), torch.ones(2, 8))
    before = other.tt.state()
    loader = Saver(other, output_dir=str(tmp_path))
    loader.register_for_checkpointing("x", Stateful(fail=True))  # fails after the table is swapped in
    with pytest.raises(RuntimeError, match="injected"):
        loader.load()
    assert set(other.tt.state()) == set(before)
    for k, v in before.items():
        assert torch.equal(other.tt.state()[k], v), k


def test_a_flagged_module_missing_methods_is_refused(tmp_path):
    class Half(torch.nn.Module):
        __recsave_table__ = True
        embedding_dim = 4

    model = torch.nn.Sequential(Half())
    with pytest.raises(UsageError, match=r"Half sets __recsave_table__ but lacks \['table_name'"):
        Saver(model, output_dir=str(tmp_path)).save("ckpt_1")


class LiveIdsTable(TensorTable):
    """Hands out its live id buffer (the protocol does not ask for a copy)."""

    def id_rows(self):
        return self.ids, torch.arange(len(self), dtype=torch.int64)


@pytest.mark.parametrize("table", [TensorTable, LiveIdsTable])
def test_async_save_of_a_tablelike_table_holds_the_state_at_the_call(tmp_path, monkeypatch, table):
    """Changes after the call (rows, and an id rewritten in place while the write is held before
    it reads the ids) never reach the checkpoint: the snapshot copies what id_rows() gives."""
    import threading

    from recsave.save import pipeline
    model = _filled(table=table(8))
    expected = {k: v.clone() for k, v in model.tt.state().items()}
    saver = Saver(model, output_dir=str(tmp_path))
    release, real = threading.Event(), pipeline.bucket_layout

    def held(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)
    monkeypatch.setattr(pipeline, "bucket_layout", held)
    _, write = saver.async_save("ckpt_1")
    model.tt.weight.add_(1.0)  # in place, after the snapshot: never in the checkpoint
    model.tt.slot_acc.mul_(2.0)
    model.tt.ids[3] = 10 ** 12  # a slot reused in place for another id
    release.set()
    write.result(timeout=60)
    saver.close()
    fresh = TTModel(table(8))
    Saver(fresh, output_dir=str(tmp_path)).load()
    assert set(fresh.tt.state()) == set(expected)
    for k, v in expected.items():
        assert torch.equal(fresh.tt.state()[k], v), k
