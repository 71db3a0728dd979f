"""Parquet export (recsave.tools.export.to_parquet), the Parquet table source (ParquetSource) and the
`recsave export` command line."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import make_job, same_bits

import recsave
from recsave import format as fmt
from recsave.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, FormatVersionError, UsageError
from recsave.load.config import TableInfo
from recsave.storage import get_storage
from recsave.tables.partition import owner_of
from recsave.tools.cli import main
from recsave.tools.export import MANIFEST, ParquetSource, is_parquet_source, to_parquet

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint of the helpers' CTR job (tables `user`, `item` with Adagrad slots), step 6."""
    out = str(tmp_path_factory.mktemp("run"))
    job = make_job(out, save_interval=None)
    job.train(6)
    return job.saver.save("ckpt_6")


def stored(ckpt_dir, table, columns=("embedding", "adagrad_acc"), storage=None):
    names = [f"{table}@id"] + [f"{table}@{c}" for c in columns]
    data = fmt.read_tensors(ckpt_dir, names, storage=storage)
    return {n.split("@", 1)[1]: t for n, t in data.items()}


def column_tensor(table: pa.Table, column: str, dtype: torch.dtype) -> torch.Tensor:
    """A fixed-size-list column as a torch tensor of `dtype` (bit patterns reinterpreted)."""
    col = table.column(column).combine_chunks()
    dim = col.type.list_size
    values = col.flatten().to_numpy(zero_copy_only=False).copy()
    signed = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[values.itemsize]
    return torch.from_numpy(values.view(signed)).view(dtype).reshape(-1, dim)


# ------------------------------------------------------------------------------------ export
def test_export_round_trips_bit_for_bit_with_plain_pyarrow(ckpt, tmp_path):
    out = str(tmp_path / "out")
    manifest = to_parquet(os.path.dirname(ckpt), out, row_group_rows=37)  # the output dir: latest
    assert manifest["format"] == "recsave.parquet" and manifest["format_version"] == 1
    assert manifest["source"] == ckpt and manifest["step"] == 6
    assert sorted(manifest["tables"]) == ["item", "user"]
    assert json.load(open(os.path.join(out, MANIFEST))) == manifest
    for name in ("user", "item"):
        want = stored(ckpt, name)
        entry = manifest["tables"][name]
        assert entry["dim"] == 8 and entry["dtype"] == "float32" and entry["slots"] == ["adagrad_acc"]
        assert entry["rows"] == want["id"].numel() > 37
        assert [f["path"] for f in entry["files"]] == [f"{name}/part-00000.parquet"]
        path = os.path.join(out, name, "part-00000.parquet")
        assert entry["files"][0]["size"] == os.path.getsize(path)
        table = pq.read_table(path)
        assert table.schema.names == ["id", "embedding", "adagrad_acc"]
        assert table.schema.field("id").type == pa.int64()
        for c in ("embedding", "adagrad_acc"):
            assert table.schema.field(c).type == pa.list_(pa.float32(), 8)
            assert table.schema.field(c).metadata == {b"recsave.dtype": b"float32"}
            assert same_bits(column_tensor(table, c, torch.float32), want[c])
        assert same_bits(torch.from_numpy(table.column("id").to_numpy().copy()), want["id"])
        meta = pq.ParquetFile(path).metadata
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        assert max(sizes) <= 37 and sum(sizes) == entry["rows"] and meta.num_row_groups > 1
        assert json.loads(table.schema.metadata[b"recsave.table"])["table"] == name
        # A dataset directory reads the same with plain pyarrow.
        assert pq.read_table(os.path.join(out, name)).num_rows == entry["rows"]


def test_tables_subset_and_split_files(ckpt, tmp_path):
    out = str(tmp_path / "out")
    manifest = to_parquet(ckpt, out, ["item"], row_group_rows=16, rows_per_file=40)
    assert sorted(os.listdir(out)) == ["item", MANIFEST]
    entry = manifest["tables"]["item"]
    files = [f["path"] for f in entry["files"]]
    assert len(files) == -(-entry["rows"] // 40) >= 2 and [f["rows"] for f in entry["files"]][0] == 40
    assert sorted(os.listdir(os.path.join(out, "item"))) == [p.split("/")[1] for p in files]
    want = stored(ckpt, "item")
    ids, cols = ParquetSource(out).read_table("item", ["adagrad_acc", "embedding"])
    assert same_bits(ids, want["id"]) and same_bits(cols["embedding"], want["embedding"])
    assert same_bits(cols["adagrad_acc"], want["adagrad_acc"])


def test_a_tables_directory_missing_files_of_its_export_is_refused(ckpt, tmp_path):
    """An export killed after some of a table's files (or a copy that lost one) left a directory
    that a load of the table's directory alone, a documented source, took for the whole table: a
    shorter table, silently. Each file records the rows the export wrote of its table, and a
    directory holding fewer is refused; one file named alone is still a source of its rows."""
    out = str(tmp_path / "out")
    manifest = to_parquet(ckpt, out, ["item"], rows_per_file=40)
    entry = manifest["tables"]["item"]
    table_dir = os.path.join(out, "item")
    assert ParquetSource(table_dir).tables()["item"].rows == entry["rows"]  # whole: fine
    os.remove(os.path.join(out, entry["files"][-1]["path"]))
    os.remove(os.path.join(out, MANIFEST))
    short = entry["rows"] - entry["files"][-1]["rows"]
    with pytest.raises(CorruptCheckpointError, match=rf"its Parquet files hold {short} rows, but recsave exported "
                                                     rf"table 'item' with {entry['rows']} \(an export interrupted"):
        ParquetSource(table_dir)
    assert [t.rows for t in ParquetSource(os.path.join(out, entry["files"][0]["path"])).tables().values()] == [40]


def test_unknown_table_and_existing_output_are_refused(ckpt, tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(ConfigError, match=r"'nope'.*\['item', 'user'\]"):
        to_parquet(ckpt, out, ["user", "nope"])
    assert not os.path.exists(os.path.join(out, "user"))  # checked before anything is written
    to_parquet(ckpt, out, ["user"])
    with pytest.raises(UsageError, match="holds an export already"):
        to_parquet(ckpt, out, ["item"])
    other = tmp_path / "other"
    (other / "user").mkdir(parents=True)
    (other / "user" / "keep.txt").write_text("x")
    with pytest.raises(UsageError, match="not empty"):
        to_parquet(ckpt, str(other))
    assert os.listdir(other) == ["user"] and os.listdir(other / "user") == ["keep.txt"]
    (other / "user" / "keep.txt").unlink()  # an empty directory is fine
    to_parquet(ckpt, str(other))
    with pytest.raises(UsageError, match="row_group_rows"):
        to_parquet(ckpt, str(tmp_path / "x"), row_group_rows=0)
    with pytest.raises(CheckpointNotFoundError):
        to_parquet(str(tmp_path / "missing"), str(tmp_path / "y"))


def test_an_export_into_a_checkpoint_directory_is_refused(ckpt, tmp_path):
    """Inside the source checkpoint (or any checkpoint), the export's files would make that
    directory hold files recsave did not write: rotation could never delete it again."""
    with pytest.raises(UsageError, match="lies in the checkpoint"):
        to_parquet(ckpt, os.path.join(ckpt, "parquet"))
    assert not os.path.exists(os.path.join(ckpt, "parquet"))


def test_failed_export_leaves_nothing_behind(ckpt, tmp_path):
    broken = str(tmp_path / "ckpt_6")
    shutil.copytree(ckpt, broken)
    index = fmt.read_index(broken)
    chunk = index.tensor("user@adagrad_acc").chunks[0]
    with open(os.path.join(broken, chunk.file), "r+b") as f:
        f.seek(chunk.offset + chunk.length - 1)
        last = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([last[0] ^ 0xFF]))
    out = tmp_path / "out"
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        to_parquet(broken, str(out), ["item", "user"], row_group_rows=30)
    assert not out.exists()  # the export created it: nothing of it remains
    to_parquet(broken, str(out), ["item"])  # the intact table exports into the same place
    assert sorted(os.listdir(out)) == ["item", MANIFEST]


def test_multi_chunk_tables_export_across_rank_boundaries(tmp_path):
    """A table written by 3 ranks (3 chunks in 3 files) exports in stored order; row groups span
    chunk boundaries and partial checksum segments."""
    ck = str(tmp_path / "ck")
    os.makedirs(ck)
    g = torch.Generator().manual_seed(3)
    parts, full = [], {"emb@id": [], "emb@embedding": [], "emb@adam_m": [], "emb@adam_v": []}
    for rank, n in enumerate([23, 0, 41]):
        tensors = {"emb@id": torch.randint(-2**62, 2**62, (n,), generator=g),
                   **{k: torch.randn(n, 5, generator=g) for k in list(full)[1:]}}
        for k, v in tensors.items():
            full[k].append(v)
        parts.append(fmt.write_shards(ck, tensors, rank=rank, segment_bytes=64))
    meta = fmt.Meta(tables={"emb": fmt.TableMeta(5, "float32", ("adam_m", "adam_v"), 64)}, dense={},
                    extras=(), io_states=())
    fmt.write_index(ck, fmt.merge_parts(parts, step=9, meta=meta, world_size=3))
    manifest = to_parquet(ck, str(tmp_path / "out"), row_group_rows=10)
    assert manifest["tables"]["emb"]["rows"] == 64 and manifest["step"] == 9
    table = pq.read_table(str(tmp_path / "out" / "emb"))
    assert same_bits(torch.from_numpy(table.column("id").to_numpy().copy()), torch.cat(full["emb@id"]))
    for c in ("embedding", "adam_m", "adam_v"):
        assert same_bits(column_tensor(table, c, torch.float32), torch.cat(full[f"emb@{c}"]))


@pytest.mark.parametrize("dtype, arrow_type", [(torch.float16, pa.float16()), (torch.bfloat16, pa.uint16())])
def test_half_precision_tables_round_trip_bit_for_bit(tmp_path, dtype, arrow_type):
    model = torch.nn.Module()
    model.emb = recsave.HashTable(6, name="emb", dtype=dtype)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(-2**62, 2**62, (300,), generator=g)
    # Every bit pattern is fair game, NaN payloads and infinities included.
    values = torch.randint(-2**15, 2**15, (300, 6), dtype=torch.int16, generator=g).view(dtype)
    slot = torch.randint(-2**15, 2**15, (300, 6), dtype=torch.int16, generator=g).view(dtype)
    model.emb.add_slot("acc")  # load_rows sets existing slots only
    model.emb.load_rows(ids, values, {"acc": slot})
    ck = recsave.Saver(model, output_dir=str(tmp_path / "run")).save("ckpt_1")
    out = str(tmp_path / "out")
    manifest = to_parquet(ck, out, row_group_rows=64)
    name = str(dtype).replace("torch.", "")
    assert manifest["tables"]["emb"]["dtype"] == name
    assert manifest["tables"]["emb"]["columns"] == {"id": "int64", "embedding": name, "acc": name}
    schema = pq.read_schema(os.path.join(out, "emb", "part-00000.parquet"))
    assert schema.field("embedding").type == pa.list_(arrow_type, 6)
    assert schema.field("acc").metadata[b"recsave.dtype"] == name.encode()
    src = ParquetSource(out)
    assert src.tables() == {"emb": TableInfo(6, name, ("acc",), 300)}
    got_ids, cols = src.read_table("emb", ["embedding", "acc"])
    want = stored(ck, "emb", ("embedding", "acc"))
    assert same_bits(got_ids, want["id"])
    assert same_bits(cols["embedding"], want["embedding"]) and same_bits(cols["acc"], want["acc"])
    assert src.bytes_for("emb", ["embedding", "acc"]) == 300 * (8 + 2 * 6 * 2)
    # One table directory alone (no manifest) reads the same through its field metadata.
    alone = ParquetSource(os.path.join(out, "emb"))
    assert alone.tables() == {"emb": TableInfo(6, name, ("acc",), 300)}
    assert same_bits(alone.read_table("emb", ["acc"])[1]["acc"], want["acc"])


# ------------------------------------------------------------------------------ ParquetSource
def clicks_table(n=500, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-2**62, 2**62, (n,), generator=g)
    emb = torch.randn(n, dim, generator=g)
    return ids, emb, pa.table({"id": pa.array(ids.numpy()),
                               "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1).numpy()), dim)})


def test_hand_made_parquet_file_with_rank_filtering(tmp_path):
    ids, emb, table = clicks_table()
    path = str(tmp_path / "clicks.parquet")
    pq.write_table(table, path, row_group_size=128)
    assert is_parquet_source(path)
    src = ParquetSource(path)
    assert src.tables() == {"clicks": TableInfo(4, "float32", (), 500)}
    all_ids, cols = src.read_table("clicks", ["embedding"])
    assert same_bits(all_ids, ids) and same_bits(cols["embedding"], emb)
    owner = owner_of(ids, 3, 64)
    seen = []
    for rank in range(3):
        got, cols = src.read_table("clicks", ["embedding"], rank=rank, world=3, num_buckets=64)
        assert same_bits(got, ids[owner == rank])
        assert same_bits(cols["embedding"], emb[owner == rank])
        seen.append(got)
    assert sorted(torch.cat(seen).tolist()) == sorted(ids.tolist())
    assert src.read_table("clicks", [])[1] == {}
    with pytest.raises(ConfigError, match="no column"):
        src.read_table("clicks", ["adagrad_acc"])
    with pytest.raises(ConfigError, match="no table"):
        src.read_table("user", ["embedding"])
    with pytest.raises(UsageError):
        src.read_table("clicks", ["embedding"], rank=3, world=3)


def test_directory_of_parquet_files_and_variable_size_lists(tmp_path):
    d = tmp_path / "feeds"
    d.mkdir()
    expected_ids, expected_emb = [], []
    for i in range(2):
        ids, emb, _ = clicks_table(n=50 + i, dim=3, seed=i)
        emb = emb.double()
        table = pa.table({"id": pa.array(ids.numpy()), "embedding": pa.array(emb.numpy().tolist()),
                          "note": pa.array(["x"] * len(ids)),  # other columns are ignored
                          "m": pa.array(emb.numpy().tolist())})  # a list<double> slot
        pq.write_table(table, str(d / f"part-{i}.parquet"))
        expected_ids.append(ids)
        expected_emb.append(emb)
    (d / "_SUCCESS").write_text("")
    assert is_parquet_source(str(d))
    src = ParquetSource(str(d))
    assert src.tables() == {"feeds": TableInfo(3, "float64", ("m",), 101)}
    ids, cols = src.read_table("feeds", ["embedding", "m"])
    assert same_bits(ids, torch.cat(expected_ids)) and same_bits(cols["embedding"], torch.cat(expected_emb))
    assert same_bits(cols["m"], torch.cat(expected_emb))


def test_bad_parquet_files_raise_clear_errors(tmp_path):
    ids, emb, good = clicks_table(n=20)

    def write(name, table):
        path = str(tmp_path / f"{name}.parquet")
        pq.write_table(table, path)
        return path

    with pytest.raises(CorruptCheckpointError, match=r"no_id.parquet: no 'id' column"):
        ParquetSource(write("no_id", good.drop_columns(["id"])))
    with pytest.raises(CorruptCheckpointError, match=r"float_id.parquet: column 'id': is double, expected int64"):
        ParquetSource(write("float_id", good.set_column(0, "id", good.column("id").cast(pa.float64(), safe=False))))
    with pytest.raises(CorruptCheckpointError, match=r"column 'embedding': is float"):
        flat = pa.table({"id": good.column("id"), "embedding": pa.array([1.0] * 20, pa.float32())})
        ParquetSource(write("flat", flat))
    ragged = pa.table({"id": pa.array([1, 2, 3], pa.int64()),
                       "embedding": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0]], pa.list_(pa.float32()))})
    src = ParquetSource(write("ragged", ragged))  # the dim comes from the first row...
    with pytest.raises(CorruptCheckpointError, match=r"ragged.parquet: column 'embedding': row 2 has 1 values, "
                                                     r"expected 2 \(a ragged list\)"):
        src.read_table("ragged", ["embedding"])  # ... and every row is checked when read
    slot = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(60, np.float32)), 3)
    with pytest.raises(CorruptCheckpointError, match=r"column 'acc': holds lists of 3 values but 'embedding' has 4"):
        ParquetSource(write("bad_slot", good.append_column("acc", slot)))
    nulls = pa.table({"id": pa.array([1, None], pa.int64()),
                      "embedding": pa.array([[1.0], [2.0]], pa.list_(pa.float32(), 1))})
    with pytest.raises(CorruptCheckpointError, match="null ids"):
        ParquetSource(write("nulls", nulls)).read_table("nulls", ["embedding"])
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(CorruptCheckpointError, match="junk.parquet: not a readable Parquet file"):
        ParquetSource(str(tmp_path / "junk.parquet"))
    with pytest.raises(CheckpointNotFoundError):
        ParquetSource(str(tmp_path / "missing.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="neither"):
        ParquetSource(str(tmp_path / "empty"))
    assert not is_parquet_source(str(tmp_path / "missing.parquet")) and not is_parquet_source(str(tmp_path / "empty"))


def test_manifest_is_checked(ckpt, tmp_path):
    out = tmp_path / "out"
    to_parquet(ckpt, str(out), ["item"])
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps(dict(manifest, format_version=2)))
    with pytest.raises(FormatVersionError, match="format_version 2"):
        ParquetSource(str(out))
    escape = [{"path": "../x", "rows": manifest["tables"]["item"]["rows"], "size": 1}]
    bad = dict(manifest, tables={"item": dict(manifest["tables"]["item"], files=escape)})
    (out / MANIFEST).write_text(json.dumps(bad))
    with pytest.raises(CorruptCheckpointError, match="not a recsave export manifest.*bad file entry"):
        ParquetSource(str(out))
    (out / MANIFEST).write_text(json.dumps(manifest))
    src = ParquetSource(str(out / MANIFEST))  # the manifest file itself works too
    with open(out / "item" / "part-00000.parquet", "ab") as f:
        f.write(b"x")
    with pytest.raises(CorruptCheckpointError, match="the manifest records"):
        src.read_table("item", ["embedding"])


def test_version_changes_with_a_new_export(ckpt, tmp_path):
    out = str(tmp_path / "out")
    to_parquet(ckpt, out, ["user"])
    v1 = ParquetSource(out).version
    assert ParquetSource(out).version == v1  # stable while nothing changes
    shutil.rmtree(out)
    to_parquet(ckpt, out, ["user"])
    assert ParquetSource(out).version != v1
    path = str(tmp_path / "t.parquet")
    pq.write_table(clicks_table(seed=1)[2], path)
    p1 = ParquetSource(path).version
    pq.write_table(clicks_table(seed=2)[2], path)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert ParquetSource(path).version != p1


# ------------------------------------------------------------------------------------ remote
def test_memory_urls(ckpt, tmp_path):
    root = f"memory://recsave-export-{uuid.uuid4().hex}"
    try:
        out = f"{root}/out"
        manifest = to_parquet(ckpt, out, row_group_rows=50)  # local -> memory
        assert is_parquet_source(out) and sorted(manifest["tables"]) == ["item", "user"]
        src = ParquetSource(out)
        want = stored(ckpt, "user")
        ids, cols = src.read_table("user", ["embedding", "adagrad_acc"])
        assert same_bits(ids, want["id"]) and same_bits(cols["adagrad_acc"], want["adagrad_acc"])
        with pytest.raises(UsageError):
            to_parquet(ckpt, out)
        # memory checkpoint -> memory export, and memory -> local
        job = make_job(f"{root}/run", save_interval=None)
        job.train(2)
        remote_ckpt = job.saver.save("ckpt_2")
        to_parquet(f"{root}/run", f"{root}/out2", ["item"], row_group_rows=7)
        to_parquet(remote_ckpt, str(tmp_path / "local"), ["item"])
        want = stored(remote_ckpt, "item", storage=get_storage(remote_ckpt))
        for path in (f"{root}/out2", str(tmp_path / "local")):
            ids, cols = ParquetSource(path).read_table("item", ["embedding"], rank=0, world=2)
            mask = owner_of(want["id"], 2) == 0
            assert same_bits(ids, want["id"][mask]) and same_bits(cols["embedding"], want["embedding"][mask])
        assert ParquetSource(f"{root}/out2/item/part-00000.parquet").tables()["part-00000"].rows == want["id"].numel()
    finally:
        get_storage(root).remove_tree(root)


# --------------------------------------------------------------------------------------- CLI
def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "recsave.tools.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_cli_export(ckpt, tmp_path):
    out = str(tmp_path / "out")
    res = run_cli("export", ckpt, out, "--tables", "user", "--row-group-rows", "40")
    assert res.returncode == 0, res.stderr
    assert "user:" in res.stdout and "1 table(s)" in res.stdout and res.stderr == ""
    assert sorted(os.listdir(out)) == [MANIFEST, "user"]
    assert pq.ParquetFile(os.path.join(out, "user", "part-00000.parquet")).metadata.row_group(0).num_rows == 40
    res = run_cli("export", str(tmp_path / "nowhere"), str(tmp_path / "o2"))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("recsave: error: ") and res.stderr.count("\n") == 1
    assert "nowhere" in res.stderr and "Traceback" not in res.stderr


def test_cli_in_process_errors(ckpt, tmp_path, capsys):
    assert main(["export", ckpt, str(tmp_path / "o"), "--tables", "user,zzz"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("recsave: error: ") and "'zzz'" in err and err.count("\n") == 1
    assert main(["export", ckpt]) == 2  # argparse usage error
    assert "OUT_DIR" in capsys.readouterr().err
    assert main(["export", ckpt, str(tmp_path / "o"), "--row-group-rows", "0"]) == 2
    assert main(["--version"]) == 0
    assert recsave.__version__ in capsys.readouterr().out


def _adam_user_model():
    """(a model of one 4-dim HashTable `user`, its SparseAdam)."""
    from recsave.optim import SparseAdam

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.user = recsave.HashTable(4, name="user")

    model = M()
    return model, SparseAdam(model, lr=0.01)


def test_converting_an_export_names_the_optimizer_step_counts_it_leaves_out(tmp_path):
    """An export records each table's sparse optimizer step count; a conversion of it into a
    checkpoint dropped them without a word (a warm start from the result counts from 0). The
    conversion carries the tables and warns naming the tables whose counts stay behind."""
    src, opt = _adam_user_model()
    src.user(torch.arange(10)).sum().backward()
    opt.step()
    recsave.Saver(src, sparse_optim=opt, output_dir=str(tmp_path / "run")).save("ckpt_1")
    export = str(tmp_path / "export")
    to_parquet(str(tmp_path / "run"), export)
    with pytest.warns(UserWarning) as caught:
        recsave.convert(export, str(tmp_path / "out"), "recsave")
    assert [str(w.message) for w in caught] == [
        f"convert: {export}: the sparse optimizer's step counts of table(s) ['user'] the export recorded are not "
        f"converted (a converted checkpoint holds its tables; load the export itself where a warm start needs them)"]


@pytest.mark.parametrize("recorded", [True, False])
def test_a_warm_start_from_an_export_with_slots_takes_the_optimizer_step_counts(tmp_path, recorded):
    """to_parquet records each table's sparse optimizer step count; a bank entry that loads a table
    with its slots from the export resumes Adam's bias correction at that count (at 0, the trained
    m and v would be corrected as if new). An export without the counts (an older recsave's) gives
    0, as before, with a warning."""
    src, opt = _adam_user_model()
    for _ in range(3):
        src.user(torch.arange(10)).sum().backward()
        opt.step()
        opt.zero_grad()
    recsave.Saver(src, sparse_optim=opt, output_dir=str(tmp_path / "run")).save("ckpt_3")
    manifest = to_parquet(str(tmp_path / "run"), str(tmp_path / "export"))
    assert manifest["tables"]["user"]["optimizer_steps"] == 3
    for bad in (-1, 1 << 63, 2.0, "3"):  # a hand-edited manifest: refused, naming the field
        edited = json.loads(json.dumps(manifest))
        edited["tables"]["user"]["optimizer_steps"] = bad
        (tmp_path / "export" / MANIFEST).write_text(json.dumps(edited))
        with pytest.raises(CorruptCheckpointError, match="optimizer_steps"):
            ParquetSource(str(tmp_path / "export"))
    (tmp_path / "export" / MANIFEST).write_text(json.dumps(manifest))
    if not recorded:
        del manifest["tables"]["user"]["optimizer_steps"]
        (tmp_path / "export" / MANIFEST).write_text(json.dumps(manifest))
    dst, dopt = _adam_user_model()
    # An export without the counts is said to be one (a warning naming the table).
    with contextlib.ExitStack() as stack:
        if recorded:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("error")
        else:
            stack.enter_context(pytest.warns(RuntimeWarning, match=r"slots of table\(s\) \['user'\]"))
        report = recsave.Saver(dst, sparse_optim=dopt, output_dir=str(tmp_path / "dst")).load_model_bank(
            [{"path": str(tmp_path / "export"), "exclude": ["sparse_optim"]}])  # the export has tables only
    assert sorted(report.loaded) == ["user", "user@adam_m", "user@adam_v"]
    assert dopt.steps == {"user": 3 if recorded else 0}
    ids = torch.arange(10)
    assert torch.equal(dst.user.export(ids)[2]["adam_m"], src.user.export(ids)[2]["adam_m"])


def test_a_cleared_load_from_an_export_starts_the_table_step_at_0(tmp_path):
    """An export holds no table step (nor row metadata): a hashtable_clear load of it replaces the
    table's step with 0, as it does from any source without one (a torch.save file without
    `<base>.step`, an older checkpoint), and its rows' last_step with 0 (age 0); the checkpoint
    itself restores its step. A merge keeps the live step, the merged ids at age 0 (docs/API.md)."""
    def model(step, ids):
        m = torch.nn.Module()
        m.user = recsave.HashTable(4, name="user")
        m.train()
        m.user.step = step
        m.user.lookup(torch.tensor(ids, dtype=torch.int64), insert=True)
        return m

    def last_steps(table):
        ids, rows = table.id_rows()
        return dict(zip(ids.tolist(), table.row_meta(rows)["last_step"].reshape(-1).tolist()))

    ckpt = recsave.Saver(model(100, [1, 2, 3]), output_dir=str(tmp_path / "run")).save("ckpt_1")
    to_parquet(ckpt, str(tmp_path / "export"))
    for path, step in ((ckpt, 100), (str(tmp_path / "export"), 0)):
        live = model(500, [4, 5])
        recsave.Saver(live, output_dir=str(tmp_path / "live")).load(load_conf={"path": path})
        assert (live.user.step, last_steps(live.user)) == (step, {1: step, 2: step, 3: step})
    live = model(500, [4, 5])
    recsave.Saver(live, output_dir=str(tmp_path / "merge")).load(
        load_conf={"path": str(tmp_path / "export"), "hashtable_clear": False})
    assert (live.user.step, last_steps(live.user)) == (500, {i: 500 for i in (1, 2, 3, 4, 5)})


def test_an_unreadable_extra_pt_costs_the_export_its_step_counts_not_its_tables(tmp_path):
    """The step counts come from extra.pt, read after the tables: a damaged one is a warning and an
    export without `optimizer_steps`, not a failed export."""
    job = make_job(str(tmp_path / "run"))
    job.train(2)
    ckpt = job.saver.save("ckpt_2")
    with open(os.path.join(ckpt, "extra.pt"), "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.warns(RuntimeWarning, match="step counts are not exported"):
        manifest = to_parquet(ckpt, str(tmp_path / "export"))
    assert manifest["tables"] and all("optimizer_steps" not in t for t in manifest["tables"].values())


def test_direct_path_loads_an_export_and_a_torch_file_as_their_own_path_does(tmp_path):
    """`direct_path=True` says the path is the checkpoint itself: a Parquet export or a torch.save
    file is one too, and loads as it does without the flag; a recsave checkpoint whose index is
    missing still says so."""
    def model(ids):
        m = torch.nn.Module()
        m.user = recsave.HashTable(4, name="user")
        m.train()
        m.user.lookup(torch.tensor(ids, dtype=torch.int64), insert=True)
        return m

    def rows(table):
        ids, r = table.id_rows()
        order = torch.argsort(ids)
        return ids[order], table.weight[r[order]]

    source = model([1, 2, 3])
    ckpt = recsave.Saver(source, output_dir=str(tmp_path / "run")).save("ckpt_1")
    to_parquet(ckpt, str(tmp_path / "export"))
    torch.save({"user.weight": torch.arange(8, dtype=torch.float32).reshape(2, 4)}, str(tmp_path / "plain.pt"))
    for path in (str(tmp_path / "export"), str(tmp_path / "plain.pt")):
        loaded = {}
        for direct in (False, True):
            live = model([7])
            report = recsave.Saver(live, output_dir=str(tmp_path / "live")).load(path, direct_path=direct)
            assert report.checkpoints == [path]
            loaded[direct] = rows(live.user)
        assert all(torch.equal(a, b) for a, b in zip(loaded[False], loaded[True]))
    assert torch.equal(loaded[True][0], torch.tensor([0, 1]))
    os.remove(os.path.join(ckpt, "index"))
    with pytest.raises(CheckpointNotFoundError, match="index"):
        recsave.Saver(model([7]), output_dir=str(tmp_path / "live")).load(ckpt, direct_path=True)
