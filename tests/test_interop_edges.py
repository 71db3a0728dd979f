"""Interop and export paths at their edges: unusual slot names, empty selections, sources
written again while a load reads them, numpy scalars in extras, dense embeddings through a
convert round trip, and serving dtypes that cannot hold a value."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from helpers import same_bits, table_state

import recsave
from recsave import HashTable, Saver
from recsave.tools.convert import convert


class OneTable(torch.nn.Module):
    def __init__(self, dim: int = 4, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.user = HashTable(dim, name="user", dtype=dtype)


def _saved(tmp_path, slot: str) -> tuple:
    model = OneTable()
    model.user.add_slot(slot, 0.5)
    g = torch.Generator().manual_seed(0)
    model.user.load_rows(torch.tensor([0, -1, 2**63 - 1, -2**63, 7]), torch.randn(5, 4, generator=g),
                         {slot: torch.rand(5, 4, generator=g)})
    return model, Saver(model, output_dir=str(tmp_path / "out")).save("ckpt_1")


@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_a_slot_name_with_a_dot_survives_convert_round_trip(tmp_path, to):
    """add_slot accepts "acc.1"; convert writes it as `user.acc.1` beside `user.ids`. Reading that
    back, the slot became a dense entry `user.acc.1`: the converted checkpoint's table had no slot
    (no warning), and a direct load said the source lacked `user@acc.1`."""
    model, ckpt = _saved(tmp_path, "acc.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flat = convert(ckpt, str(tmp_path / to), to)
        back = convert(flat, str(tmp_path / "back"), "recsave")
    described = recsave.describe(back)
    assert described["tables"]["user"]["slots"] == ["acc.1"]
    assert described["dense"] == []
    fresh = OneTable()
    fresh.user.add_slot("acc.1", 0.0)
    Saver(fresh, output_dir=str(tmp_path / "load")).load(flat, direct_path=True)
    want, got = table_state(model.user), table_state(fresh.user)
    assert sorted(got) == sorted(want) == ["@acc.1", "@embedding", "@id"]
    assert all(same_bits(got[k], want[k]) for k in want)


def test_a_submodules_tensors_under_a_table_are_no_dotted_slots():
    """The dotted slot names above are taken only where nothing else could own them: a
    submodule's weight (beside its bias, or alone) or another table's stay what they were."""
    from recsave.load.torch_sources import tables_of

    f32, i64 = torch.float32, torch.int64
    meta = {"x.weight": ((5, 4), f32), "x.ids": ((5,), i64), "x.acc.1": ((5, 4), f32),
            "x.proj.weight": ((5, 4), f32), "x.proj.bias": ((5,), f32), "x.lone.weight": ((5, 4), f32),
            "x.t.weight": ((5, 4), f32), "x.t.ids": ((5,), i64)}
    tables = tables_of("mem", meta)
    assert tables["x"].slots == {"acc.1": "x.acc.1"}
    assert sorted(tables) == ["x", "x.lone", "x.t"]  # x.proj: an nn.Linear's (bias, no ids)


# --------------------------------------------------------------------------- an empty `tables`
@pytest.fixture(scope="module")
def job_ckpt(tmp_path_factory):
    from helpers import make_job

    job = make_job(str(tmp_path_factory.mktemp("run")))
    job.train(2)
    path = job.saver.save("ckpt_2")
    job.saver.close()
    return path


@pytest.mark.parametrize("to", ["torch", "dcp", "recsave"])
def test_convert_with_an_empty_tables_list_converts_no_table(job_ckpt, tmp_path, to):
    """`tables=[]` from a recsave source was taken for "every table" (`tables or all`), while from
    a PyTorch source it meant none: the output silently held every table."""
    out = convert(job_ckpt, str(tmp_path / "out"), to, tables=[])
    if to == "recsave":
        assert recsave.describe(out)["tables"] == {}
        return
    from recsave.load.sources import open_source

    keys = set(open_source(out).meta)
    assert not {k for k in keys if k.startswith(("user.", "item."))}
    assert "mlp.0.weight" in keys


def test_to_parquet_of_no_tables_writes_an_empty_export(job_ckpt, tmp_path):
    """tables=[] into a new directory failed with StorageError "No such file or directory" on the
    manifest: no table directory had made out_dir. (export_serving takes tables=[] too.)"""
    from recsave.export import MANIFEST, ParquetSource, to_parquet

    out = tmp_path / "new" / "export"
    manifest = to_parquet(job_ckpt, str(out), tables=[])
    assert manifest["tables"] == {} and manifest["step"] == 2
    assert sorted(os.listdir(out)) == [MANIFEST]
    assert ParquetSource(str(out)).tables() == {}


def test_export_delta_of_no_tables_writes_an_empty_feed(job_ckpt, tmp_path):
    from recsave.export import DELTA_MANIFEST, export_delta

    out = tmp_path / "new" / "feed"
    manifest = export_delta(job_ckpt, job_ckpt, str(out), tables=[])
    assert manifest["tables"] == {}
    assert sorted(os.listdir(out)) == [DELTA_MANIFEST]


# ------------------------------------------------------------------ a source saved again mid-load
class TwoTables(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = HashTable(2, name="a")
        self.b = HashTable(2, name="b")


def _flat_state(value: float) -> dict:
    return {f"{t}.{k}": v for t in "ab" for k, v in (("ids", torch.arange(3)),
                                                      ("weight", torch.full((3, 2), value)))}


def _save_again_after_first_read(monkeypatch, cls, save) -> None:
    """Saves the source anew (as a training job would) right after its first tensor read."""
    orig = cls.read_tensors
    reads = []

    def read_tensors(self, keys):
        out = orig(self, keys)
        reads.append(keys)
        if len(reads) == 1:
            save()
        return out
    monkeypatch.setattr(cls, "read_tensors", read_tensors)


def test_a_torch_save_file_replaced_during_a_load_is_refused(tmp_path, monkeypatch):
    """A mapped torch.save source is read again by path for each table: a file saved anew in
    between gave table `a` the old file's rows and `b` the new one's, silently."""
    from recsave.errors import ConfigError
    from recsave.load.torch_sources import TorchSaveSource

    path = str(tmp_path / "state.pt")
    torch.save(_flat_state(1.0), path)

    def save():
        torch.save(_flat_state(2.0), path + ".tmp")
        os.replace(path + ".tmp", path)
    _save_again_after_first_read(monkeypatch, TorchSaveSource, save)
    model = TwoTables()
    with pytest.raises(ConfigError, match="changed since it was opened"):
        Saver(model, output_dir=str(tmp_path / "out")).load(path, direct_path=True)
    assert len(model.a) == len(model.b) == 0  # nothing loaded


def test_a_dcp_directory_saved_again_during_a_load_is_refused(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from recsave.errors import ConfigError
    from recsave.load.torch_sources import DcpSource

    path = str(tmp_path / "dcp")

    def save(value: float) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(_flat_state(value), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    save(1.0)
    _save_again_after_first_read(monkeypatch, DcpSource, lambda: save(2.0))
    model = TwoTables()
    with pytest.raises(ConfigError, match="changed since it was opened"):
        Saver(model, output_dir=str(tmp_path / "out")).load(path, direct_path=True)
    assert len(model.a) == len(model.b) == 0


def test_a_dcp_directory_whose_data_files_are_saved_again_during_a_load_is_refused(tmp_path, monkeypatch):
    """DCP writes its data files before .metadata: a job saving the directory again in place,
    caught between the two, gave table `a` the old rows and `b` the new ones, silently, while
    only .metadata was checked."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from recsave.errors import ConfigError
    from recsave.load.torch_sources import DcpSource

    path, other = str(tmp_path / "dcp"), str(tmp_path / "other")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_flat_state(1.0), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        dcp.save(_flat_state(2.0), storage_writer=dcp.FileSystemWriter(other), no_dist=True)

    def data_files_written_again():
        for name in os.listdir(other):
            if name != ".metadata":
                shutil.copyfile(os.path.join(other, name), os.path.join(path, name))
    _save_again_after_first_read(monkeypatch, DcpSource, data_files_written_again)
    model = TwoTables()
    with pytest.raises(ConfigError, match="changed since it was opened"):
        Saver(model, output_dir=str(tmp_path / "out")).load(path, direct_path=True)
    assert len(model.a) == len(model.b) == 0


def test_a_parquet_file_written_again_during_its_read_is_refused(tmp_path, monkeypatch):
    """A plain Parquet source is read in two passes (ids, then values). A file written again in
    between, in place (pyarrow's write_table, pandas' to_parquet) with the same rows in another
    order, gave id 1 the row of id 3, silently."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recsave.errors import ConfigError
    from recsave.load.parquet import ParquetSource

    path = str(tmp_path / "user.parquet")

    def write(ids, values):
        emb = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(np.asarray(values, np.float32), 4)), 4)
        pq.write_table(pa.table({"id": pa.array(np.asarray(ids, np.int64)), "embedding": emb}), path)
    write([1, 2, 3], [10, 20, 30])
    orig, opened = ParquetSource._open_checked, []

    def open_checked(self, *args):
        opened.append(args[1])
        if len(opened) == 2:  # the second pass over the file
            write([3, 2, 1], [30, 20, 10])
        return orig(self, *args)
    monkeypatch.setattr(ParquetSource, "_open_checked", open_checked)
    model = OneTable()
    with pytest.raises(ConfigError, match="changed since it was opened"):
        Saver(model, output_dir=str(tmp_path / "out")).load(path, direct_path=True)
    assert len(model.user) == 0


def test_convert_to_torch_of_numpy_scalars_in_extras_loads_with_weights_only(tmp_path):
    """A checkpoint's extras carry numpy values (format/plainstate.py), and `_flatten_plain` kept
    numpy scalars (numbers.Number) as they were: torch.save pickled them with numpy's reducer, so
    the file convert wrote failed torch.load(weights_only=True), the load it promises, and could
    not be read back as a source (ConfigError)."""
    import numpy as np

    class Metrics:
        def state_dict(self):
            return {"best": np.float64(0.25), "seen": np.int64(3), "lr": np.float32(0.5), "flag": np.bool_(True)}

        def load_state_dict(self, state):
            pass
    model = OneTable()
    model.user.load_rows(torch.arange(3), torch.ones(3, 4))
    saver = Saver(model, output_dir=str(tmp_path / "out"))
    saver.register_for_checkpointing("metrics", Metrics())
    path = convert(saver.save("ckpt_1"), str(tmp_path / "state.pt"), "torch")
    state = torch.load(path, weights_only=True)
    extras = {k: v for k, v in state.items() if k.startswith("_recsave.extra.metrics.")}
    assert extras == {"_recsave.extra.metrics.best": 0.25, "_recsave.extra.metrics.seen": 3,
                      "_recsave.extra.metrics.lr": 0.5, "_recsave.extra.metrics.flag": True}
    assert [type(v) for v in extras.values()] == [float, int, float, bool]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the extra is not restored: convert says so
        back = convert(path, str(tmp_path / "back"), "recsave")
    assert recsave.describe(back)["tables"]["user"]["rows"] == 3


class WithDenseEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.user = HashTable(2, name="user")
        self.pos = torch.nn.Embedding(5, 3)


@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_a_dense_embedding_stays_dense_through_a_convert_round_trip(tmp_path, to):
    """recsave -> torch / DCP -> recsave took the model's dense nn.Embedding (`pos.weight`, no
    ids) for a table by the default `tables`: the converted checkpoint held a table `pos` and no
    dense `pos.weight`, and Saver.load of it into the model failed ("lacks ['pos.weight']"),
    against the documented exact round trip. In recsave's layout every table has `<name>.ids`."""
    model = WithDenseEmbedding()
    model.user.load_rows(torch.arange(3), torch.randn(3, 2))
    ckpt = Saver(model, output_dir=str(tmp_path / "out")).save("ckpt_1")
    back = convert(convert(ckpt, str(tmp_path / to), to), str(tmp_path / "back"), "recsave")
    described = recsave.describe(back)
    assert sorted(described["tables"]) == ["user"] and described["dense"] == ["pos.weight"]
    fresh = WithDenseEmbedding()
    Saver(fresh, output_dir=str(tmp_path / "load")).load(back, direct_path=True)
    assert same_bits(fresh.pos.weight, model.pos.weight)
    assert all(same_bits(a, b) for a, b in zip(table_state(fresh.user).values(), table_state(model.user).values()))


@pytest.mark.parametrize("dtype", ["int8", "fp16"])
def test_serving_export_of_a_value_no_dtype_holds_says_so(tmp_path, dtype):
    """A float64 table holding 1e300: the int8 export said the row was NaN / infinite and advised
    dtype fp32 / fp16 / bf16, the fp16 export advised bf16 or fp32; each of those refuses it too."""
    from recsave.errors import UsageError

    model = OneTable(dtype=torch.float64)
    model.user.load_rows(torch.arange(2), torch.tensor([[1.0, 2.0, 3.0, 4.0], [1e300, 0.0, 0.0, 0.0]],
                                                       dtype=torch.float64))
    ckpt = Saver(model, output_dir=str(tmp_path / "out")).save("ckpt_1")
    with pytest.raises(UsageError, match=r"row 1 .*\(largest 1e\+300\).*no serving dtype holds") as info:
        recsave.export_serving(ckpt, str(tmp_path / "serve"), dtype)
    assert "fp32" not in str(info.value) and "NaN" not in str(info.value)
