"""Serving export (recsave.export_serving, `recsave export-serving`): int8 / fp16 / bf16 / fp32 rows
written as a checkpoint of kind "serving" (docs/FORMAT.md section 8), loaded back by Saver.load and
the model bank, on the same or another number of ranks."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from helpers import read_index_json, write_index_json
from safetensors import safe_open

import recsave
import recsave.tools.compact
from recsave import HashTable, Saver, partition
from recsave.errors import CheckpointExistsError, ConfigError, CorruptCheckpointError, FormatVersionError, UsageError
from recsave.format import index as index_mod
from recsave.format.quant import quantize_rows
from recsave.format.reader import read_tensors
from recsave.tools import catalog
from recsave.tools.cli import main

DIM = 64


class Net(torch.nn.Module):
    """Tables without optimizer slots (a serving model) and a dense layer."""

    def __init__(self, dim: int = DIM, item_dim: int = 16):
        super().__init__()
        self.user = HashTable(dim, name="user", seed=1)
        self.item = HashTable(item_dim, name="item", seed=2)
        self.lin = torch.nn.Linear(4, 2)


def special_rows(ids: torch.Tensor, dim: int) -> torch.Tensor:
    """Random rows of varied ranges, plus a constant row, a row far from 0 and one of tiny spread."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(ids.numel(), dim, generator=g) * torch.rand(ids.numel(), 1, generator=g) * 3
    rows[0] = 0.25                                          # max == min
    rows[1] = 1000.0 + torch.randn(dim, generator=g)        # offset far from 0
    rows[2] = -7.0 + 1e-4 * torch.randn(dim, generator=g)   # spread far below offset's fp16 ulp
    return rows


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A saved Net: user (dim 64, 3000 rows), item (dim 16, 500 rows), step 7."""
    out = str(tmp_path_factory.mktemp("src"))
    net = Net()
    uid = torch.arange(3000, dtype=torch.int64) * 7919 - 123456
    iid = torch.arange(500, dtype=torch.int64) * 31 + 5
    net.user.load_rows(uid, special_rows(uid, DIM))
    net.item.load_rows(iid, torch.randn(500, 16, generator=torch.Generator().manual_seed(6)))
    with torch.no_grad():
        net.lin.weight.fill_(0.5)
    saver = Saver(net, output_dir=out)
    ckpt = saver.save("ckpt_7")
    saver.close()
    return ckpt, net


def stored(ckpt_dir: str, table: str, columns) -> dict:
    names = [f"{table}@{c}" for c in columns]
    return {n.split("@")[1]: t for n, t in read_tensors(ckpt_dir, names).items()}


def reference_dequant(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The documented formula in numpy float32: (q + 128) * scale + offset."""
    x = (q.numpy().astype(np.float32) + np.float32(128)) * scale.numpy().astype(np.float32)
    return torch.from_numpy(x + offset.numpy().astype(np.float32))


def loaded_rows(table: HashTable, ids: torch.Tensor) -> torch.Tensor:
    got_ids, values, _ = table.export(ids)
    assert torch.equal(got_ids, ids)
    return values


# ------------------------------------------------------------------------------------ int8
def test_int8_is_small_bounded_and_loads_exactly_as_documented(source, tmp_path):
    ckpt, _ = source
    path = recsave.export_serving(ckpt, str(tmp_path / "serve"), "int8")
    assert path == str(tmp_path / "serve" / "ckpt_7")
    assert (tmp_path / "serve" / "checkpoint").read_text().split() == ["ckpt_7"]
    index = index_mod.read(path)
    assert (index.kind, index.format_version, index.step) == ("serving", 4, 7)
    raw = json.loads((tmp_path / "serve" / "ckpt_7" / "index").read_text())
    assert list(raw)[:3] == ["magic", "format_version", "kind"] and raw["kind"] == "serving"
    assert sorted(index.tensors) == sorted(f"{t}@{c}" for t in ("user", "item")
                                           for c in ("id", "embedding", "scale", "offset"))
    assert index.meta.tables["user"].quant == "int8" and index.meta.tables["user"].slots == ()
    assert index.meta.tables["user"].dtype == "float32" and index.meta.tables["user"].rows == 3000
    assert index.meta.extras == () and index.meta.io_states == () and sorted(index.meta.dense) == ["lin.bias",
                                                                                                  "lin.weight"]
    assert sorted(index.files) == ["model.pt", "sparse-0-0.safetensors", "sparse-0-1.safetensors"]

    # Bytes: the embedding codes + scale + offset against the fp32 embedding (ids left out of both).
    n = 3000
    quant_bytes = sum(index.tensor(f"user@{c}").nbytes for c in ("embedding", "scale", "offset"))
    assert quant_bytes == n * (DIM + 2 + 2)
    assert quant_bytes <= 0.28 * n * DIM * 4

    src = stored(ckpt, "user", ("id", "embedding"))
    got = stored(path, "user", ("id", "embedding", "scale", "offset"))
    assert torch.equal(got["id"], src["id"])  # same rows in the same (bucket) order
    assert got["embedding"].dtype == torch.int8 and got["scale"].dtype == torch.float16
    x, q, scale, offset = src["embedding"], got["embedding"], got["scale"].float(), got["offset"].float()
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    ulp = (torch.finfo(torch.float16).eps * lo.abs()).clamp(min=2.0 ** -24)
    assert bool((offset <= lo).all()) and bool((lo - offset <= ulp).all())      # offset: min rounded down
    assert bool((scale <= (hi - offset) / 255 * (1 + 2.0 ** -10) + 2.0 ** -24).all())
    deq = reference_dequant(q, got["scale"], got["offset"])
    err = (deq - x).abs()
    slack = 2.0 ** -22 * (x.abs() + offset.abs() + 255 * scale)  # float32 rounding of the arithmetic
    assert bool((err <= scale / 2 + slack).all())
    # ... i.e. (max - min) / 510 plus what rounding scale and offset to float16 adds.
    assert bool((err <= (hi - lo) / 510 + (lo - offset) / 510 + scale * 2.0 ** -10 + slack).all())
    assert float(err[src["id"] == -123456].max()) == 0.0  # the constant row (max == min) is exact

    # Loading gives exactly the documented dequantised values.
    fresh = Net()
    report = Saver(fresh, output_dir=str(tmp_path / "other")).load(str(tmp_path / "serve"))
    assert sorted(report.loaded) == ["item", "lin.bias", "lin.weight", "user"]
    assert torch.equal(loaded_rows(fresh.user, src["id"]), deq)
    assert torch.equal(fresh.lin.weight, torch.full((2, 4), 0.5))
    assert catalog.verify(path) == []


def test_shards_stay_safetensors_readable(source, tmp_path):
    ckpt, _ = source
    path = recsave.export_serving(ckpt, str(tmp_path / "serve"), "int8", tables=["user"])
    index = index_mod.read(path)
    got = stored(path, "user", ("id", "embedding", "scale", "offset"))
    seen = set()
    for fname in (f for f in index.files if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            for key in f.keys():
                assert torch.equal(f.get_tensor(key), got[key.split("@")[1]]), key
                seen.add(key)
            assert f.metadata()["format"] == "recsave.shard"
    assert seen == {"user@id", "user@embedding", "user@scale", "user@offset"}


def test_float32_scales_hold_rows_float16_cannot(tmp_path):
    net = Net(dim=8)
    ids = torch.arange(10, dtype=torch.int64)
    rows = torch.randn(10, 8) * 1e5
    net.user.load_rows(ids, rows)
    saver = Saver(net, output_dir=str(tmp_path / "src"))
    ckpt = saver.save("ckpt_1")
    with pytest.raises(UsageError, match="scale_dtype='float32'"):
        recsave.export_serving(ckpt, str(tmp_path / "a"), "int8")
    assert not (tmp_path / "a" / "ckpt_1").exists()
    path = recsave.export_serving(ckpt, str(tmp_path / "b"), "int8", scale_dtype="float32")
    got = stored(path, "user", ("id", "embedding", "scale", "offset"))
    assert got["scale"].dtype == torch.float32
    src = stored(ckpt, "user", ("embedding",))["embedding"]
    deq = reference_dequant(got["embedding"], got["scale"], got["offset"])
    span = src.amax(1, keepdim=True) - src.amin(1, keepdim=True)
    assert bool(((deq - src).abs() <= span / 510 * (1 + 1e-5) + 1e-7 * src.abs()).all())


def test_non_finite_rows_are_refused_for_int8(tmp_path):
    net = Net(dim=4)
    rows = torch.zeros(3, 4)
    rows[1, 2] = float("nan")
    net.user.load_rows(torch.tensor([1, 2, 3]), rows)
    ckpt = Saver(net, output_dir=str(tmp_path / "src")).save("ckpt_1")
    with pytest.raises(UsageError, match="NaN or infinite"):
        recsave.export_serving(ckpt, str(tmp_path / "out"), "int8")
    assert not (tmp_path / "out" / "ckpt_1").exists()
    recsave.export_serving(ckpt, str(tmp_path / "out"), "fp16")  # floats carry NaN


def test_values_beyond_fp16_are_refused_not_made_infinite(tmp_path):
    """fp16 tops out at 65504: a larger finite value would load back as inf. bf16 holds it."""
    net = Net(dim=4)
    net.user.load_rows(torch.tensor([1, 2, 3]), torch.tensor([[0.5, 1.0, 2.0, 3.0], [1e5, -1e5, 7e4, 1.0],
                                                              [0.0, 0.0, 0.0, 0.0]]))
    ckpt = Saver(net, output_dir=str(tmp_path / "src")).save("ckpt_1")
    with pytest.raises(UsageError, match=r"table 'user': row \d of the checkpoint holds values beyond what "
                                         r"torch.float16 can hold \(largest 100000\); export it as bf16 or fp32"):
        recsave.export_serving(ckpt, str(tmp_path / "out"), "fp16")
    assert not (tmp_path / "out").exists()  # the directory the failed export made goes too
    (tmp_path / "kept").mkdir()
    with pytest.raises(UsageError, match="beyond what torch.float16 can hold"):
        recsave.export_serving(ckpt, str(tmp_path / "kept" / "a" / "b"), "fp16")
    assert os.listdir(tmp_path / "kept") == []  # a directory that was there stays
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="beyond what torch.float16 can hold"):
        recsave.export_serving(ckpt, str(tmp_path / "kept"), "fp16")
    assert os.listdir(tmp_path / "kept") == ["notes.txt"]
    path = recsave.export_serving(ckpt, str(tmp_path / "out"), "bf16")
    assert bool(torch.isfinite(stored(path, "user", ("embedding",))["embedding"].float()).all())


def test_a_killed_exports_leftover_is_replaced_by_its_retry(source, tmp_path):
    """A killed export leaves its files without an index; the retry (under the same lock) replaces
    them. A directory holding anything else is still refused."""
    import shutil

    ckpt, _ = source
    done = recsave.export_serving(ckpt, str(tmp_path / "a"), "fp16")
    leftover = tmp_path / "b" / os.path.basename(done)
    shutil.copytree(done, leftover)
    os.remove(leftover / "index")
    path = recsave.export_serving(ckpt, str(tmp_path / "b"), "fp16")
    assert index_mod.read(path).total_bytes == index_mod.read(done).total_bytes
    theirs = tmp_path / "c" / os.path.basename(done)
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="exists already"):
        recsave.export_serving(ckpt, str(tmp_path / "c"), "fp16")
    assert os.listdir(theirs) == ["notes.txt"]


# --------------------------------------------------------------------------- fp16 / bf16 / fp32
@pytest.mark.parametrize("dtype,torch_dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                               ("fp32", torch.float32)])
def test_float_exports_load_back_as_the_cast_rows(source, tmp_path, dtype, torch_dtype):
    ckpt, _ = source
    path = recsave.export_serving(ckpt, str(tmp_path / "serve"), dtype)
    index = index_mod.read(path)
    assert sorted(index.tensors) == ["item@embedding", "item@id", "user@embedding", "user@id"]
    src = stored(ckpt, "user", ("id", "embedding"))
    got = stored(path, "user", ("id", "embedding"))
    assert torch.equal(got["id"], src["id"])
    assert got["embedding"].dtype == torch_dtype
    assert torch.equal(got["embedding"], src["embedding"].to(torch_dtype))
    assert index.meta.tables["user"].dtype == str(torch_dtype).replace("torch.", "")
    assert index.meta.tables["user"].quant is None
    fresh = Net()
    conf = None if dtype == "fp32" else {"dtype_policy": "cast"}
    Saver(fresh, output_dir=str(tmp_path / "other")).load(str(tmp_path / "serve"), load_conf=conf)
    assert torch.equal(loaded_rows(fresh.user, src["id"]), src["embedding"].to(torch_dtype).float())


# ------------------------------------------------------------------------------- model bank
def test_model_bank_loads_a_serving_checkpoint_with_patterns(source, tmp_path):
    ckpt, net = source
    recsave.export_serving(ckpt, str(tmp_path / "serve"), "int8")
    target = Net()
    saver = Saver(target, output_dir=str(tmp_path / "t"))
    entries = [{"path": str(tmp_path / "serve"), "load": ["user", "lin.*"]}]
    plan = saver.plan_model_bank(entries)
    assert sorted(plan.items) == ["lin.bias", "lin.weight", "user"]
    # The plan books codes + scale + offset + ids, which is what the load reads.
    assert plan.items["user"].nbytes == 3000 * (DIM + 4 + 8)
    report = saver.load_model_bank(entries)
    assert report.bytes_read == plan.nbytes
    assert len(target.user) == 3000 and len(target.item) == 0
    got = stored(str(tmp_path / "serve" / "ckpt_7"), "user", ("id", "embedding", "scale", "offset"))
    assert torch.equal(loaded_rows(target.user, got["id"]),
                       reference_dequant(got["embedding"], got["scale"], got["offset"]))


# ------------------------------------------------------------------------------- N -> M ranks
@pytest.mark.multirank
def test_two_rank_checkpoint_exports_and_loads_on_three_ranks(tmp_path, monkeypatch):
    from mr_worker import Model, expected_rows, global_ids
    from test_multirank import run_ranks

    codes, outs = run_ranks("save", 2, tmp_path)
    assert codes == [0, 0], outs
    path = recsave.export_serving(str(tmp_path / "out"), str(tmp_path / "serve"), "int8")
    index = index_mod.read(path)
    assert index.world_size == 2 and len(index.tensor("user@embedding").chunks) == 2
    assert all(c.buckets is not None for c in index.tensor("user@scale").chunks)
    ids_all = global_ids()
    seen = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        model = Model()  # the workers' tables and dense layer, no optimizer
        Saver(model, output_dir=str(tmp_path / f"r{rank}")).load(str(tmp_path / "serve"))
        for salt, table in ((0.0, model.user), (100.0, model.item)):
            ids = torch.sort(table.ids()).values
            owned = ids_all[partition.owner_of(ids_all, 3) == rank]
            assert ids.tolist() == sorted(owned.tolist())
            codes_, scale, offset = quantize_rows(expected_rows(ids, salt))
            assert torch.equal(loaded_rows(table, ids), reference_dequant(codes_, scale, offset))
        seen += model.user.ids().tolist()
    assert sorted(seen) == sorted(ids_all.tolist())


def test_one_rank_export_loads_on_three_ranks(source, tmp_path, monkeypatch):
    ckpt, _ = source
    path = recsave.export_serving(ckpt, str(tmp_path / "serve"), "fp16")
    src = stored(path, "user", ("id", "embedding"))
    seen = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        model = Net()
        report = Saver(model, output_dir=str(tmp_path / f"r{rank}")).load(
            str(tmp_path / "serve"), load_conf={"dtype_policy": "cast"})
        ids = torch.sort(model.user.ids()).values
        owned = src["id"][partition.owner_of(src["id"], 3) == rank]
        assert ids.tolist() == sorted(owned.tolist())
        keep = torch.isin(src["id"], ids)
        order = torch.argsort(src["id"][keep])
        assert torch.equal(loaded_rows(model.user, ids), src["embedding"][keep][order].float())
        assert report.loaded["user"].rows == owned.numel()
        seen += ids.tolist()
    assert sorted(seen) == sorted(src["id"].tolist())


# ------------------------------------------------------------------------------- index rules
def edit_index(ckpt_dir: str, **changes) -> None:
    index = read_index_json(ckpt_dir)
    index.update(changes)
    write_index_json(ckpt_dir, index)


def test_index_kind_rules(source, tmp_path):
    ckpt, _ = source
    raw = json.loads(open(os.path.join(ckpt, "index")).read())
    assert "kind" not in raw and raw["format_version"] == 4 and index_mod.read(ckpt).kind == "full"
    path = recsave.export_serving(ckpt, str(tmp_path / "serve"), "int8")
    edit_index(path, format_version=1)  # a reader of version 1 alone would misread it: never allowed
    with pytest.raises(CorruptCheckpointError, match="must have format_version > 1"):
        index_mod.read(path)
    edit_index(path, format_version=2, kind="sketch")
    with pytest.raises(FormatVersionError, match="kind 'sketch'"):
        index_mod.read(path)
    edit_index(path, format_version=3, kind="serving")  # version 3 has no bucket_segments
    with pytest.raises(CorruptCheckpointError, match="bucket_segments needs format_version 4"):
        index_mod.read(path)
    edit_index(path, format_version=4, kind="serving")
    raw = read_index_json(path)
    raw["meta"]["tables"]["user"]["quant"] = "int4"
    write_index_json(path, raw)
    with pytest.raises(FormatVersionError, match="'int4'"):
        index_mod.read(path)
    raw["meta"]["tables"]["user"]["quant"] = "int8"
    raw["tensors"]["user@scale"]["dtype"] = "bfloat16"
    write_index_json(path, raw)
    with pytest.raises(CorruptCheckpointError, match="user@scale must be float16 or float32"):
        index_mod.read(path)


def test_which_indexes_count_as_written_by_a_newer_recsave():
    from recsave.format.records import is_newer_index

    assert not is_newer_index({"format_version": 1})
    assert not is_newer_index({"format_version": 2, "kind": "serving"})  # read here
    assert is_newer_index({"format_version": 2})                         # a full index of version 2
    assert is_newer_index({"format_version": 2, "kind": "sketch"})       # a kind this recsave lacks
    assert not is_newer_index({"format_version": 3, "kind": "serving"})  # shared bucket ranges, any kind
    assert not is_newer_index({"format_version": 3})
    assert is_newer_index({"format_version": 3, "kind": "sketch"})
    assert not is_newer_index({"format_version": 4}) and not is_newer_index({"format_version": 4, "kind": "delta"})
    assert is_newer_index({"format_version": 4, "kind": "sketch"})
    assert is_newer_index({"format_version": 5, "kind": "serving"}) and is_newer_index({"format_version": 5})
    assert not is_newer_index({"format_version": "2"}) and not is_newer_index([2])


def test_argument_errors_and_existing_output(source, tmp_path):
    ckpt, _ = source
    with pytest.raises(UsageError, match="dtype must be one of"):
        recsave.export_serving(ckpt, str(tmp_path / "x"), "int4")
    with pytest.raises(ConfigError, match="no table"):
        recsave.export_serving(ckpt, str(tmp_path / "x"), "int8", tables=["nope"])
    with pytest.raises(UsageError, match="is the output dir of"):
        recsave.export_serving(ckpt, os.path.dirname(ckpt) + "/", "int8", ckpt_id="serving")
    assert not os.path.exists(os.path.join(os.path.dirname(ckpt), "serving"))
    with pytest.raises(recsave.ArgumentTypeError):
        recsave.export_serving(ckpt, str(tmp_path / "x"), 8)
    path = recsave.export_serving(ckpt, str(tmp_path / "x"), "fp16", tables="item")
    with pytest.raises(CheckpointExistsError, match="exists already"):
        recsave.export_serving(ckpt, str(tmp_path / "x"), "fp16")
    with pytest.raises(UsageError, match="not a full or delta recsave checkpoint"):
        recsave.export_serving(path, str(tmp_path / "y"), "int8")
    assert sorted(index_mod.read(path).meta.tables) == ["item"]


def test_cli_export_serving(source, tmp_path, capsys):
    ckpt, _ = source
    out = str(tmp_path / "serve")
    assert main(["export-serving", os.path.dirname(ckpt), out, "--dtype", "bf16", "--tables", "user"]) == 0
    text = capsys.readouterr().out
    assert "bf16 serving checkpoint" in text and "user: 3000 rows, dim 64" in text
    assert index_mod.read(os.path.join(out, "ckpt_7")).tensor("user@embedding").dtype == "bfloat16"
    assert main(["export-serving", ckpt, out]) == 2  # exists already
    assert "exists already" in capsys.readouterr().err
    out8 = str(tmp_path / "serve8")
    assert main(["export-serving", ckpt, out8, "--tables", "user"]) == 0
    capsys.readouterr()
    assert main(["inspect", "--json", out8]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "serving" and doc["format_version"] == 4
    assert doc["tables"]["user"]["bytes"] == 3000 * (8 + DIM + 2 + 2)  # ids, codes, scale, offset
    assert main(["inspect", out8]) == 0 and "format 4 (serving)" in capsys.readouterr().out
    assert main(["verify", out8]) == 0


def test_a_training_job_loads_a_serving_checkpoint_excluding_what_it_lacks(tmp_path):
    from helpers import make_job, table_state

    job = make_job(str(tmp_path / "run"))  # Adagrad slots, an extra and an io state registered
    job.train(3)
    ckpt = job.saver.save("ckpt_3")
    recsave.export_serving(ckpt, str(tmp_path / "serve"), "int8")
    fresh = make_job(str(tmp_path / "fresh"), seed=9)
    with pytest.raises(ConfigError, match="lacks"):  # no slots, extras or io states in it
        fresh.saver.load(str(tmp_path / "serve"))
    report = fresh.saver.load(str(tmp_path / "serve"),
                              load_conf={"exclude": ["sparse_opt", "extra", "io_state"]})
    assert "user" in report.loaded and "user@adagrad_acc" not in report.loaded
    got = stored(str(tmp_path / "serve" / "ckpt_3"), "user", ("id", "embedding", "scale", "offset"))
    want = reference_dequant(got["embedding"], got["scale"], got["offset"])
    state = table_state(fresh.model.user)
    order = torch.argsort(got["id"])
    assert torch.equal(state["@id"], got["id"][order]) and torch.equal(state["@embedding"], want[order])
    assert torch.equal(fresh.model.mlp[0].weight, job.model.mlp[0].weight)


def test_a_delta_exports_the_merged_state_of_its_chain(tmp_path):
    """A delta checkpoint exports like its compacted full checkpoint: same ids, same rows."""
    out = str(tmp_path / "train")
    net = Net()
    uid = torch.arange(400, dtype=torch.int64) * 13 + 1
    net.user.load_rows(uid, torch.randn(400, DIM, generator=torch.Generator().manual_seed(1)))
    net.item.load_rows(uid[:50], torch.randn(50, 16, generator=torch.Generator().manual_seed(2)))
    saver = Saver(net, output_dir=out, max_keep=None)
    saver.save("ckpt_1")
    net.user.load_rows(uid[:20], torch.full((20, DIM), 3.0), clear=False)
    net.user.delete(uid[390:])
    delta = saver.save("ckpt_2", incremental=True)
    saver.close()
    assert index_mod.read(delta).kind == "delta"
    via_delta = recsave.export_serving(delta, str(tmp_path / "serve_delta"), "fp32")
    full = recsave.compact(delta, str(tmp_path / "compacted"))
    via_full = recsave.export_serving(full, str(tmp_path / "serve_full"), "fp32")
    assert os.path.basename(via_delta) == "ckpt_2"
    for table in ("user", "item"):
        a, b = stored(via_delta, table, ("id", "embedding")), stored(via_full, table, ("id", "embedding"))
        assert torch.equal(a["id"], b["id"]) and torch.equal(a["embedding"], b["embedding"])
    assert sorted(stored(via_delta, "user", ("id",))["id"].tolist()) == sorted(uid[:390].tolist())
    # A delta's bad table, bad id or existing target is refused before its chain is compacted,
    # naming the source, not the temporary copy.
    with pytest.raises(ConfigError, match=f"no table.*'nope'.*{re.escape(delta)}"):
        recsave.export_serving(delta, str(tmp_path / "serve_bad"), "fp32", tables=["nope"])
    with pytest.raises(CheckpointExistsError, match="exists already"):
        recsave.export_serving(delta, str(tmp_path / "serve_delta"), "fp32")
    compacted = []
    real = recsave.tools.compact.compact
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recsave.tools.compact, "compact", lambda *a, **k: compacted.append(a) or real(*a, **k))
        with pytest.raises(UsageError):
            recsave.export_serving(delta, str(tmp_path / "serve_bad"), "fp32", ckpt_id="../x")
        with pytest.raises(ConfigError):
            recsave.export_serving(delta, str(tmp_path / "serve_bad"), "fp32", tables=["nope"])
    assert compacted == [] and not os.path.exists(tmp_path / "serve_bad")


def test_int8_rows_of_a_small_range_keep_the_bound():
    """Rows spanning less than about 4e-3 get float16 subnormal scales; rounded to nearest, a scale
    could fall below (max - offset) / 255 and the top codes clamp (errors up to a fifth of the
    row's range). Rounded up, every value stays within scale / 2 (plus float32 rounding)."""
    from recsave.format.quant import dequantize_rows, quantize_rows

    g = torch.Generator().manual_seed(7)
    spans = torch.logspace(-7, -2, 2000).unsqueeze(1)
    rows = torch.rand(2000, 16, generator=g) * spans + torch.randn(2000, 1, generator=g) * 1e-3
    codes, scale, offset = quantize_rows(rows)
    s32, o32 = scale.float(), offset.float()
    hi = rows.amax(1, keepdim=True)
    assert bool((s32 * 255 >= hi - o32).all())  # no code above 255 steps
    err = (dequantize_rows(codes, scale, offset) - rows).abs()
    slack = 2.0 ** -22 * (rows.abs() + o32.abs() + 255 * s32)
    assert bool((err <= s32 / 2 + slack).all())
    assert bool((s32 <= (hi - o32) / 255 * (1 + 2.0 ** -10) + 2.0 ** -24).all())  # one step up at most


def test_a_parquet_export_of_an_int8_serving_checkpoint_holds_the_decoded_rows(source, tmp_path):
    """Not the int8 codes: the rows a load of the serving checkpoint gives (float32)."""
    from recsave.tools.export import ParquetSource, to_parquet

    ckpt, _ = source
    serving = recsave.export_serving(ckpt, str(tmp_path / "serve"), "int8")
    to_parquet(serving, str(tmp_path / "pq"))
    out = str(tmp_path / "pq")
    manifest = json.loads((tmp_path / "pq" / "recsave_export.json").read_text())
    assert manifest["tables"]["user"]["columns"] == {"id": "int64", "embedding": "float32"}
    ids, cols = ParquetSource(out).read_table("user", ["embedding"])
    raw = stored(serving, "user", ["id", "embedding", "scale", "offset"])
    order = torch.argsort(raw["id"])
    expected = reference_dequant(raw["embedding"], raw["scale"], raw["offset"])[order]
    assert torch.equal(ids[torch.argsort(ids)], raw["id"][order])
    assert cols["embedding"].dtype == torch.float32
    assert torch.equal(cols["embedding"][torch.argsort(ids)], expected)


@pytest.mark.parametrize("spelling", ["relative", "dot", "file_url", "symlink"])
def test_the_source_output_dir_is_refused_however_it_is_spelt(source, tmp_path, monkeypatch, spelling):
    ckpt, _ = source
    job_dir = os.path.dirname(ckpt)
    before = sorted(os.listdir(job_dir))
    monkeypatch.chdir(os.path.dirname(job_dir))
    if spelling == "symlink":
        os.symlink(job_dir, tmp_path / "link")
    out = {"relative": os.path.basename(job_dir), "dot": job_dir + "/.", "file_url": "file://" + job_dir,
           "symlink": str(tmp_path / "link")}[spelling]
    with pytest.raises(UsageError, match="is the output dir of"):
        recsave.export_serving(ckpt, out, "int8", ckpt_id="serving")
    with pytest.raises(UsageError, match="lies in the checkpoint"):
        recsave.export_serving(ckpt, os.path.join(ckpt, "serving"), "int8")
    assert sorted(os.listdir(job_dir)) == before


def test_the_hints_for_values_no_narrower_dtype_holds_name_a_dtype_that_does(tmp_path):
    """Near float32's largest value bf16 overflows too, but fp32 holds it; an int8 row spanning
    more than a float32 fails with a float32 scale already, where "pass scale_dtype='float32'" was
    no help."""
    net = Net(dim=4)
    big = torch.finfo(torch.float32).max
    net.user.load_rows(torch.tensor([1, 2]), torch.tensor([[big, -big, 0.0, 1.0], [0.5, 1.0, 2.0, 3.0]]))
    ckpt = Saver(net, output_dir=str(tmp_path / "src")).save("ckpt_1")
    with pytest.raises(UsageError, match=r"beyond what torch.bfloat16 can hold \(largest 3.40282e\+38\); "
                                         r"export it as fp32\Z"):
        recsave.export_serving(ckpt, str(tmp_path / "out"), "bf16")
    with pytest.raises(UsageError, match=r"float32 scale / offset can hold; a row's span must fit a float32: "
                                         r"export with dtype='fp32'"):
        recsave.export_serving(ckpt, str(tmp_path / "out"), "int8", scale_dtype="float32")
    with pytest.raises(UsageError, match=r"float16 scale / offset can hold; pass scale_dtype='float32'"):
        recsave.export_serving(ckpt, str(tmp_path / "out"), "int8")
    path = recsave.export_serving(ckpt, str(tmp_path / "out"), "fp32")
    assert float(stored(path, "user", ("embedding",))["embedding"].max()) == big
