"""Incremental (delta) checkpoints: format, save, restore of every chain member, model bank / plan /
export against the compacted checkpoint, damaged chains, retention, tools (docs/FORMAT.md section 10)."""
from __future__ import annotations

import copy
import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
import torch
from helpers import (
    CTR,
    Reader,
    assert_obj_equal,
    assert_states_equal,
    make_batch,
    make_job,
    model_state,
    read_index_json,
    tables_of,
    train_step,
    write_index_json,
)

import recsave
from recsave import Saver, knobs
from recsave.errors import CorruptCheckpointError
from recsave.format import chain, ckptlist
from recsave.format import index as index_mod
from recsave.tables.optim import SparseAdam
from recsave.tools.cli import main as cli
from recsave.tools.export import to_parquet


class Job:
    """CTR with SparseAdam, a dense Adam (extra `dense_opt`) and a reader (io state `reader`)."""

    def __init__(self, out: str, seed: int = 0, max_keep=None):
        self.model = CTR(seed=seed)
        self.sparse = SparseAdam(self.model, lr=0.01)
        self.dense = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.reader = Reader()
        self.saver = Saver(self.model, sparse_optim=self.sparse, output_dir=out, max_keep=max_keep, concurrency=2)
        self.saver.register_for_checkpointing("dense_opt", self.dense)
        self.saver.register_io_state("reader", self.reader)

    def step(self, batch: int = 32) -> None:
        self.model.train()
        train_step(self.model, [self.dense, self.sparse], make_batch(self.reader.offset, batch))
        self.reader.offset += 1

    def state(self):
        out = {"model": model_state(self.model), "meta": {}, "dense_opt": copy.deepcopy(self.dense.state_dict()),
               "sparse_opt": copy.deepcopy(self.sparse.state_dict()), "reader": self.reader.offset}
        for name, table in tables_of(self.model).items():
            ids = torch.sort(table.ids()).values
            for m, v in table.row_meta(table.lookup(ids, insert=False)).items():
                out["meta"][f"{name}@{m}"] = v
            out["meta"][f"{name}@step"] = torch.tensor(table.step)
        return out


def assert_same(a, b, what):
    assert_states_equal(a["model"], b["model"], f"{what} model")
    assert_states_equal(a["meta"], b["meta"], f"{what} row metadata")
    assert_obj_equal(a["dense_opt"], b["dense_opt"], f"{what} dense_opt")
    assert_obj_equal(a["sparse_opt"], b["sparse_opt"], f"{what} sparse_opt")
    assert a["reader"] == b["reader"], what


def restored(out: str, ckpt_id: str, **load):
    job = Job(out, seed=7)
    job.saver.load(ckpt_id=ckpt_id, **load)
    return job


def build_chain(out: str, deltas: int = 10, *, async_every: int = 3):
    """A full checkpoint then `deltas` deltas, small batches between them (a few % of the rows),
    ids deleted and evicted in between, some saves async. Returns (job, {id: state at its save})."""
    job = Job(out)
    for _ in range(30):
        job.step()
    states = {}
    job.saver.save("ckpt_0", incremental=True)
    assert job.saver.last_save_kind == "full"  # no parent yet
    states["ckpt_0"] = job.state()
    for k in range(1, deltas + 1):
        job.step(batch=4)
        if k % 4 == 2:
            job.model.user.delete(job.model.user.ids()[:3])
        if k % 4 == 3:
            job.model.item.evict(older_than_steps=25)
        ckpt_id = f"ckpt_{k}"
        if k % async_every == 0:
            _, write = job.saver.async_save(ckpt_id, incremental=True)
            states[ckpt_id] = job.state()
            job.step(batch=4)  # trains while the write runs: lands in the next delta
            write.result()
        else:
            job.saver.save(ckpt_id, incremental=True)
            states[ckpt_id] = job.state()
        assert job.saver.last_save_kind == "delta", ckpt_id
    return job, states


@pytest.fixture(scope="module")
def chain_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("chain") / "out")
    job, states = build_chain(out)
    job.saver.close()
    return out, states


def test_every_chain_member_restores_bit_exact(chain_dir):
    out, states = chain_dir
    for ckpt_id, state in states.items():
        assert_same(state, restored(out, ckpt_id).state(), ckpt_id)


def test_delta_index_format(chain_dir, tmp_path):
    out, _ = chain_dir
    full = index_mod.read(os.path.join(out, "ckpt_0"))
    raw = json.loads(open(os.path.join(out, "ckpt_0", "index"), "rb").read())
    assert "kind" not in raw and "parent" not in raw and full.format_version == 4 and full.kind == "full"
    assert {"user@last_step", "user@count", "item@last_step", "item@count"} <= set(full.tensors)
    assert full.tensor("user@last_step").shape == (full.meta.tables["user"].rows, 1)
    d5 = index_mod.read(os.path.join(out, "ckpt_5"))
    raw5 = json.loads(open(os.path.join(out, "ckpt_5", "index"), "rb").read())
    assert list(raw5)[:3] == ["magic", "format_version", "kind"]
    assert (d5.format_version, d5.kind, d5.base) == (4, "delta", "ckpt_0")
    assert d5.parent.id == "ckpt_4" and d5.parent.crc32c == chain.index_crc(recsave.storage.get_storage(out),
                                                                             os.path.join(out, "ckpt_4"))
    assert d5.tensor("user@id").shape[0] < full.tensor("user@id").shape[0] / 4
    assert d5.total_bytes < full.total_bytes / 2
    user = d5.meta.tables["user"]
    assert user.cleared is False and user.tombstones == d5.tensor("user@tombstone").shape[0]
    assert chain.members(recsave.storage.get_storage(out), out, "ckpt_5") == [f"ckpt_{i}" for i in range(6)]
    # parse -> dumps reproduces a delta's index byte for byte
    data = open(os.path.join(out, "ckpt_5", "index"), "rb").read()
    assert index_mod.dumps(index_mod.parse(data, "x")) == data


def test_tombstones_and_evictions_are_restored(chain_dir):
    out, states = chain_dir
    d = index_mod.read(os.path.join(out, "ckpt_2"))
    assert d.meta.tables["user"].tombstones == 3
    got = restored(out, "ckpt_2")
    assert len(got.model.user) == states["ckpt_2"]["model"]["user@id"].numel()
    d3 = index_mod.read(os.path.join(out, "ckpt_3"))
    assert d3.meta.tables["item"].tombstones > 0  # evicted ids


def test_baseline_unknown_saves_full(tmp_path):
    out = str(tmp_path / "out")
    job = Job(out)
    job.step()
    job.saver.save("a", incremental=True)
    assert job.saver.last_save_kind == "full"
    job.step()
    job.saver.save("b", incremental=True)
    assert job.saver.last_save_kind == "delta"
    job.model.user.take_changes()  # someone else moved the baseline
    job.saver.save("c", incremental=True)
    assert job.saver.last_save_kind == "full"
    assert index_mod.read(os.path.join(out, "c")).kind == "full"
    job.saver.save("d", incremental=False)
    assert job.saver.last_save_kind == "full"
    job.saver.load_model_bank([{"path": out}])
    job.saver.save("e", incremental=True)
    assert job.saver.last_save_kind == "full"
    with knobs.override(track_changes=False):
        job2 = Job(str(tmp_path / "out2"))
        job2.step()
        job2.saver.save("a", incremental=True)
        job2.saver.save("b", incremental=True)
        assert job2.saver.last_save_kind == "full"


def test_failed_save_makes_the_next_one_full(tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    job = Job(out)
    job.step()
    job.saver.save("a", incremental=True)
    job.step()

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")
    monkeypatch.setattr(recsave.save.pipeline, "write_shards", boom)
    with pytest.raises(OSError):
        job.saver.save("b", incremental=True)
    monkeypatch.undo()
    job.saver.save("b", incremental=True)
    assert job.saver.last_save_kind == "full"
    state = job.state()
    assert_same(state, restored(out, "b").state(), "b")


def test_restore_then_delta(chain_dir, tmp_path):
    out, states = chain_dir
    mine = str(tmp_path / "out")
    shutil.copytree(out, mine)
    job = Job(mine, seed=3)
    job.saver.load(ckpt_id="ckpt_10")
    assert_same(states["ckpt_10"], job.state(), "restore")
    job.step(batch=4)
    job.saver.save("ckpt_11", incremental=True)
    assert job.saver.last_save_kind == "delta"
    assert index_mod.read(os.path.join(mine, "ckpt_11")).parent.id == "ckpt_10"
    assert_same(job.state(), restored(mine, "ckpt_11").state(), "ckpt_11")


def test_old_checkpoint_without_metadata_loads_zeros(tmp_path):
    out = str(tmp_path / "out")
    job = Job(out)
    job.step()
    job.saver.save("a")
    path = os.path.join(out, "a", "index")
    raw = read_index_json(os.path.join(out, "a"))  # an older recsave's index: no seal either
    for t in ("user", "item"):
        for m in ("last_step", "count"):
            del raw["tensors"][f"{t}@{m}"]
        del raw["meta"]["tables"][t]["step"]
    open(path, "w").write(json.dumps(raw))
    got = restored(out, "a")
    table = got.model.user
    meta = table.row_meta(table.lookup(table.ids(), insert=False))
    assert len(table) and not meta["last_step"].any() and not meta["count"].any()
    assert_states_equal(model_state(job.model), model_state(got.model))


def test_model_bank_plan_and_export_equal_the_compacted(chain_dir, tmp_path):
    out, _ = chain_dir
    compact_dir = str(tmp_path / "compact")
    path = recsave.compact(os.path.join(out, "ckpt_7"), compact_dir)
    assert path == os.path.join(compact_dir, "ckpt_7")
    assert ckptlist.read(recsave.storage.get_storage(compact_dir), compact_dir) == ["ckpt_7"]
    assert index_mod.read(path).kind == "full"
    assert recsave.tools.catalog.verify(path) == []
    entries = [{"path": os.path.join(out, "ckpt_7"), "load": ["sparse", "sparse_opt"], "exclude": ["item*"]},
               {"path": os.path.join(out, "ckpt_7"), "load": ["item*", "dense"], "strict": False}]
    centries = [dict(e, path=path) for e in entries]

    results = []
    for es in (entries, centries):
        bank = CTR(seed=9)
        saver = Saver(bank, sparse_optim=SparseAdam(bank, lr=0.01), output_dir=str(tmp_path / "x"))
        plan = saver.plan_model_bank(es)
        saver.execute_plan(plan)
        results.append(({n: (it.category, it.source, it.rows) for n, it in plan.items.items()},
                        model_state(bank), {n: t.step for n, t in tables_of(bank).items()}))
    assert results[0][0] == results[1][0]
    assert_states_equal(results[0][1], results[1][1], "model bank")
    assert results[0][2] == results[1][2]
    # Parquet export: the same rows in the same order
    to_parquet(os.path.join(out, "ckpt_7"), str(tmp_path / "pq_delta"))
    to_parquet(path, str(tmp_path / "pq_full"))
    for table in ("user", "item"):
        a = pq.read_table(str(tmp_path / "pq_delta" / table))
        b = pq.read_table(str(tmp_path / "pq_full" / table))
        assert a.num_rows == b.num_rows > 0 and a.equals(b)


def test_compacted_restores_like_the_delta(chain_dir, tmp_path):
    out, states = chain_dir
    path = recsave.compact(os.path.join(out, "ckpt_9"), str(tmp_path / "c"))
    assert_same(states["ckpt_9"], restored(str(tmp_path / "c"), "ckpt_9").state(), "compacted")
    assert cli(["compact", os.path.join(out, "ckpt_4"), str(tmp_path / "c")]) == 0
    assert ckptlist.read(recsave.storage.get_storage(path), str(tmp_path / "c")) == ["ckpt_9", "ckpt_4"]


@pytest.mark.parametrize("damage", ["missing", "rewritten", "shard"])
def test_damaged_parent(chain_dir, tmp_path, damage):
    out, states = chain_dir
    mine = str(tmp_path / "out")
    shutil.copytree(out, mine)
    parent = os.path.join(mine, "ckpt_4")
    if damage == "missing":
        shutil.rmtree(parent)
    elif damage == "rewritten":
        write_index_json(parent, read_index_json(parent), sealed=False, indent=1)  # same content, other bytes
    else:
        shard = next(f for f in sorted(os.listdir(parent)) if f.endswith(".safetensors"))
        with open(os.path.join(parent, shard), "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\xff\xff\xff\xff")
    match = "ckpt_4"
    with pytest.raises(CorruptCheckpointError, match=match):
        restored(mine, "ckpt_6")
    problems = recsave.tools.catalog.verify(os.path.join(mine, "ckpt_6"))
    assert problems and any("ckpt_4" in p for p in problems)
    if damage != "shard":
        # fallback skips every checkpoint whose chain is broken: ckpt_10 .. ckpt_5 need ckpt_4
        job = Job(mine, seed=7)
        with pytest.warns(RuntimeWarning):
            job.saver.load(fallback=True)
        want = "ckpt_4" if damage == "rewritten" else "ckpt_3"  # a rewritten index still loads itself
        assert_same(states[want], job.state(), "fallback")


def test_max_keep_keeps_the_chain_and_gc_agrees(tmp_path):
    out = str(tmp_path / "out")
    job = Job(out, max_keep=2)
    job.step()
    job.saver.save("ckpt_0", incremental=True)
    for k in range(1, 5):
        job.step(batch=4)
        job.saver.save(f"ckpt_{k}", incremental=True)
    st = recsave.storage.get_storage(out)
    # the two latest, and the chain they need (listed: `recsave ls` says why each is kept)
    assert ckptlist.read(st, out) == [f"ckpt_{k}" for k in range(5)]
    kept = {c["id"]: c["kept"] for c in recsave.tools.catalog.list_checkpoints(out)}
    assert "latest" in kept["ckpt_4"] and "needed by ckpt_1" in kept["ckpt_0"]
    on_disk = sorted(n for n in os.listdir(out) if n.startswith("ckpt_"))
    assert on_disk == [f"ckpt_{k}" for k in range(5)]  # ckpt_3 needs all of them
    job.saver.close()
    assert recsave.tools.catalog.collect_garbage(out) == []
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt_")) == on_disk
    # Unlisted chain members (a list rewritten by hand) are still never deleted while needed
    ckptlist.write(st, out, ["ckpt_3", "ckpt_4"])
    assert ckptlist.collect_garbage(st, out, ["ckpt_3", "ckpt_4"]) == []
    # A full save starts a new chain: the old one goes once no kept checkpoint needs it
    job.saver.save("ckpt_5")
    job.step(batch=4)
    job.saver.save("ckpt_6", incremental=True)
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt_")) == ["ckpt_5", "ckpt_6"]
    assert index_mod.read(os.path.join(out, "ckpt_6")).parent.id == "ckpt_5"


def test_describe_and_inspect_json(chain_dir, capsys):
    out, _ = chain_dir
    d = recsave.describe(os.path.join(out, "ckpt_3"))
    assert d["kind"] == "delta" and d["parent"]["id"] == "ckpt_2" and d["base"] == "ckpt_0"
    assert d["chain"] == ["ckpt_0", "ckpt_1", "ckpt_2", "ckpt_3"]
    ckpt = os.path.join(out, "ckpt_3")  # its own files: those the index lists, and the index
    assert d["bytes"] == index_mod.read(ckpt).total_bytes + os.path.getsize(os.path.join(ckpt, "index"))
    assert d["tables"]["item"]["tombstones"] > 0 and d["tables"]["item"]["rows"] > 0
    full = recsave.describe(os.path.join(out, "ckpt_0"))
    assert (full["kind"], full["parent"], full["base"], full["chain"]) == ("full", None, "ckpt_0", ["ckpt_0"])
    assert cli(["inspect", "--json", os.path.join(out, "ckpt_3")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["chain"] == d["chain"] and doc["tables"]["user"]["tombstones"] == d["tables"]["user"]["tombstones"]
    assert cli(["inspect", os.path.join(out, "ckpt_3")]) == 0
    assert "ckpt_0 <- ckpt_1 <- ckpt_2 <- ckpt_3" in capsys.readouterr().out
    assert cli(["verify", os.path.join(out, "ckpt_3")]) == 0


def test_cleared_table_is_a_cleared_delta(tmp_path):
    out = str(tmp_path / "out")
    job = Job(out)
    job.step()
    job.saver.save("a", incremental=True)
    job.model.user.clear()
    job.step(batch=4)
    job.saver.save("b", incremental=True)
    idx = index_mod.read(os.path.join(out, "b"))
    assert idx.kind == "delta" and idx.meta.tables["user"].cleared and not idx.meta.tables["item"].cleared
    assert_same(job.state(), restored(out, "b").state(), "cleared")


def test_restore_applies_deltas_to_the_base_in_place(chain_dir, monkeypatch):
    """A restore reads the bases straight into the tables, all in one pass, and applies each delta
    with table ops: it never builds the merged rows (a second copy of the table), and reads each
    member's files once."""
    out, states = chain_dir
    import recsave.format.reader as reader_mod
    from recsave.load import merge

    def no_merge(*args, **kwargs):
        raise AssertionError("merged_table used by a restore")
    monkeypatch.setattr(merge, "merged_table", no_merge)
    opened = []
    real_open = recsave.storage.local.LocalStorage.open_shard

    def open_shard(self, path, size=None):
        opened.append(path)
        return real_open(self, path, size)
    monkeypatch.setattr(recsave.storage.local.LocalStorage, "open_shard", open_shard)
    assert reader_mod  # the engine reads through Storage.open_shard
    batches = []
    real_prepare = recsave.HashTable.prepare_loads

    def prepare_loads(requests, fill):
        batches.append(sorted(table.name for table, _, _ in requests))
        return real_prepare(requests, fill)
    monkeypatch.setattr(recsave.HashTable, "prepare_loads", staticmethod(prepare_loads))
    got = restored(out, "ckpt_6")
    assert_same(states["ckpt_6"], got.state(), "in place")
    # Every table's base in one pass (the id maps rebuilt while the columns are read), as a full
    # checkpoint's tables are restored
    assert batches == [sorted(tables_of(got.model))]
    # A delta's files are read once; the base's twice (ids, then the columns while the ids hash)
    for path in set(opened):
        assert opened.count(path) == (2 if "/ckpt_0/" in path else 1), path
    assert {os.path.basename(os.path.dirname(p)) for p in opened} == {f"ckpt_{i}" for i in range(7)}


def test_delta_chain_on_fsspec_memory(tmp_path):
    """Chains resolve through fsspec storage too (parents next to the delta, CRC of their index)."""
    import uuid

    out = f"memory://recsave-delta-{uuid.uuid4().hex}"
    job = Job(out, max_keep=1)
    job.step()
    job.saver.save("ckpt_0", incremental=True)
    states = {}
    for k in (1, 2):
        job.step(batch=4)
        job.saver.save(f"ckpt_{k}", incremental=True)
        assert job.saver.last_save_kind == "delta"
        states[k] = job.state()
    assert [os.path.basename(p) for p in job.saver.checkpoints()] == ["ckpt_0", "ckpt_1", "ckpt_2"]  # the chain
    assert recsave.describe(out)["chain"] == ["ckpt_0", "ckpt_1", "ckpt_2"]
    assert_same(states[2], restored(out, "ckpt_2").state(), "memory://")


def test_changed_slots_save_full(tmp_path):
    out = str(tmp_path / "out")
    job = Job(out)
    job.step()
    job.saver.save("a", incremental=True)
    job.model.user.add_slot("extra_slot", 1.0)
    job.saver.save("b", incremental=True)
    assert job.saver.last_save_kind == "full"
    job.saver.save("c", incremental=True)
    assert job.saver.last_save_kind == "delta"
    assert_same(job.state(), restored_with_slot(out, "c").state(), "c")


def restored_with_slot(out, ckpt_id):
    job = Job(out, seed=7)
    job.model.user.add_slot("extra_slot", 1.0)
    job.saver.load(ckpt_id=ckpt_id)
    return job


def test_async_delta_stages_only_the_changed_rows(chain_dir, tmp_path):
    out, _ = chain_dir
    mine = str(tmp_path / "out")
    shutil.copytree(out, mine)
    job = Job(mine, seed=3)
    job.saver.load(ckpt_id="ckpt_10")
    job.step(batch=2)
    changed = sum(int(t.pending_changes().ids.numel()) for t in tables_of(job.model).values())
    _, write = job.saver.async_save("ckpt_11", incremental=True)
    write.result()
    assert job.saver.last_save_kind == "delta"
    table_bytes = sum(sum(c.nbytes for c in t.columns().values()) for t in tables_of(job.model).values())
    row_bytes = 3 * 8 * 4 + 2 * 8  # embedding, adam_m, adam_v (dim 8, float32), last_step, count
    dense = sum(t.nbytes for t in job.model.state_dict().values() if isinstance(t, torch.Tensor))
    staged = job.saver._stager.nbytes - dense
    assert 0 < staged <= 2 * changed * row_bytes and staged < table_bytes / 4
    assert_same(job.state(), restored(mine, "ckpt_11").state(), "async delta")


def test_compact_refuses_an_existing_checkpoint(chain_dir, tmp_path, capsys):
    out, _ = chain_dir
    target = str(tmp_path / "c")
    recsave.compact(os.path.join(out, "ckpt_2"), target)
    with pytest.raises(recsave.CheckpointExistsError, match="ckpt_2"):
        recsave.compact(os.path.join(out, "ckpt_2"), target)
    assert cli(["compact", os.path.join(out, "ckpt_2"), target]) == 2
    assert "exists already" in capsys.readouterr().err


def test_compact_refuses_a_directory_of_the_same_name_that_recsave_did_not_write(chain_dir, tmp_path):
    """A user's folder named like the checkpoint in the target dir (a Parquet export) is refused,
    as a save refuses one: only a leftover of an interrupted compaction is replaced."""
    out, _ = chain_dir
    theirs = tmp_path / "exports" / "ckpt_2"
    theirs.mkdir(parents=True)
    (theirs / "recsave_export.json").write_text("{}")
    with pytest.raises(recsave.CheckpointExistsError, match="holds files recsave did not write"):
        recsave.compact(os.path.join(out, "ckpt_2"), str(tmp_path / "exports"))
    assert os.listdir(theirs) == ["recsave_export.json"]
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "ckpt_2").write_text("a file of that name")  # never removed either
    with pytest.raises(recsave.CheckpointExistsError, match="is a file or holds files recsave did not write"):
        recsave.compact(os.path.join(out, "ckpt_2"), str(tmp_path / "files"))
    assert (tmp_path / "files" / "ckpt_2").read_text() == "a file of that name"



@pytest.mark.parametrize("into", ["ckpt_0", "ckpt_0/sub/deeper", "ckpt_2/sub"])
def test_compact_refuses_an_out_dir_that_is_or_lies_in_a_checkpoint(chain_dir, into):
    """Compacting into another checkpoint's directory, a folder inside one, or the source's, would
    write a `checkpoint` file and a checkpoint into it (that checkpoint then holds files recsave
    did not write: its job's rotation and gc never delete it); refused before anything is written."""
    out, _ = chain_dir
    target = os.path.join(out, *into.split("/"))
    before = {d: sorted(os.listdir(os.path.join(out, d))) for d in ("ckpt_0", "ckpt_2")}
    with pytest.raises(recsave.UsageError, match="lies in the checkpoint"):
        recsave.compact(os.path.join(out, "ckpt_2"), target)
    assert {d: sorted(os.listdir(os.path.join(out, d))) for d in ("ckpt_0", "ckpt_2")} == before

def test_a_failed_compaction_leaves_nothing_and_its_retry_works(chain_dir, tmp_path, monkeypatch):
    import recsave.tools.compact as compact_mod

    out, _ = chain_dir
    target = tmp_path / "c"
    real = compact_mod._write

    def fail(*args, **kwargs):
        real(*args, **kwargs)  # every file written, then the failure before the index
        raise OSError(28, "No space left on device (injected)")
    monkeypatch.setattr(compact_mod, "_write", fail)
    with pytest.raises(OSError, match="injected"):
        recsave.compact(os.path.join(out, "ckpt_2"), str(target / "deeper"))
    assert not target.exists()  # neither the checkpoint nor the directories it made
    with pytest.raises(OSError, match="injected"):
        recsave.compact(os.path.join(out, "ckpt_2"), str(target))
    assert not target.exists()
    monkeypatch.setattr(compact_mod, "_write", real)
    (target / "ckpt_2").mkdir(parents=True)  # a crash's leftover (no index) does not block a compaction either
    (target / "ckpt_2" / "sparse-0-0.safetensors").write_bytes(b"partial")
    path = recsave.compact(os.path.join(out, "ckpt_2"), str(target))
    assert (target / "checkpoint").read_text().split() == ["ckpt_2"]
    assert "sparse-0-0.safetensors" not in os.listdir(path) or os.path.getsize(
        os.path.join(path, "sparse-0-0.safetensors")) > len(b"partial")


def test_a_compaction_racing_another_never_removes_its_committed_checkpoint(chain_dir, tmp_path, monkeypatch):
    """Both pass the first check before the writer lock; the second finds, under the lock, the
    first one's committed checkpoint: refused, and nothing of the first's is touched."""
    import recsave.tools.compact as compact_mod

    out, _ = chain_dir
    src, target = os.path.join(out, "ckpt_2"), str(tmp_path / "c")
    real_hold = compact_mod.hold_writer_lock
    first: list = []

    def hold(current, storage, out_dir):
        if not first:  # the other compaction runs to its end while this one waits for the lock
            first.append("running")
            first.append(recsave.compact(src, target))
        return real_hold(current, storage, out_dir)
    monkeypatch.setattr(compact_mod, "hold_writer_lock", hold)
    with pytest.raises(recsave.CheckpointExistsError, match="exists already"):
        recsave.compact(src, target)
    assert (tmp_path / "c" / "checkpoint").read_text().split() == ["ckpt_2"]
    assert (tmp_path / "c" / "ckpt_2" / "index").is_file()


def test_compact_refuses_a_source_named_like_the_output_dirs_files(chain_dir, tmp_path):
    out, _ = chain_dir
    named = tmp_path / "keep" / "checkpoint"
    shutil.copytree(os.path.join(out, "ckpt_0"), named)
    with pytest.raises(recsave.UsageError, match="checkpoint id 'checkpoint' is not usable"):
        recsave.compact(str(named), str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


def test_parquet_delta_feed_between_chain_members(chain_dir, tmp_path):
    """The Parquet delta feed (recsave export --since) takes delta checkpoints like full ones."""
    from recsave.tools.deltafeed import export_delta

    out, _ = chain_dir
    c4 = recsave.compact(os.path.join(out, "ckpt_4"), str(tmp_path / "c"))
    c7 = recsave.compact(os.path.join(out, "ckpt_7"), str(tmp_path / "c"))
    a = export_delta(os.path.join(out, "ckpt_4"), os.path.join(out, "ckpt_7"), str(tmp_path / "feed_delta"))
    b = export_delta(c4, c7, str(tmp_path / "feed_full"))
    for name in ("user", "item"):
        assert {k: v for k, v in a["tables"][name].items() if k != "files"} == \
            {k: v for k, v in b["tables"][name].items() if k != "files"}


def test_tablelike_tables_save_full(tmp_path):
    """A TableLike table without change tracking: every incremental save is full, and it restores."""
    from tablelike_table import TensorTable

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t = TensorTable(4, name="t", slots={"acc": 0.5})
            self.lin = torch.nn.Linear(2, 2)

    m = M()
    m.t.load_rows(torch.arange(10) * 3, torch.randn(10, 4), {"acc": torch.rand(10, 4)})
    saver = Saver(m, output_dir=str(tmp_path / "out"))
    saver.save("a", incremental=True)
    saver.save("b", incremental=True)
    assert saver.last_save_kind == "full"
    assert index_mod.read(str(tmp_path / "out" / "b")).kind == "full"
    m2 = M()
    Saver(m2, output_dir=str(tmp_path / "out")).load()
    assert_states_equal(m.t.state(), m2.t.state(), "TableLike")


@pytest.mark.parametrize("out", ["run", "./run", "run/"])
def test_a_restore_from_a_relative_output_dir_is_the_next_deltas_baseline(tmp_path, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    job = make_job(out, max_keep=None)
    job.train(2)
    job.saver.save("ckpt_2")
    job.saver.close()
    again = make_job(out, max_keep=None)
    again.saver.load()
    again.train(1)
    again.saver.save("ckpt_3", incremental=True)
    assert again.saver.last_save_kind == "delta"


def test_a_delta_of_this_savers_checkpoint_parses_no_index(tmp_path, monkeypatch):
    """The parent's index this Saver committed is known by the CRC32C of its bytes: a delta save
    reads them to check, and parses nothing. The chain records that CRC and the chain's base."""
    out = str(tmp_path / "out")
    job = Job(out)
    job.step()
    job.saver.save("a")
    job.step(batch=4)
    job.saver.save("b", incremental=True)  # a delta of a full
    parsed = []
    real = index_mod._parse
    monkeypatch.setattr(index_mod, "_parse", lambda data, path: parsed.append(path) or real(data, path))
    job.step(batch=4)
    job.saver.save("c", incremental=True)  # a delta of a delta
    assert job.saver.last_save_kind == "delta"
    assert parsed == []
    monkeypatch.undo()
    c = index_mod.read(os.path.join(out, "c"))
    b_crc = chain.index_crc(job.saver.storage, os.path.join(out, "b"))
    assert (c.parent.id, c.parent.crc32c, c.base) == ("b", b_crc, "a")
    state = job.state()
    assert_same(state, restored(out, "c").state(), "c")


def test_a_parent_index_rewritten_since_makes_the_next_save_full(tmp_path):
    """Other bytes in the parent's index than this Saver committed (another writer saved the id
    again, or a copy over it): a delta of it could restore rows this model never had, so the save
    is full; so is one whose parent's index no longer reads."""
    out = str(tmp_path / "out")
    job = Job(out)
    job.step()
    job.saver.save("a")
    path = os.path.join(out, "a", index_mod.INDEX_FILE)
    raw = json.loads(open(path, "rb").read())
    raw.pop("index_crc32c")
    raw["created_at"] = "2001-01-01T00:00:00Z"
    rewritten = index_mod.dumps(index_mod.validate(raw, path))
    with open(path, "wb") as f:
        f.write(rewritten)
    job.step(batch=4)
    job.saver.save("b", incremental=True)
    assert job.saver.last_save_kind == "full"
    assert index_mod.read(os.path.join(out, "b")).parent is None
    assert_same(job.state(), restored(out, "b").state(), "b")
    job.step(batch=4)
    job.saver.save("b2", incremental=True)  # b is this Saver's own: a delta of it
    assert job.saver.last_save_kind == "delta"
    assert_same(job.state(), restored(out, "b2").state(), "b2")
    b_path = os.path.join(out, "b2", index_mod.INDEX_FILE)  # the next delta's parent
    with open(b_path, "wb") as f:
        f.write(json.dumps({"magic": "not an index"}).encode())
    job.step(batch=4)
    job.saver.save("c", incremental=True)
    assert job.saver.last_save_kind == "full"



def test_the_destination_walk_stops_at_the_root_not_the_working_directory(chain_dir, tmp_path, monkeypatch):
    """Run from inside a checkpoint directory: the walk up an absolute destination's parents ends
    at "/", never at the working directory (splitting "" gave it), so the destination is taken."""
    out, _ = chain_dir
    monkeypatch.chdir(os.path.join(out, "ckpt_0"))
    path = recsave.compact(os.path.join(out, "ckpt_2"), str(tmp_path / "elsewhere"))
    assert os.path.exists(os.path.join(path, "index"))


def _adagrad_job(out: str):
    from recsave.tables.optim import SparseAdagrad
    table = recsave.HashTable(4, name="t")
    model = torch.nn.ModuleDict({"t": table})
    return model, SparseAdagrad(model, lr=0.1), Saver(model, SparseAdagrad(model, lr=0.1), output_dir=out,
                                                       max_keep=None)


def test_a_share_only_load_is_no_baseline_for_a_whole_table_delta(tmp_path, monkeypatch):
    """RANK / WORLD_SIZE set without a process group: a load reads rank 0's share of the tables.
    A later one-process save of them (shard_num=1) must not be a delta of that checkpoint: the
    delta would hold no tombstones for the other rank's rows (never deleted, only not loaded),
    and its restore would bring them back from the parent."""
    out = str(tmp_path / "run")
    model, _, saver = _adagrad_job(out)
    model["t"](torch.arange(40))
    saver.save("c0")
    saver.close()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model, _, saver = _adagrad_job(out)
    saver.load(ckpt_id="c0")
    assert model["t"].partition == (0, 2, 4096) and 0 < len(model["t"]) < 40
    candidates = torch.arange(1000, 1100)
    new_id = candidates[recsave.partition.owner_of(candidates, 2) == 0][:1]
    model["t"](torch.cat([model["t"].ids()[:1], new_id]))  # a change, and a new id of rank 0's
    saver.save("c1", shard_id=0, shard_num=1, incremental=True)
    assert saver.last_save_kind == "full"
    ids = torch.sort(model["t"].ids()).values
    saver.close()
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    fresh, _, reader = _adagrad_job(out)
    reader.load(ckpt_id="c1")
    assert torch.equal(torch.sort(fresh["t"].ids()).values, ids)
    assert torch.equal(fresh["t"].export(ids)[1], model["t"].export(ids)[1])


def test_a_compacted_checkpoint_keeps_the_metrics_of_the_one_it_merges(tmp_path):
    """keep_best in the compaction's output dir ranks checkpoints by their metrics: the merged
    state is the same, so are its metrics (the source dir's retention policy is not carried)."""
    out = str(tmp_path / "run")
    model, _, saver = _adagrad_job(out)
    model["t"](torch.arange(40))
    saver.save("c1", metrics={"auc": 0.75})
    model["t"](torch.arange(30, 50))
    saver.save("c2", incremental=True, metrics={"auc": 0.8, "loss": 0.25})
    assert saver.last_save_kind == "delta"
    saver.close()
    path = recsave.compact(os.path.join(out, "c2"), str(tmp_path / "compacted"))
    index = index_mod.read(path, recsave.storage.get_storage(path))
    assert (index.kind, dict(index.metrics or {}), index.retention) == ("full", {"auc": 0.8, "loss": 0.25}, None)
