"""recsave.convert / `recsave convert`: recsave <-> torch.save <-> DCP, exact round trips."""
import os
import pickle
import re
import uuid
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import CTR, assert_states_equal, make_job, model_state, tables_of
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import recsave
from recsave import Saver
from recsave.errors import ConfigError, UsageError
from recsave.tools import catalog, cli
from recsave.tools.convert import EXTRA_PREFIX
from recsave.tools.torchzip import StreamingTorchSave


def _trained(tmp_path):
    job = make_job(str(tmp_path / "job"))
    job.train(4)
    job.saver.save("ckpt_4")
    return job


def _expected_flat(job):
    """The layout convert writes, from the live model."""
    out = {}
    for name, table in tables_of(job.model).items():
        ids, values, slots = table.export()
        out[f"{name}.ids"] = ids
        out[f"{name}.weight"] = values
        out.update({f"{name}.{s}": v for s, v in slots.items()})
        out.update({f"{name}.{m}": v.reshape(-1) for m, v in table.row_meta(table.lookup(ids, insert=False)).items()})
        out[f"{name}.step"] = torch.tensor(table.step)
    out.update({k: v.detach() for k, v in job.model.state_dict().items() if isinstance(v, torch.Tensor)})
    return out


def _by_id(flat, table):
    order = torch.argsort(flat[f"{table}.ids"])
    return {k: v[order] for k, v in flat.items() if k.startswith(f"{table}.") and v.dim() >= 1
            and v.shape[0] == order.numel()}


def _assert_layout_equal(got, expected):
    tables = {k[: -len(".ids")] for k in expected if k.endswith(".ids")}
    model_keys = {k for k in got if not k.startswith(EXTRA_PREFIX)}
    assert model_keys == set(expected)
    for t in tables:
        g, e = _by_id(got, t), _by_id(expected, t)
        assert set(g) == set(e)
        for k in e:
            assert torch.equal(g[k], e[k]), k
    for k, v in expected.items():
        if k.partition(".")[0] not in tables or v.dim() == 0:
            assert torch.equal(got[k], v), k


def test_recsave_to_torch_and_dcp_read_back_equal_the_model(tmp_path):
    job = _trained(tmp_path)
    expected = _expected_flat(job)
    # Into a directory that does not exist yet: made, as every tool makes its destination's parents.
    pt = recsave.convert(str(tmp_path / "job"), str(tmp_path / "new" / "dir" / "state.pt"), "torch")
    got = torch.load(pt, weights_only=True)
    _assert_layout_equal(got, expected)
    mapped = torch.load(pt, weights_only=True, mmap=True)
    assert all(torch.equal(mapped[k], v) if isinstance(v, torch.Tensor) else mapped[k] == v for k, v in got.items())
    extras = {k for k in got if k.startswith("_recsave.extra.")}
    assert {k.split(".")[2] for k in extras} == {"dense_opt", "sparse_optim"}
    assert torch.equal(got["_recsave.extra.dense_opt.state.0.exp_avg"],
                       job.dense_opt.state_dict()["state"][0]["exp_avg"])

    out = recsave.convert(str(tmp_path / "job"), str(tmp_path / "dcp"), "dcp")
    dcp_to_torch_save(out, str(tmp_path / "from_dcp.pt"))
    back = torch.load(str(tmp_path / "from_dcp.pt"), weights_only=True)
    assert set(back) == set(got)
    for k, v in got.items():
        assert (torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v), k
    # dcp.load reads it too (one table's keys)
    meta = dcp.FileSystemReader(out).read_metadata()
    part = {k: torch.empty(tuple(meta.state_dict_metadata[k].size), dtype=torch.float32)
            for k in ("user.weight", "user.adagrad_acc")}
    dcp.load(part, checkpoint_id=out, no_dist=True)
    assert torch.equal(part["user.weight"], got["user.weight"])
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == [".metadata", "part_0", "part_1", "part_2"]


@pytest.mark.parametrize("via", ["torch", "dcp"])
def test_torch_and_dcp_to_recsave_then_saver_load_equals_the_source(tmp_path, via):
    job = _trained(tmp_path)
    mid = recsave.convert(str(tmp_path / "job"), str(tmp_path / "mid"), via)
    with pytest.warns(UserWarning, match=r"mid: the extras 'dense_opt' \(\d+ entries\), 'sparse_optim' \(\d+ "
                                         r"entries\) \(_recsave.extra.<extra>.\*\) are not restored") as caught:
        ckpt = recsave.convert(mid, str(tmp_path / "out"), "recsave", ckpt_id="ckpt_4")
    assert len(caught) == 1 and "not tensors" not in str(caught[0].message)  # recsave's own file: extras only
    assert ckpt.endswith("ckpt_4")
    assert (tmp_path / "out" / "checkpoint").read_text().split() == ["ckpt_4"]
    fresh = CTR(seed=5)
    fresh.user.add_slot("adagrad_acc")
    fresh.item.add_slot("adagrad_acc")
    report = Saver(fresh, output_dir=str(tmp_path / "out")).load()
    assert report.step == 4
    assert_states_equal(model_state(fresh), model_state(job.model), "converted back")


def test_nn_embedding_file_to_recsave_picks_embeddings_not_linears(tmp_path):
    torch.manual_seed(0)
    src = torch.nn.ModuleDict({"emb": torch.nn.Embedding(300, 8), "mlp": torch.nn.Linear(8, 8)})
    torch.save(src.state_dict(), tmp_path / "m.pt")
    assert cli.main(["convert", str(tmp_path / "m.pt"), str(tmp_path / "out"), "--to", "recsave"]) == 0
    info = catalog.describe(str(tmp_path / "out"))
    assert set(info["tables"]) == {"emb"} and info["tables"]["emb"]["rows"] == 300
    assert sorted(info["dense"]) == ["mlp.bias", "mlp.weight"]
    model = torch.nn.ModuleDict({"emb": recsave.HashTable(8), "mlp": torch.nn.Linear(8, 8)})
    Saver(model, output_dir=str(tmp_path / "out")).load()
    ids, values, _ = model["emb"].export()
    assert torch.equal(values[torch.argsort(ids)], src["emb"].weight.detach())
    assert torch.equal(model["mlp"].weight, src["mlp"].weight)


def test_a_training_file_converts_its_tensors_and_names_what_it_leaves_out(tmp_path):
    """{"model": ..., "optimizer": ..., "epoch": 3}, as training scripts torch.save them: the
    optimizer's per-parameter tensors (int keys) and list entries convert under DCP's dotted
    names; the numbers and strings cannot, and the conversion says so instead of dropping them
    silently. A file that holds no dict, or two entries reaching one key, is refused."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "mlp": torch.nn.Linear(4, 2)})
    opt = torch.optim.Adam(model.parameters())
    model["mlp"](model["emb"](torch.arange(3))).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3,
                "history": [torch.ones(2), "note"]}, tmp_path / "train.pt")
    with pytest.warns(UserWarning, match=r"train.pt: \d+ entries are not tensors and are not converted: "
                                         r"'epoch' \(int\), 'history.1' \(str\), 'optimizer.param_groups.0.amsgrad'"):
        recsave.convert(str(tmp_path / "train.pt"), str(tmp_path / "flat.pt"), "torch")
    flat = torch.load(tmp_path / "flat.pt", weights_only=True)
    state = opt.state_dict()["state"]
    assert set(flat) == {f"model.{k}" for k in model.state_dict()} | {"model.emb.ids", "history.0"} | {
        f"optimizer.state.{i}.{k}" for i, per in state.items() for k in per}
    assert torch.equal(flat["optimizer.state.2.exp_avg"], state[2]["exp_avg"])
    assert torch.equal(flat["model.emb.weight"], model["emb"].weight.detach())
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="list.pt: holds a list, not a state dict"):
        recsave.convert(str(tmp_path / "list.pt"), str(tmp_path / "l"), "recsave")
    torch.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, tmp_path / "clash.pt")
    with pytest.raises(ConfigError, match="two entries flatten to the key 'a.b'"):
        recsave.convert(str(tmp_path / "clash.pt"), str(tmp_path / "c"), "recsave")
    # Two values that are never converted (a config dump's dotted and nested keys) are no clash.
    torch.save({"w": torch.ones(2), "optim.lr": 0.1, "optim": {"lr": 0.2}}, tmp_path / "hparams.pt")
    with pytest.warns(UserWarning, match=r"2 entries are not tensors .*'optim.lr' \(float\), 'optim.lr \(again\)'"):
        recsave.convert(str(tmp_path / "hparams.pt"), str(tmp_path / "h.pt"), "torch")
    assert set(torch.load(tmp_path / "h.pt", weights_only=True)) == {"w"}
    assert not (tmp_path / "l").exists() and not (tmp_path / "c").exists()


def test_convert_refuses_bad_arguments_and_existing_outputs(tmp_path):
    job = _trained(tmp_path)
    (tmp_path / "taken.pt").write_bytes(b"x")
    with pytest.raises(UsageError, match="exists"):
        recsave.convert(str(tmp_path / "job"), str(tmp_path / "taken.pt"), "torch")
    assert (tmp_path / "taken.pt").read_bytes() == b"x"
    with pytest.raises(UsageError, match="must be one of"):
        recsave.convert(str(tmp_path / "job"), str(tmp_path / "x"), "onnx")
    with pytest.raises(ConfigError, match="no table"):
        recsave.convert(str(tmp_path / "job"), str(tmp_path / "x"), "torch", tables=["nope"])
    with pytest.raises(recsave.ArgumentTypeError):
        recsave.convert(str(tmp_path / "job"), 5, "torch")
    assert job is not None and not (tmp_path / "x").exists()
    assert cli.main(["convert", str(tmp_path / "job"), str(tmp_path / "taken.pt"), "--to", "torch"]) == cli.EXIT_ERROR


def test_a_directory_is_refused_as_a_torch_file_and_the_sources_output_dir_as_a_target(tmp_path):
    """--to torch writes one file: an (empty) directory there is refused by name. --to recsave into
    the source's own output dir would list the converted checkpoint as that job's latest: refused
    however the path is spelt, and nothing there changes."""
    job = _trained(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="is a directory; --to torch writes one file"):
        recsave.convert(str(tmp_path / "job"), str(tmp_path / "empty"), "torch")
    assert os.listdir(tmp_path / "empty") == []
    job_dir = str(tmp_path / "job")
    before, listed = sorted(os.listdir(job_dir)), job.saver.checkpoints()
    for src, dst in [(job_dir, job_dir), (job_dir, job_dir + "/."), (job_dir, "file://" + job_dir),
                     (os.path.join(job_dir, "ckpt_4"), job_dir + "/")]:
        with pytest.raises(UsageError, match="is the output dir of"):
            recsave.convert(src, dst, "recsave")
    assert sorted(os.listdir(job_dir)) == before and job.saver.checkpoints() == listed
    ckpt_dir = os.path.join(job_dir, "ckpt_4")  # inside the checkpoint: gone when it rotates away
    inside = sorted(os.listdir(ckpt_dir))
    for dst, to in [(ckpt_dir, "recsave"), (os.path.join(ckpt_dir, "sub"), "recsave"),
                    (os.path.join(ckpt_dir, "flat.pt"), "torch"), (os.path.join(ckpt_dir, "dcp"), "dcp")]:
        with pytest.raises(UsageError, match="lies in the checkpoint"):
            recsave.convert(ckpt_dir, dst, to)
    assert sorted(os.listdir(ckpt_dir)) == inside
    assert recsave.convert(ckpt_dir, os.path.join(job_dir, "flat.pt"), "torch")  # beside it: a plain file
    path = recsave.convert(job_dir, str(tmp_path / "elsewhere"), "recsave")
    assert path == str(tmp_path / "elsewhere" / "converted")


def test_dcp_metadata_is_a_plain_pickle_of_dcp_metadata(tmp_path):
    job = _trained(tmp_path)
    out = recsave.convert(str(tmp_path / "job"), str(tmp_path / "dcp"), "dcp")
    with open(f"{out}/.metadata", "rb") as f:
        md = pickle.load(f)
    assert set(md.state_dict_metadata) >= {"user.ids", "user.weight", "item.adagrad_acc", "mlp.0.weight"}
    assert all(info.relative_path.startswith("part_") for info in md.storage_data.values())
    assert job is not None


@pytest.mark.parametrize("mmap", [False, True])
def test_streaming_torch_save_is_read_by_torch_load_exactly(tmp_path, mmap):
    tensors = {"ids": torch.arange(7) - 3, "w": torch.rand(7, 3), "empty": torch.rand(0, 4),
               "flag": torch.tensor(True), "bf": torch.rand(5, 2).to(torch.bfloat16),
               "half": torch.rand(3).half(), "strided": torch.rand(4, 6).t(),
               "i8": torch.tensor([-1, 2], dtype=torch.int8),
               # dtypes torch.save writes as complex typed storages, or as untyped bytes (its v3 form)
               "c64": torch.randn(3, dtype=torch.complex64), "c128": torch.randn(2, dtype=torch.complex128),
               "u16": torch.tensor([0, 65535], dtype=torch.uint16), "u32": torch.tensor([7], dtype=torch.uint32),
               "u64": torch.tensor([2 ** 63], dtype=torch.uint64),
               "f8": torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn),
               "f8b": torch.tensor([1.0]).to(torch.float8_e5m2)}
    path = tmp_path / "s.pt"
    with open(path, "wb") as f:
        writer = StreamingTorchSave(f)
        obj = {k: writer.add(v) for k, v in reversed(list(tensors.items()))}
        obj["n"] = 3
        writer.finish(obj)
    got = torch.load(path, weights_only=True, mmap=mmap)
    assert set(got) == set(tensors) | {"n"} and got["n"] == 3
    for k, v in tensors.items():  # compared as bytes: torch.equal lacks some of these dtypes
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)), k


def test_a_failed_dcp_conversion_leaves_nothing_and_repeated_ids_are_refused(tmp_path, monkeypatch):
    _trained(tmp_path)
    import recsave.tools.convert as conv

    real = conv._read_table
    calls = []

    def fail_second(source, name, concurrency, meta=()):
        calls.append(name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (injected)")
        return real(source, name, concurrency, meta)

    monkeypatch.setattr(conv, "_read_table", fail_second)
    with pytest.raises(OSError, match="injected"):
        recsave.convert(str(tmp_path / "job"), str(tmp_path / "dcp"), "dcp")
    assert not (tmp_path / "dcp").exists()
    (tmp_path / "empty").mkdir()
    calls.clear()
    with pytest.raises(OSError, match="injected"):
        recsave.convert(str(tmp_path / "job"), str(tmp_path / "empty"), "dcp")
    assert list((tmp_path / "empty").iterdir()) == []
    monkeypatch.setattr(conv, "_read_table", real)

    torch.save({"t.weight": torch.rand(3, 4), "t.ids": torch.tensor([5, 6, 5])}, tmp_path / "dup.pt")
    with pytest.raises(ConfigError, match="table 't' has repeated ids"):
        recsave.convert(str(tmp_path / "dup.pt"), str(tmp_path / "out"), "recsave")
    assert not (tmp_path / "out").exists()  # nor the output dir the failed write made
    (tmp_path / "kept").mkdir()
    with pytest.raises(ConfigError, match="table 't' has repeated ids"):
        recsave.convert(str(tmp_path / "dup.pt"), str(tmp_path / "kept"), "recsave")
    assert list((tmp_path / "kept").iterdir()) == []  # an output dir that was there stays

    # slots of another dtype than the embedding: refused, not rounded into the embedding's dtype
    torch.save({"t.weight": torch.rand(3, 4), "t.ids": torch.tensor([1, 2, 3]),
                "t.acc": torch.rand(3, 4, dtype=torch.float64)}, tmp_path / "f64slot.pt")
    with pytest.raises(ConfigError, match=r"table 't' is float32 but its slot\(s\) \{'acc': 'float64'\}"):
        recsave.convert(str(tmp_path / "f64slot.pt"), str(tmp_path / "out"), "recsave")
    assert not (tmp_path / "out").exists()


def test_conversions_keep_row_metadata_and_table_steps(tmp_path):
    """Converting a recsave checkpoint into a recsave checkpoint (e.g. a delta chain into one full
    checkpoint), or through torch.save or DCP and back, keeps every row's last_step and count and
    each table's step, as a load would."""
    job = _trained(tmp_path)
    for table in tables_of(job.model).values():
        table.delete(table.ids()[:3])  # a freed row: ids no longer in row order
    job.train(2)
    src = job.saver.save("ckpt_6", incremental=True)
    assert job.saver.last_save_kind == "delta"
    out = recsave.convert(src, str(tmp_path / "out"), "recsave")
    via = [recsave.convert(recsave.convert(src, str(tmp_path / f"mid_{to}"), to), str(tmp_path / f"out_{to}"),
                           "recsave") for to in ("torch", "dcp")]
    for path in (src, out, *via):
        fresh = make_job(str(tmp_path / "fresh"))
        fresh.saver.load(path, direct_path=True, load_conf={"load": ["sparse"]})  # convert keeps no extras
        for name, table in tables_of(job.model).items():
            got = tables_of(fresh.model)[name]
            assert got.step == table.step, name
            ids = torch.sort(table.ids()).values
            want, have = table.row_meta(table.lookup(ids, insert=False)), got.row_meta(got.lookup(ids, insert=False))
            assert all(torch.equal(want[m], have[m]) for m in want), name
        fresh.saver.close()


@pytest.mark.parametrize("via", [None, "torch", "dcp"])
def test_convert_to_recsave_keeps_the_global_step(tmp_path, via):
    """A CheckpointManager job's global step becomes the converted checkpoint's step (its id,
    `converted`, names none): a manager restoring it resumes at step 7, not 0, with the table steps.
    From a recsave checkpoint the extras go along too (the sparse optimizer's step counts, the
    manager's global_step); from torch.save / DCP they cannot (their strings are not in the file),
    and the warning names exactly what is left out."""
    job = make_job(str(tmp_path / "job"), save_interval=3, register=False)
    job.train(7)
    job.manager.save()
    src, out = str(tmp_path / "job"), str(tmp_path / "out")
    if via is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ckpt = recsave.convert(src, out, "recsave")
    else:
        mid = recsave.convert(src, str(tmp_path / "mid"), via)
        with pytest.warns(UserWarning) as caught:
            ckpt = recsave.convert(mid, out, "recsave")
        assert [str(w.message) for w in caught] == [
            f"convert: {mid}: the extra 'sparse_optim' (5 entries) (_recsave.extra.<extra>.*) is not restored by a "
            f"conversion; the sparse optimizer's step counts of table(s) ['item', 'user'] are not converted (a "
            f"converted checkpoint holds tables, dense tensors and the global step)"]
    assert catalog.describe(out)["step"] == 7
    if via is None:
        fresh = make_job(out, save_interval=3, register=False)
        manager, model = fresh.manager, fresh.model
        assert manager.restore() == 7
        assert fresh.sparse_opt.steps == {"user": 7, "item": 7}
        assert "global_step" in manager.last_report.loaded
    else:
        model = CTR(seed=5)
        manager = recsave.CheckpointManager(Saver(model, output_dir=out), 3)
        assert manager.restore() == 7
        assert f"{ckpt}: global_step set to 7 (the step its index records); no global_step was loaded " \
               f"from it" in manager.last_report.notes
    assert {n: t.step for n, t in tables_of(model).items()} == {"user": 7, "item": 7}
    # An id naming another step than the source's is refused before anything is written: the
    # checkpoint would record step 3 while holding step 7's state and global_step, and a manager's
    # restore(global_step=3) return 7. An id naming the source's step records it.
    source = mid if via else src
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UsageError, match=r"ckpt_id 'ckpt_3' names step 3, but .* holds the state of step 7: "
                                             r"name the converted checkpoint ckpt_7"):
            recsave.convert(source, out, "recsave", ckpt_id="ckpt_3")
        assert not os.path.exists(os.path.join(out, "ckpt_3"))
        recsave.convert(source, out, "recsave", ckpt_id="ckpt_7")
    assert catalog.describe(str(tmp_path / "out" / "ckpt_7"))["step"] == 7
    manager.saver.close()


def test_converting_to_torch_names_the_global_step_it_leaves_out(tmp_path):
    """The torch.save / DCP layout has no place for a source's global step: the warning says so."""
    job = make_job(str(tmp_path / "job"), save_interval=3, register=False)
    job.train(3)
    mid = recsave.convert(str(tmp_path / "job"), str(tmp_path / "mid.pt"), "torch")
    with pytest.warns(UserWarning) as caught:
        recsave.convert(mid, str(tmp_path / "again"), "dcp")
    assert [str(w.message) for w in caught] == [
        f"convert: {mid}: the extra 'sparse_optim' (5 entries) (_recsave.extra.<extra>.*) is not restored by a "
        f"conversion; the sparse optimizer's step counts of table(s) ['item', 'user'] are not converted; the global "
        f"step 3 is not converted (a converted checkpoint holds tables and dense tensors)"]


class _Dotted:
    """An extra whose state has a dotted key beside the nested one it spells."""

    def state_dict(self):
        return {"a.b": 1, "a": {"b": 2}}

    def load_state_dict(self, state):
        pass


def test_two_extra_values_flattening_to_one_key_are_refused(tmp_path):
    job = make_job(str(tmp_path / "job"))
    job.saver.register_for_checkpointing("dotted", _Dotted())
    job.saver.save("ckpt_1")
    with pytest.raises(UsageError, match="flatten to the key '_recsave.extra.dotted.a.b'"):
        recsave.convert(str(tmp_path / "job"), str(tmp_path / "state.pt"), "torch")
    assert not (tmp_path / "state.pt").exists()


def test_dcp_to_and_from_a_file_url_is_local_disk(tmp_path):
    job = _trained(tmp_path)
    url = f"file://{tmp_path}/dcp"
    assert recsave.convert(str(tmp_path / "job"), url, "dcp") == url
    assert (tmp_path / "dcp" / ".metadata").is_file()
    assert not any(p.name.startswith("file:") for p in tmp_path.rglob("*"))  # nothing under ./file:/...
    back = recsave.convert(url, str(tmp_path / "back.pt"), "torch")
    _assert_layout_equal(torch.load(back, weights_only=True), _expected_flat(job))


def test_dcp_to_an_object_store_is_refused_before_writing(tmp_path):
    _trained(tmp_path)
    url = f"memory://dcp-{uuid.uuid4().hex}/out"
    with pytest.raises(recsave.UsageError, match="a DCP checkpoint is written to local disk"):
        recsave.convert(str(tmp_path / "job"), url, "dcp")
    from recsave.storage import get_storage
    assert not get_storage(url).exists(url)


def test_a_dcp_source_missing_a_data_file_is_a_one_line_error(tmp_path, capsys):
    _trained(tmp_path)
    out = recsave.convert(str(tmp_path / "job"), str(tmp_path / "dcp"), "dcp")
    next(p for p in (tmp_path / "dcp").rglob("*.distcp")).unlink()
    with pytest.raises(recsave.CorruptCheckpointError, match="reading the DCP checkpoint failed"):
        recsave.convert(out, str(tmp_path / "back.pt"), "torch")
    assert cli.main(["convert", out, str(tmp_path / "back2.pt"), "--to", "torch"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("recsave: error: ") and err.count("\n") == 1
    assert not (tmp_path / "back.pt").exists() and not (tmp_path / "back2.pt").exists()


@pytest.mark.parametrize("to", ["torch", "dcp", "recsave"])
def test_a_failed_conversion_leaves_no_directory_it_made(tmp_path, to):
    """A source damaged in its last table: the conversion fails after writing part of it into a
    path whose parents did not exist; nothing of what it made stays."""
    _trained(tmp_path)
    ckpt = tmp_path / "job" / "ckpt_4"
    shard = sorted(p for p in os.listdir(ckpt) if p.endswith(".safetensors"))[-1]
    with open(ckpt / shard, "r+b") as f:
        f.seek(-16, os.SEEK_END)
        byte = f.read(1)
        f.seek(-16, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    dst = tmp_path / "new" / "nested" / ("state.pt" if to == "torch" else "out")
    with pytest.raises(recsave.CorruptCheckpointError):
        recsave.convert(str(ckpt), str(dst), to)
    assert not (tmp_path / "new").exists()
    if to == "recsave":  # on an object-store-like file system too
        from recsave.storage import get_storage
        remote = f"memory://conv-{uuid.uuid4().hex}/new/nested/out"
        with pytest.raises(recsave.CorruptCheckpointError):
            recsave.convert(str(ckpt), remote, to)
        assert not get_storage(remote).exists(remote.rsplit("/", 2)[0])


@pytest.mark.parametrize("to,name", [("torch", "sub.pt"), ("dcp", "sub")])
def test_converting_to_a_path_under_a_file_is_a_storage_error_naming_it(tmp_path, to, name):
    """convert --to torch under a regular file raised a bare NotADirectoryError naming its internal
    temporary file (the clean-up of that file failed in place of the write); every target now
    raises recsave's StorageError naming the destination, and the file stays as it was."""
    job = make_job(str(tmp_path / "job"), register=False)
    job.train(1)
    job.saver.save("ckpt_1")
    (tmp_path / "afile").write_text("x")
    dst = str(tmp_path / "afile" / name)
    with pytest.raises(recsave.StorageError, match=re.escape(str(tmp_path / "afile"))) as info:
        recsave.convert(str(tmp_path / "job"), dst, to)
    assert ".tmp-" not in str(info.value)
    assert (tmp_path / "afile").read_text() == "x"
    job.saver.close()
