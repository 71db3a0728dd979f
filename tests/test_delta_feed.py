"""Parquet delta feed (recsave.export.export_delta, `recsave export --since OLD NEW OUT_DIR`): applied to
the older checkpoint's Parquet export it gives the newer one's."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import make_job, table_state

from recsave.errors import ArgumentTypeError, ConfigError, UsageError
from recsave.export import DELTA_MANIFEST, export_delta, to_parquet
from recsave.tools.cli import main
from recsave.tools.deltafeed import diff_rows


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """ckpt_4 and ckpt_8 of one job: rows trained (changed), new ids, and user ids deleted between."""
    out = str(tmp_path_factory.mktemp("run"))
    job = make_job(out, max_keep=None)
    job.train(4)
    a = job.saver.save("ckpt_4")
    before = {n: table_state(getattr(job.model, n)) for n in ("user", "item")}
    job.train(4)
    gone = before["user"]["@id"][::7]
    job.model.user.delete(gone)
    b = job.saver.save("ckpt_8")
    after = {n: table_state(getattr(job.model, n)) for n in ("user", "item")}
    return a, b, before, after, gone


def by_id(ids: np.ndarray, rows: np.ndarray) -> dict:
    return {int(i): r.tobytes() for i, r in zip(ids, rows)}


def export_rows(path: str, table: str) -> dict:
    """id -> embedding bytes of a to_parquet export's table."""
    t = pq.read_table(os.path.join(path, table))
    col = t.column("embedding").combine_chunks()
    rows = col.flatten().to_numpy().reshape(len(col), -1)
    return by_id(t.column("id").to_numpy(), rows)


def apply_feed(rows: dict, path: str) -> dict:
    """The feed's ops applied to id -> bytes, with pyarrow alone."""
    t = pq.read_table(path)
    out = dict(rows)
    ops, ids = t.column("op").to_pylist(), t.column("id").to_pylist()
    emb = t.column("embedding").to_pylist()
    for op, i, e in zip(ops, ids, emb):
        if op == "delete":
            assert e is None
            del out[i]
        else:
            assert op == "upsert"
            out[i] = np.asarray(e, dtype=np.float32).tobytes()
    return out


def test_feed_applied_to_the_old_export_equals_the_new_export(two, tmp_path):
    a, b, before, after, gone = two
    to_parquet(a, str(tmp_path / "old"))
    to_parquet(b, str(tmp_path / "new"))
    m = export_delta(a, b, str(tmp_path / "feed"), row_group_rows=17)
    assert m["format"] == "recsave.parquet.delta" and m["step"] == 8
    assert m["old"] == {"source": a, "step": 4} and m["new"] == {"source": b, "step": 8}
    assert json.loads((tmp_path / "feed" / DELTA_MANIFEST).read_text()) == m
    for name in ("user", "item"):
        path = str(tmp_path / "feed" / name / "part-00000.parquet")
        old, new = export_rows(str(tmp_path / "old"), name), export_rows(str(tmp_path / "new"), name)
        assert apply_feed(old, path) == new
        # Exactly the changed ids: new or different rows upserted, missing ones deleted.
        want_up = {i for i, r in new.items() if old.get(i) != r}
        want_del = set(old) - set(new)
        t = pq.read_table(path)
        ops = t.column("op").to_pylist()
        ids = t.column("id").to_pylist()
        assert {i for o, i in zip(ops, ids) if o == "upsert"} == want_up
        assert {i for o, i in zip(ops, ids) if o == "delete"} == want_del
        assert len(ids) == len(want_up) + len(want_del)  # each id once
        assert set(t.column("step").to_pylist()) == {8}
        assert ops == sorted(ops, reverse=True)  # upserts first
        assert m["tables"][name]["upserts"] == len(want_up) and m["tables"][name]["deletes"] == len(want_del)
        assert t.schema.field("embedding").type == pa.list_(pa.float32(), 8)
        assert t.schema.field("embedding").metadata == {b"recsave.dtype": b"float32"}
    assert m["tables"]["user"]["deletes"] == len(gone) > 0
    assert m["tables"]["item"]["deletes"] == 0 and m["tables"]["item"]["upserts"] > 0


def test_a_feed_is_refused_as_a_table_to_load(two, tmp_path):
    """A feed's table directory holds upserts (and deletes) since another checkpoint: loaded as a
    Parquet table it would replace the table with the changed rows alone."""
    a, b = two[0], two[1]
    export_delta(a, b, str(tmp_path / "feed"))
    job = make_job(str(tmp_path / "job"))
    with pytest.raises(UsageError, match="is part of an export_delta feed .*, not a table"):
        job.saver.load(str(tmp_path / "feed" / "item"), load_conf={"strict": False})
    with pytest.raises(UsageError, match="is an export_delta feed .*not a checkpoint or a table"):
        job.saver.load(str(tmp_path / "feed"), load_conf={"strict": False})  # its top folder
    # Rewritten without its metadata (a pandas or Spark round trip drops it) the feed is still
    # refused, by its string `op` and integer `step` columns; renamed, they are a table's columns.
    t = pq.read_table(str(tmp_path / "feed" / "item" / "part-00000.parquet")).replace_schema_metadata(None)
    (tmp_path / "mine").mkdir()
    pq.write_table(t, str(tmp_path / "mine" / "item.parquet"))
    before = table_state(job.model.item)
    with pytest.raises(UsageError, match="string 'op' and numeric 'step' columns"):
        job.saver.load(str(tmp_path / "mine" / "item.parquet"), load_conf={"strict": False})
    after = table_state(job.model.item)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    # As other tools write it back: `op` as view strings (polars), `step` as float64 (pandas,
    # where the feed's steps are null) or of type null.
    rewrites = [("step", pa.float64()), ("step", pa.null())]
    if hasattr(pa, "string_view"):
        rewrites.append(("op", pa.string_view()))
    for column, type_ in rewrites:
        i = t.schema.get_field_index(column)
        values = pa.nulls(len(t), type_) if pa.types.is_null(type_) else t.column(column).cast(type_)
        pq.write_table(t.set_column(i, column, values), str(tmp_path / "mine" / "item.parquet"))
        with pytest.raises(UsageError, match="is part of an export_delta feed"):
            job.saver.load(str(tmp_path / "mine" / "item.parquet"), load_conf={"strict": False})
    pq.write_table(t.rename_columns(["kind" if n == "op" else n for n in t.schema.names]),
                   str(tmp_path / "mine" / "item.parquet"))
    job.saver.load(str(tmp_path / "mine" / "item.parquet"), load_conf={"strict": False})


def test_a_feed_into_either_checkpoints_directory_is_refused(two, tmp_path):
    a, b = two[0], two[1]
    for inside in (a, b):
        with pytest.raises(UsageError, match="lies in the checkpoint"):
            export_delta(a, b, os.path.join(inside, "feed"))
        assert not os.path.exists(os.path.join(inside, "feed"))


def test_an_unchanged_checkpoint_gives_an_empty_feed(two, tmp_path):
    a = two[0]
    m = export_delta(a, a, str(tmp_path / "feed"))
    assert {n: (t["upserts"], t["deletes"]) for n, t in m["tables"].items()} == {"user": (0, 0), "item": (0, 0)}
    assert pq.read_table(str(tmp_path / "feed" / "user" / "part-00000.parquet")).num_rows == 0


def test_diff_rows_compares_bits():
    old_ids = torch.tensor([5, 1, 9, 4])
    old = torch.tensor([[0.0], [1.0], [float("nan")], [2.0]])
    new_ids = torch.tensor([9, 1, 7, 5])
    new = torch.tensor([[float("nan")], [1.5], [3.0], [-0.0]])
    ups, dels = diff_rows(old_ids, old, new_ids, new)
    assert new_ids[ups].tolist() == [1, 7, 5]  # the same NaN is no change, -0.0 is one
    assert old_ids[dels].tolist() == [4]
    ups, dels = diff_rows(torch.empty(0, dtype=torch.int64), torch.empty(0, 1), new_ids, new)
    assert ups.tolist() == [0, 1, 2, 3] and dels.tolist() == []
    ups, dels = diff_rows(old_ids, old, torch.empty(0, dtype=torch.int64), torch.empty(0, 1))
    assert ups.tolist() == [] and dels.tolist() == [0, 1, 2, 3]


def test_duckdb_reads_the_feed(two, tmp_path):
    duckdb = pytest.importorskip("duckdb")
    a, b = two[0], two[1]
    m = export_delta(a, b, str(tmp_path / "feed"), tables="user")
    path = str(tmp_path / "feed" / "user" / "part-00000.parquet")
    got = dict(duckdb.sql(f"SELECT op, count(*) FROM read_parquet('{path}') GROUP BY op").fetchall())
    assert got == {"upsert": m["tables"]["user"]["upserts"], "delete": m["tables"]["user"]["deletes"]}
    nulls = duckdb.sql(f"SELECT count(*) FROM read_parquet('{path}') WHERE embedding IS NULL").fetchall()[0][0]
    assert nulls == m["tables"]["user"]["deletes"]
    rows = duckdb.sql(f"SELECT id, embedding FROM read_parquet('{path}') WHERE op = 'upsert'").fetchall()
    t = pq.read_table(path)
    want = {i: e for o, i, e in zip(t.column("op").to_pylist(), t.column("id").to_pylist(),
                                    t.column("embedding").to_pylist()) if o == "upsert"}
    assert {i: list(e) for i, e in rows} == want

def test_cli_export_since(two, tmp_path, capsys):
    a, b = two[0], two[1]
    out = str(tmp_path / "feed")
    assert main(["export", "--since", a, os.path.dirname(b), out]) == 0  # NEW as an output dir: its latest
    text = capsys.readouterr().out
    assert "delta feed" in text and "user:" in text and "delete(s)" in text
    assert json.loads(open(os.path.join(out, DELTA_MANIFEST)).read())["new"]["source"] == b
    assert main(["export", "--since", a, b, out]) == 2  # a feed is there already
    assert "holds a delta feed already" in capsys.readouterr().err
    assert main(["export", "--since", a, b, str(tmp_path / "f2"), "--rows-per-file", "3"]) == 2


def test_a_source_that_is_no_checkpoint_is_named_for_what_it_is(two, tmp_path, capsys):
    a = two[0]
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    with pytest.raises(UsageError, match=r"model.pt is a torch.save file, not a recsave checkpoint; export_delta"):
        export_delta(str(tmp_path / "model.pt"), a, str(tmp_path / "feed"))
    assert main(["export", str(tmp_path / "model.pt"), str(tmp_path / "pq")]) == 2
    assert "is a torch.save file, not a recsave checkpoint; export takes" in capsys.readouterr().err


def test_errors(two, tmp_path):
    a, b = two[0], two[1]
    with pytest.raises(ArgumentTypeError, match="out_dir"):
        export_delta(a, b, 5)
    with pytest.raises(UsageError, match="row_group_rows"):
        export_delta(a, b, str(tmp_path / "x"), row_group_rows=0)
    with pytest.raises(ConfigError, match="no table"):
        export_delta(a, b, str(tmp_path / "x"), tables=["nope"])
    other = make_job(str(tmp_path / "other"), item_dim=4)
    other.train(1)
    c = other.saver.save("ckpt_1")
    with pytest.raises(ConfigError, match="changed from dim 8 float32 to dim 4"):
        export_delta(a, c, str(tmp_path / "y"))
    assert export_delta(a, c, str(tmp_path / "y"), tables="user")["tables"]["user"]["upserts"] > 0
    with pytest.raises(UsageError, match="not empty"):
        os.makedirs(tmp_path / "z" / "user")
        (tmp_path / "z" / "user" / "f").write_text("x")
        export_delta(a, b, str(tmp_path / "z"))


def test_a_failed_export_leaves_no_directories_it_made(two, tmp_path):
    """A failure part way (here the progress callback raising after the first row group) removes
    the files written and the directories the export made, and only those."""
    a, b = two[0], two[1]

    def fail(_rows: int) -> None:
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        export_delta(a, b, str(tmp_path / "new" / "feed"), progress=fail)
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(RuntimeError, match="stop"):
        export_delta(a, b, str(tmp_path / "mine"), progress=fail)
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]
