"""torch.save files and DCP directories as model-bank sources (recsave/load/torch_sources.py)."""
import pytest
import torch
import torch.distributed.checkpoint as dcp

from recsave import HashTable, Saver
from recsave.errors import ConfigError


class DenseModel(torch.nn.Module):
    """What a plain PyTorch job trains: an nn.Embedding and a Linear."""

    def __init__(self, n=10_000, dim=32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(n, dim)
        self.mlp = torch.nn.Linear(dim, 4)


class HashModel(torch.nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.emb = HashTable(dim, seed=3)
        self.mlp = torch.nn.Linear(dim, 4)


def _table(table):
    ids, values, slots = table.export()
    order = torch.argsort(ids)
    return ids[order], values[order], {s: v[order] for s, v in slots.items()}


def _write(kind, state, path):
    if kind == "torch":
        torch.save(state, path)
    else:
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return str(path)


@pytest.mark.parametrize("kind", ["torch", "dcp"])
def test_nn_embedding_state_warm_starts_a_hashtable_model_exactly(tmp_path, kind):
    src = DenseModel()
    path = _write(kind, src.state_dict(), tmp_path / "src")
    model = HashModel()
    saver = Saver(model, output_dir=str(tmp_path / "out"))
    plan = saver.plan_model_bank([{"path": path}])
    assert plan.items["emb"].rows == 10_000 and plan.items["emb"].category == "sparse"
    assert plan.items["emb"].nbytes == 10_000 * 32 * 4
    assert set(plan.items) == {"emb", "mlp.weight", "mlp.bias"}
    assert plan.unexpected == []  # emb.weight is the table: not reported on its own
    assert len(model.emb) == 0  # a dry run
    report = saver.load_model_bank([{"path": path}])
    assert report.loaded["emb"].rows == 10_000
    ids, values, _ = _table(model.emb)
    assert torch.equal(ids, torch.arange(10_000))
    assert torch.equal(values, src.emb.weight.detach())
    assert torch.equal(model.mlp.weight, src.mlp.weight) and torch.equal(model.mlp.bias, src.mlp.bias)


@pytest.mark.parametrize("kind", ["torch", "dcp"])
def test_a_bare_2d_tensor_named_like_the_table_loads_as_that_table(tmp_path, kind):
    """{"emb": [N, dim]}: the key is both a dense name and the table's name; the model's table
    takes it as a table (ids 0..N-1), reported once."""
    weight = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    path = _write(kind, {"emb": weight}, tmp_path / "src")
    model = HashModel()
    report = Saver(model, output_dir=str(tmp_path / "out")).load_model_bank(
        [{"path": path, "exclude": ["mlp.*"]}])
    assert sorted(report.loaded) == ["emb"] and report.loaded["emb"].category == "sparse"
    assert report.missing == [] and report.unexpected == []
    ids, values, _ = _table(model.emb)
    assert torch.equal(ids, torch.arange(6)) and torch.equal(values, weight)


@pytest.mark.parametrize("kind", ["torch", "dcp"])
def test_ids_and_slots_beside_the_weight_are_used(tmp_path, kind):
    src = DenseModel(n=500, dim=8)
    state = dict(src.state_dict())
    ids = torch.randperm(500, dtype=torch.int64) * 7919 + 11
    state["emb.ids"] = ids
    state["emb.adagrad_acc"] = torch.rand(500, 8)
    path = _write(kind, state, tmp_path / "src")
    model = HashModel(dim=8)
    model.emb.add_slot("adagrad_acc", 0.1)
    saver = Saver(model, output_dir=str(tmp_path / "out"))
    report = saver.load_model_bank([{"path": path}])
    assert set(report.loaded) == {"emb", "emb@adagrad_acc", "mlp.weight", "mlp.bias"}
    got_ids, values, slots = _table(model.emb)
    order = torch.argsort(ids)
    assert torch.equal(got_ids, ids[order])
    assert torch.equal(values, state["emb.weight"][order])
    assert torch.equal(slots["adagrad_acc"], state["emb.adagrad_acc"][order])


def test_unused_tensors_are_reported_once_by_their_key(tmp_path):
    src = DenseModel(n=50, dim=8)
    state = dict(src.state_dict())
    state["other.weight"] = torch.rand(7, 8)
    state["other.acc"] = torch.rand(7, 8)
    state["step"] = torch.tensor(3)
    torch.save(state, tmp_path / "s.pt")
    saver = Saver(HashModel(dim=8), output_dir=str(tmp_path / "out"))
    plan = saver.plan_model_bank([{"path": str(tmp_path / "s.pt")}])
    assert sorted(plan.unexpected) == ["other.acc", "other.weight", "step"]
    plan = saver.plan_model_bank([{"path": str(tmp_path / "s.pt"), "load": ["sparse"]}])
    assert plan.unexpected == ["other"] and set(plan.items) == {"emb"}


def test_a_legacy_torch_save_file_loads_too(tmp_path):
    src = DenseModel(n=50, dim=8)
    path = tmp_path / "legacy.pt"
    torch.save(src.state_dict(), path, _use_new_zipfile_serialization=False)
    model = HashModel(dim=8)
    Saver(model, output_dir=str(tmp_path / "out")).load_model_bank([{"path": str(path)}])
    assert torch.equal(_table(model.emb)[1], src.emb.weight.detach())
    assert torch.equal(model.mlp.weight, src.mlp.weight)


def test_oname_maps_a_nested_state_and_to_dcp_state_dict_form_loads(tmp_path):
    src = DenseModel(n=100, dim=8)
    path = _write("torch", {"model": src.state_dict(), "epoch": 3}, tmp_path / "nested.pt")
    model = HashModel(dim=8)
    saver = Saver(model, output_dir=str(tmp_path / "out"))
    saver.load_model_bank([{"path": path, "oname": [{"*": "model.*"}]}])
    assert torch.equal(_table(model.emb)[1], src.emb.weight.detach())

    import recsave
    other = HashModel(dim=8)
    other.emb.load_rows(torch.tensor([5, 9, 1]), torch.rand(3, 8))
    dcp_path = _write("dcp", recsave.to_dcp_state_dict(other), tmp_path / "dcp")
    fresh = HashModel(dim=8)
    Saver(fresh, output_dir=str(tmp_path / "out2")).load_model_bank([{"path": dcp_path}])
    for a, b in zip(_table(fresh.emb)[:2], _table(other.emb)[:2]):
        assert torch.equal(a, b)


def test_bad_ids_and_files_that_are_no_source_raise_config_error(tmp_path):
    model = HashModel(dim=8)
    saver = Saver(model, output_dir=str(tmp_path / "out"))
    bad = tmp_path / "bad.pt"
    torch.save({"emb.weight": torch.rand(4, 8), "emb.ids": torch.arange(3)}, bad)
    with pytest.raises(ConfigError, match=r"emb\.ids must be a 1-D int64 tensor of 4 ids"):
        saver.plan_model_bank([{"path": str(bad)}])
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a torch file at all")
    with pytest.raises(ConfigError, match="junk.bin: not a loadable source.*torch.save file"):
        saver.plan_model_bank([{"path": str(junk)}])
    table = tmp_path / "table.pt"  # a pickled HashTable cannot be read with weights_only=True
    torch.save({"emb": HashModel(dim=8).emb}, table)
    with pytest.raises(ConfigError, match="table.pt: not a loadable source"):
        saver.plan_model_bank([{"path": str(table)}])
    assert len(model.emb) == 0


@pytest.mark.parametrize("kind", ["torch", "dcp"])
def test_a_dynamic_entry_reloads_when_the_pytorch_source_is_rewritten(tmp_path, kind):
    import shutil

    from recsave import CheckpointManager

    src = DenseModel(n=40, dim=8)
    path = _write(kind, src.state_dict(), tmp_path / "src")
    model = HashModel(dim=8)
    mgr = CheckpointManager(Saver(model, output_dir=str(tmp_path / "out")), 100)
    mgr.load_model_bank([{"path": path, "load": ["emb"], "is_dynamic": True}])
    assert mgr.update_model_bank() is None
    with torch.no_grad():
        src.emb.weight.add_(1.0)
    if kind == "dcp":
        shutil.rmtree(path)
    else:
        (tmp_path / "src").unlink()
    _write(kind, {**src.state_dict(), "emb.extra": torch.zeros(40, 8)}, tmp_path / "src")  # a new size too
    report = mgr.update_model_bank()
    assert report is not None and set(report.loaded) == {"emb"}
    assert torch.equal(_table(model.emb)[1], src.emb.weight.detach())


@pytest.mark.parametrize("kind", ["torch", "parquet"])
@pytest.mark.parametrize("clear", [True, False])
def test_a_source_listing_an_id_twice_is_refused(tmp_path, kind, clear):
    """Ids repeated in a torch.save file or across Parquet files: which row would win is
    arbitrary, so the load raises ConfigError naming the table and leaves the model as it was."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "torch":
        source = str(tmp_path / "dup.pt")
        torch.save({"t.weight": torch.arange(12.0).reshape(3, 4), "t.ids": torch.tensor([5, 6, 5])}, source)
    else:
        (tmp_path / "pq" / "t").mkdir(parents=True)
        source = str(tmp_path / "pq" / "t")
        for name, ids in (("a", [1, 2, 3]), ("b", [3, 4])):
            emb = pa.array(torch.ones(len(ids) * 4).numpy())
            pq.write_table(pa.table({"id": pa.array(ids, pa.int64()),
                                     "embedding": pa.FixedSizeListArray.from_arrays(emb, 4)}),
                           f"{source}/{name}.parquet")
    model = torch.nn.Module()
    model.t = HashTable(4, name="t")
    model.t.load_rows(torch.tensor([3, 9]), torch.full((2, 4), 7.0))
    with pytest.raises(ConfigError, match=r"table 't' lists 1 id\(s\) more than once \(e\.g\. \[[35]\]\)"):
        Saver(model, output_dir=str(tmp_path / "out")).load_model_bank(
            [{"path": source, "load": ["sparse"], "hashtable_clear": clear}])
    ids, values, _ = model.t.export()
    assert sorted(ids.tolist()) == [3, 9] and bool((values == 7.0).all())


@pytest.mark.parametrize("kind", ["torch", "dcp"])
@pytest.mark.parametrize("value", [9, torch.tensor(9)])
def test_a_managers_global_step_is_the_sources_step_not_a_dense_entry(tmp_path, kind, value):
    """`_recsave.extra.global_step.global_step` (where `convert` writes a CheckpointManager's step;
    an int, or a 0-d integer tensor, nested or dotted) is the source's step: a load reports it,
    and it is neither a dense entry reported unexpected nor a value left out."""
    from recsave.load.sources import open_source
    model = DenseModel(n=20, dim=4)
    state = {**model.state_dict(), "_recsave": {"extra": {"global_step": {"global_step": value}}}}
    path = _write(kind, state, tmp_path / "src")
    src = open_source(path)
    assert src.step == 9
    assert "_recsave.extra.global_step.global_step" not in src.contents.dense and src.not_tensors == {}
    report = Saver(HashModel(dim=4), output_dir=str(tmp_path / "out")).load_model_bank([{"path": path}])
    assert report.step == 9 and report.unexpected == []
