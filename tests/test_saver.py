"""Saver and CheckpointManager on local disk: bit-exact round trips, the on-disk layout, the
`checkpoint` list and max_keep rotation, registration rules, LoadReport, and hostile / damaged
checkpoints (flipped bytes, pickled callables, path traversal, uncommitted leftovers)."""
from __future__ import annotations

import io
import os
import re
import shutil
import threading
import time
import warnings
import weakref

import pytest
import torch
from helpers import (
    Reader,
    assert_jobs_equal,
    assert_models_equal,
    assert_obj_equal,
    assert_states_equal,
    ckpt_files,
    job_state,
    listing,
    make_job,
    model_state,
    read_index_json,
    table_state,
    tables_of,
    train,
    write_index_json,
)
from safetensors.numpy import load_file

import recsave
from recsave import (
    _C,
    CheckpointExistsError,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    partition,
)
from recsave.errors import UsageError
from recsave.save.pipeline import CheckpointWriter

TABLE_NAMES = ["item", "user"]
DENSE_NAMES = ["bn.bias", "bn.num_batches_tracked", "bn.running_mean", "bn.running_var", "bn.weight",
               "mlp.0.bias", "mlp.0.weight", "mlp.2.bias", "mlp.2.weight"]


class Counter:
    """A registered extra with mixed state (tensor, int, str)."""

    def __init__(self, n: int = 0):
        self.n, self.t = n, torch.full((3,), float(n))

    def state_dict(self):
        return {"n": self.n, "t": self.t.clone(), "tag": f"c{self.n}"}

    def load_state_dict(self, state):
        assert state["tag"] == f"c{state['n']}"
        self.n, self.t = state["n"], state["t"].clone()


def _trained_job(out, steps=8, **kw):
    job = make_job(str(out), **kw)
    job.train(steps)
    return job


def _index(ckpt_dir):
    return read_index_json(ckpt_dir)


def _write_index(ckpt_dir, index):
    write_index_json(ckpt_dir, index)


def _list_file(out):
    with open(os.path.join(out, "checkpoint")) as f:
        return f.read()


# ----------------------------------------------------------------------------------- round trip
def test_save_load_round_trip_is_bit_exact(tmp_path):
    out = tmp_path / "run"
    job = _trained_job(out, steps=10)
    counter = Counter(7)
    job.saver.register_for_checkpointing("counter", counter)
    path = job.saver.save("ckpt_10")
    assert path == os.path.join(str(out), "ckpt_10")
    saved = job_state(job)
    saved_counter = counter.state_dict()

    # A fresh job that has trained on other data (ids that the checkpoint does not have, other dense
    # values, optimizer state of its own) before loading. Same table seeds: rows of ids inserted
    # after the load must initialise alike for the continuation below.
    fresh = make_job(str(out))
    train(fresh.model, fresh.opts, 3, start=5000, reader=None)
    fresh.reader.offset = 999
    fresh_counter = Counter(0)
    fresh.saver.register_for_checkpointing("counter", fresh_counter)
    report = fresh.saver.load()

    assert report.checkpoints == [path]
    assert report.step == 10
    assert_jobs_equal(job_state(fresh), saved)
    assert_models_equal(fresh.model, job.model)
    assert fresh.reader.loaded == [{"offset": 10}]
    assert_obj_equal(fresh_counter.state_dict(), saved_counter, "counter")
    assert fresh.sparse_opt.state_dict() == job.sparse_opt.state_dict()
    assert fresh.sparse_opt.steps == {"user": 10, "item": 10}

    # Restored optimizer state and reader position make the continuation identical too.
    job.train(3)
    fresh.train(3)
    assert_jobs_equal(job_state(fresh), job_state(job))


def test_on_disk_file_set_and_shard_contents(tmp_path):
    out = tmp_path / "run"
    job = _trained_job(out, steps=4)
    ckpt = job.saver.save("ckpt_4")
    files = ckpt_files(ckpt)
    shards = [f for f in files if f.startswith("sparse-")]
    assert shards and all(re.fullmatch(r"sparse-0-\d+\.safetensors", f) for f in shards)
    assert set(files) - set(shards) == {"index", "model.pt", "extra.pt", "io_state_0.pt", "io_state_count"}
    assert listing(out) == ["checkpoint", "ckpt_4"]  # no temporary files left anywhere

    index = _index(ckpt)
    assert index["magic"] == "recsave.index" and index["format_version"] == 4
    assert index["step"] == 4 and index["world_size"] == 1
    # Every table chunk names the bucket rule of its segments (the knobs' sizes), never the ends.
    itemsize = {"int64": 8, "float32": 4}
    for name, entry in index["tensors"].items():
        row_bytes = itemsize[entry["dtype"]] * (entry["shape"][1] if len(entry["shape"]) > 1 else 1)
        for chunk in entry["chunks"]:
            assert "segments" not in chunk and "segment_bytes" not in chunk, name
            assert chunk["bucket_segments"] == {"step": (4 << 20) // row_bytes * row_bytes, "min": 64 << 10}, name
    # Every tensor of a table refers to the table's one bucket range, listed once.
    refs = {n: [c["buckets"] for c in e["chunks"]] for n, e in index["tensors"].items()}
    assert {n.partition("@")[0] for n in refs} == set(TABLE_NAMES)
    assert all(refs[n] == refs[f"{n.partition('@')[0]}@id"] for n in refs)
    assert sorted(r for t in TABLE_NAMES for r in refs[f"{t}@id"]) == list(range(len(index["bucket_ranges"])))
    assert set(index["files"]) == set(files) - {"index"}
    for name, entry in index["files"].items():
        assert entry["size"] == os.path.getsize(os.path.join(ckpt, name)), name
    with open(os.path.join(ckpt, "io_state_count"), "rb") as f:
        assert f.read().strip() == b"1"

    # Shard files are plain safetensors: ids, embedding and every slot, rows in the same order.
    stored = {}
    for f in shards:
        stored.update(load_file(os.path.join(ckpt, f)))
    expected = {f"{t}@{c}" for t in TABLE_NAMES for c in ("id", "embedding", "adagrad_acc", "last_step", "count")}
    assert set(stored) == expected
    for name, table in tables_of(job.model).items():
        ids = torch.from_numpy(stored[f"{name}@id"])
        assert sorted(ids.tolist()) == sorted(table.ids().tolist())
        _, emb, slots = table.export(ids)
        assert torch.equal(torch.from_numpy(stored[f"{name}@embedding"]), emb)
        assert torch.equal(torch.from_numpy(stored[f"{name}@adagrad_acc"]), slots["adagrad_acc"])
        meta = table.row_meta(table.lookup(ids, insert=False))  # row metadata, [n, 1] int64, same order
        assert torch.equal(torch.from_numpy(stored[f"{name}@last_step"]), meta["last_step"])
        assert torch.equal(torch.from_numpy(stored[f"{name}@count"]), meta["count"])

    dense = torch.load(os.path.join(ckpt, "model.pt"), weights_only=True)
    assert sorted(dense) == DENSE_NAMES
    extra = torch.load(os.path.join(ckpt, "extra.pt"), weights_only=True)
    assert sorted(extra) == ["dense_opt", "sparse_optim"]
    io_state = torch.load(os.path.join(ckpt, "io_state_0.pt"), weights_only=True)
    assert io_state == {"reader": {"offset": 4}}


def test_durable_save_commits_every_table_file_or_none(tmp_path, monkeypatch):
    """With fsync on, a save's shard files are fsynced and renamed together before the index: a
    file that cannot be committed fails the save, which leaves no file of it behind."""
    out = tmp_path / "run"
    job = _trained_job(out, steps=4)
    with recsave.knobs.override(fsync=True):
        first = job.saver.save("ckpt_4")
        state = job_state(job)
        job.train(2)
        # The second table's file of the next save cannot be renamed into place.
        blocker = out / "ckpt_6" / "sparse-0-1.safetensors"
        real_prepare = CheckpointWriter._prepare_dir

        def prepare_then_block(writer, ckpt_dir, ckpt_id):
            grant = real_prepare(writer, ckpt_dir, ckpt_id)
            blocker.mkdir(parents=True)
            (blocker / "x").write_bytes(b"x")
            return grant
        monkeypatch.setattr(CheckpointWriter, "_prepare_dir", prepare_then_block)
        with pytest.raises(recsave.RecsaveError, match="sparse-0-1.safetensors"):
            job.saver.save("ckpt_6")
    assert listing(out) == ["checkpoint", "ckpt_4"]
    assert _list_file(out).split() == ["ckpt_4"]
    assert sorted(f for f in ckpt_files(first) if f.startswith("sparse-")) == [
        "sparse-0-0.safetensors", "sparse-0-1.safetensors"]
    fresh = make_job(str(out))
    fresh.saver.load()
    assert_jobs_equal(job_state(fresh), state)


def test_durable_save_fsyncs_the_table_files_together_after_writing_all(tmp_path, monkeypatch):
    from recsave.format import commits as commits_mod

    out = tmp_path / "run"
    job = _trained_job(out, steps=4)
    seen = []
    real_commit = commits_mod._commit

    def spy(writer):
        seen.append(sorted(os.listdir(out / "ckpt_4")))
        real_commit(writer)
    monkeypatch.setattr(commits_mod, "_commit", spy)
    with recsave.knobs.override(fsync=True):
        job.saver.save("ckpt_4")
    assert len(seen) == len(TABLE_NAMES)  # one file per table, all committed by DeferredCommits
    # When the first commit starts, every table's file is written (under its temporary name) and
    # none is in place yet.
    assert len(seen[0]) == len(TABLE_NAMES) and all(".tmp-" in f for f in seen[0])


# ------------------------------------------------------------------------ checkpoint list, rotation
def test_checkpoint_file_listing_and_max_keep(tmp_path):
    out = tmp_path / "run"
    job = make_job(str(out), max_keep=2)
    paths = []
    for step in range(1, 5):
        job.train(1)
        paths.append(job.saver.save(f"ckpt_{step}"))
        assert job.saver.latest_checkpoint() == paths[-1]
    assert _list_file(out) == "ckpt_3\nckpt_4\n"
    assert job.saver.checkpoints() == paths[2:]
    job.saver.wait()  # the pruned directories' deletion (save/pruning.py)
    assert listing(out) == ["checkpoint", "ckpt_3", "ckpt_4"]


def test_max_keep_none_keeps_everything(tmp_path):
    out = tmp_path / "run"
    job = make_job(str(out), max_keep=None)
    for step in range(1, 5):
        job.saver.save(f"s{step}")
    assert _list_file(out) == "s1\ns2\ns3\ns4\n"
    assert listing(out) == ["checkpoint", "s1", "s2", "s3", "s4"]


def test_rotation_prunes_checkpoints_of_an_earlier_process_and_keeps_unrelated_files(tmp_path):
    out = tmp_path / "run"
    first = make_job(str(out), max_keep=None)
    for step in range(1, 5):
        first.train(1)
        first.saver.save(f"ckpt_{step}")
    (out / "notes.txt").write_text("keep me")
    (out / "logs").mkdir()
    (out / "logs" / "train.log").write_text("step 1")
    (out / "logs" / "index").write_text("not a checkpoint index")  # a file name recsave also uses

    first.saver.close()  # one writer per output dir: the earlier process is gone
    second = make_job(str(out), max_keep=2)
    second.saver.load()
    second.train(1)
    latest = second.saver.save("ckpt_5")
    assert _list_file(out) == "ckpt_4\nckpt_5\n"
    second.saver.wait()  # the pruned directories' deletion (save/pruning.py)
    assert listing(out) == ["checkpoint", "ckpt_4", "ckpt_5", "logs", "notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(out / "logs")) == ["index", "train.log"]
    assert second.saver.latest_checkpoint() == latest

    # max_keep=1 never deletes the checkpoint just written, even when an earlier process listed
    # "later-looking" ids.
    second.saver.close()
    third = make_job(str(out), max_keep=1)
    just = third.saver.save("ckpt_0")
    assert _list_file(out) == "ckpt_0\n"
    assert os.path.exists(os.path.join(just, "index"))
    third.saver.wait()
    assert listing(out) == ["checkpoint", "ckpt_0", "logs", "notes.txt"]


def test_rotation_keeps_an_unrelated_empty_directory(tmp_path):
    """An empty directory in output_dir (e.g. made for tensorboard before it writes) is not a
    checkpoint of recsave's and must survive rotation."""
    out = tmp_path / "run"
    job = make_job(str(out), max_keep=1)
    job.saver.save("ckpt_1")
    (out / "tensorboard").mkdir()
    job.saver.save("ckpt_2")
    job.saver.wait()  # the pruned directories' deletion (save/pruning.py)
    assert listing(out) == ["checkpoint", "ckpt_2", "tensorboard"]


def test_saving_a_committed_id_raises_and_keeps_it(tmp_path):
    out = tmp_path / "run"
    job = _trained_job(out, steps=3)
    ckpt = job.saver.save("ckpt_3")
    before = {f: open(os.path.join(ckpt, f), "rb").read() for f in ckpt_files(ckpt)}
    list_before = _list_file(out)
    job.train(1)
    with pytest.raises(CheckpointExistsError) as exc:
        job.saver.save("ckpt_3")
    assert isinstance(exc.value, FileExistsError) and "ckpt_3" in str(exc.value)
    assert {f: open(os.path.join(ckpt, f), "rb").read() for f in ckpt_files(ckpt)} == before
    assert _list_file(out) == list_before
    make_job(str(out)).saver.load()  # still loadable


# ----------------------------------------------------------------------- registration, extras
def test_register_duplicate_names_raise_value_error(tmp_path):
    job = make_job(str(tmp_path / "run"))  # registers "dense_opt" (extra) and "reader" (io state)
    saver = job.saver
    with pytest.raises(ValueError):
        saver.register_for_checkpointing("dense_opt", Counter())
    with pytest.raises(ValueError):
        saver.register_io_state("reader", Reader())
    with pytest.raises(ValueError):
        saver.register_io_state("dense_opt", Reader())
    with pytest.raises(ValueError):
        saver.register_for_checkpointing("reader", Counter())
    with pytest.raises(ValueError):
        saver.register_for_checkpointing("sparse_optim", Counter())  # the sparse optimizer's extra
    with pytest.raises(ValueError):
        saver.register_for_checkpointing("user", Counter())  # a table name
    with pytest.raises(ValueError):
        saver.register_for_checkpointing("mlp.0.weight", Counter())  # a dense name
    saver.register_for_checkpointing("counter", Counter())
    mgr = CheckpointManager(saver, 0)  # registers "global_step"
    with pytest.raises(ValueError):
        mgr.register_for_checkpointing("counter", Counter())
    with pytest.raises(ValueError):
        CheckpointManager(saver, 0)  # a second manager would register "global_step" again


def test_a_second_manager_on_one_saver_is_refused_saying_why(tmp_path):
    """The Saver's own refusal ("pick another name") is advice nobody can follow: the name is the
    manager's. The refusal says a Saver serves one manager, and changes nothing (retention,
    signal handlers) of the first."""
    import signal

    job = make_job(str(tmp_path / "run"), save_interval=2, manager_kw=dict(keep_best=1, best_metric="auc"))
    job.manager.close()
    retention, handler = job.saver.retention, signal.getsignal(signal.SIGTERM)
    with pytest.raises(UsageError, match=r"CheckpointManager: this Saver cannot take the manager's step as extra "
                                         r"'global_step' \('global_step' is registered already; pick another "
                                         r"name\)\. A Saver serves one CheckpointManager: if another manager "
                                         r"was made on it, make a new Saver for this one") as caught:
        CheckpointManager(job.saver, 1, keep_every_n_steps=5)
    assert caught.value.key == "global_step"
    assert job.saver.retention == retention and signal.getsignal(signal.SIGTERM) == handler


def test_get_extra_data(tmp_path):
    out = tmp_path / "run"
    job = _trained_job(out, steps=3)
    counter = Counter(4)
    job.saver.register_for_checkpointing("counter", counter)
    job.saver.save("ckpt_3")
    fresh = make_job(str(out))
    fresh.saver.register_for_checkpointing("counter", Counter())
    with pytest.raises(recsave.RecsaveError):
        fresh.saver.get_extra_data("counter")  # nothing loaded yet
    fresh.saver.load()
    assert_obj_equal(fresh.saver.get_extra_data("counter"), counter.state_dict(), "counter")
    assert_obj_equal(fresh.saver.get_extra_data("dense_opt"), job.dense_opt.state_dict(), "dense_opt")
    assert fresh.saver.get_extra_data("sparse_optim") == job.sparse_opt.state_dict()
    with pytest.raises(recsave.RecsaveError):
        fresh.saver.get_extra_data("nope")


def test_get_extra_data_follows_what_each_load_applied(tmp_path):
    """get_extra_data matches what the registered object last received: a later load that does not
    take the extra (tables only, the extra excluded, a renamed source) never leaves another
    checkpoint's state there."""
    paths = {}
    for run, n in (("a", 1), ("b", 2)):
        job = _trained_job(tmp_path / run, steps=2, seed=len(run))
        job.saver.register_for_checkpointing("counter", Counter(n))
        job.saver.register_for_checkpointing("other", Counter(10 * n))
        paths[run] = job.saver.save("ckpt_2")
    fresh = make_job(str(tmp_path / "fresh"))
    counter, other = Counter(), Counter()
    fresh.saver.register_for_checkpointing("counter", counter)
    fresh.saver.register_for_checkpointing("other", other)
    fresh.saver.load(paths["a"], direct_path=True)
    assert (fresh.saver.get_extra_data("counter")["n"], counter.n) == (1, 1)

    fresh.saver.load(paths["b"], direct_path=True, load_conf={"load": ["sparse"]})  # no extra.pt read
    assert (fresh.saver.get_extra_data("counter")["n"], counter.n) == (1, 1)
    fresh.saver.load(paths["b"], direct_path=True, load_conf={"exclude": ["counter"]})  # extra.pt read
    assert (fresh.saver.get_extra_data("counter")["n"], counter.n) == (1, 1)
    assert (fresh.saver.get_extra_data("other")["n"], other.n) == (20, 20)
    # a rename: the model's "counter" takes b's "other"; the dict follows the model's name
    fresh.saver.load(paths["b"], direct_path=True,
                     load_conf={"load": ["extra"], "oname": [{"counter": "other", "other": "counter"}]})
    assert (fresh.saver.get_extra_data("counter")["n"], counter.n) == (20, 20)
    assert (fresh.saver.get_extra_data("other")["n"], other.n) == (2, 2)

    # an extra nothing is registered for is readable once its extra.pt was read
    bare = make_job(str(tmp_path / "bare"))
    bare.saver.load(paths["b"], direct_path=True, load_conf={"strict": False})
    assert bare.saver.get_extra_data("counter")["n"] == 2


# --------------------------------------------------------------------------------- LoadReport
def test_load_report_contents(tmp_path):
    out = tmp_path / "run"
    job = _trained_job(out, steps=3)
    ckpt = job.saver.save("ckpt_3")
    rows = {n: len(t) for n, t in tables_of(job.model).items()}

    fresh = make_job(str(out))
    report = fresh.saver.load()
    categories = {n: item.category for n, item in report.loaded.items()}
    assert categories == {
        "user": "sparse", "item": "sparse", "user@adagrad_acc": "sparse_opt", "item@adagrad_acc": "sparse_opt",
        "sparse_optim": "sparse_opt", "dense_opt": "extra", "reader": "io_state",
        **{n: "dense" for n in DENSE_NAMES}}
    assert report.skipped == [] and report.missing == [] and report.unexpected == []
    assert report.checkpoints == [ckpt] and report.step == 3
    assert all(item.checkpoint == ckpt and item.source == n for n, item in report.loaded.items())
    assert report.loaded["user"].rows == rows["user"] and report.loaded["item"].rows == rows["item"]
    assert report.tables == ["item", "user"] and report.dense == DENSE_NAMES and report.extras == ["dense_opt"]
    assert report.rows_read == rows["user"] + rows["item"]
    assert report.bytes_read > 0

    only_sparse = make_job(str(out)).saver.load(load_conf={"load": ["sparse"]})
    assert sorted(only_sparse.loaded) == ["item", "user"]
    assert sorted(only_sparse.skipped) == sorted(set(categories) - {"item", "user"})
    assert only_sparse.missing == [] and only_sparse.unexpected == []

    # The checkpoint has a table the model lacks: reported as unexpected, not an error.
    extra_job = make_job(str(tmp_path / "other"))
    extra_job.model.extra_tab = recsave.HashTable(4, name="extra_tab")
    extra_job.model.extra_tab(torch.arange(5))
    extra_ckpt = extra_job.saver.save("c")
    r = make_job(str(out)).saver.load(extra_ckpt, direct_path=True)
    assert r.unexpected == ["extra_tab"] and r.missing == []
    assert "extra_tab" not in r.loaded


def test_split_sparse_dense_state_dict_does_not_mutate(tmp_path):
    job = _trained_job(tmp_path / "run", steps=2)
    sd = job.model.state_dict()
    keys, values = list(sd), list(sd.values())
    sparse, dense = recsave.split_sparse_dense_state_dict(sd)
    assert list(sd) == keys and all(a is b for a, b in zip(sd.values(), values))
    assert sorted(sparse) == TABLE_NAMES and sorted(dense) == DENSE_NAMES
    assert all(isinstance(t, recsave.HashTable) for t in sparse.values())
    assert sparse is not sd and dense is not sd


# ----------------------------------------------------------------------------- damaged / hostile
@pytest.mark.parametrize("block", ["user@id", "user@embedding", "user@adagrad_acc",
                                   "item@id", "item@embedding", "item@adagrad_acc"])
def test_flipped_byte_in_sparse_block_is_detected(tmp_path, block):
    out = tmp_path / "run"
    job = _trained_job(out, steps=3)
    ckpt = job.saver.save("ckpt_3")
    (chunk,) = _index(ckpt)["tensors"][block]["chunks"]
    path = os.path.join(ckpt, chunk["file"])
    with open(path, "r+b") as f:
        f.seek(chunk["offset"] + chunk["length"] // 2)
        b = f.read(1)
        f.seek(-1, io.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    fresh = make_job(str(out))
    with pytest.raises(CorruptCheckpointError) as exc:
        fresh.saver.load()
    assert chunk["file"] in str(exc.value)


@pytest.mark.parametrize("fname", ["model.pt", "extra.pt", "io_state_0.pt"])
def test_flipped_byte_in_pt_file_is_detected(tmp_path, fname):
    out = tmp_path / "run"
    job = _trained_job(out, steps=2)
    ckpt = job.saver.save("ckpt_2")
    path = os.path.join(ckpt, fname)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=re.escape(fname)):
        make_job(str(out)).saver.load()


def test_truncated_shard_file_is_detected(tmp_path):
    out = tmp_path / "run"
    job = _trained_job(out, steps=2)
    ckpt = job.saver.save("ckpt_2")
    (chunk,) = _index(ckpt)["tensors"]["user@embedding"]["chunks"]
    path = os.path.join(ckpt, chunk["file"])
    os.truncate(path, os.path.getsize(path) - 1)
    with pytest.raises(CorruptCheckpointError, match=re.escape(chunk["file"])):
        make_job(str(out)).saver.load()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("fname", ["model.pt", "extra.pt", "io_state_0.pt"])
def test_pickled_callable_is_refused_and_never_runs(tmp_path, fname):
    out = tmp_path / "run"
    job = _trained_job(out, steps=2)
    ckpt = job.saver.save("ckpt_2")
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"mlp.0.weight": _Payload(marker)}, buf)
    data = buf.getvalue()

    # The payload is live: an unsafe torch.load of the same kind of file runs it.
    probe = tmp_path / "probe"
    probe_buf = io.BytesIO()
    torch.save({"mlp.0.weight": _Payload(probe)}, probe_buf)
    torch.load(io.BytesIO(probe_buf.getvalue()), weights_only=False)
    assert probe.exists()

    with open(os.path.join(ckpt, fname), "wb") as f:
        f.write(data)
    index = _index(ckpt)
    index["files"][fname].update(size=len(data), crc32c=_C.crc32c(data))
    _write_index(ckpt, index)

    fresh = make_job(str(out))
    with pytest.raises(CorruptCheckpointError) as exc:
        fresh.saver.load()
    assert fname in str(exc.value)
    assert not marker.exists()


def test_checkpoint_list_with_path_traversal_is_refused(tmp_path):
    """A line that is no checkpoint id is never followed: the list counts as garbled and is rebuilt
    from the indexes inside the output dir (docs/FORMAT.md section 1)."""
    from recsave.format import ckptlist

    out = tmp_path / "run"
    job = _trained_job(out, steps=2)
    ckpt = job.saver.save("ckpt_2")
    shutil.copytree(ckpt, tmp_path / "x")  # a valid checkpoint where "../x" points
    (out / "checkpoint").write_text("ckpt_2\n../x\n")
    with pytest.raises(CorruptCheckpointError) as exc:
        ckptlist.read(job.saver.storage, str(out))
    assert "checkpoint" in str(exc.value) and "../x" in str(exc.value) and "recsave repair" in str(exc.value)
    fresh = make_job(str(out))
    with pytest.warns(RuntimeWarning, match=r"line 2 '\.\./x' is not a checkpoint id; rebuilt .*: ckpt_2;"):
        report = fresh.saver.load()
    assert report.checkpoints == [ckpt]
    with pytest.warns(RuntimeWarning, match="'../x' is not a checkpoint id"):  # once per Saver
        assert fresh.saver.latest_checkpoint() == ckpt
    mgr = CheckpointManager(fresh.saver, 0)
    assert mgr.restore() == 2 and mgr.last_report.checkpoints == [ckpt]
    assert (out / "checkpoint").read_text() == "ckpt_2\n../x\n"  # reads do not write


def test_uncommitted_leftovers_are_never_latest_and_are_removed_by_next_save(tmp_path):
    out = tmp_path / "run"
    job = make_job(str(out), max_keep=3)
    job.train(2)
    c2 = job.saver.save("ckpt_2")
    at_2 = model_state(job.model)
    job.train(2)
    c4 = job.saver.save("ckpt_4")
    # Make ckpt_4 an uncommitted leftover: drop it from the list, and remove its index.
    (out / "checkpoint").write_text("ckpt_2\n")
    os.remove(os.path.join(c4, "index"))
    # ... and a complete-looking copy (with an index) that no `checkpoint` line lists.
    shutil.copytree(c2, out / "ckpt_9")
    os.makedirs(out / "ckpt_7")  # a crash while writing the first shard file
    (out / "ckpt_7" / "sparse-0-0.safetensors.tmp-12345").write_bytes(b"partial")

    job.saver.close()
    fresh = make_job(str(out))
    assert fresh.saver.latest_checkpoint() == c2
    report = fresh.saver.load()
    assert report.checkpoints == [c2]
    assert_states_equal(model_state(fresh.model), at_2)

    fresh.train(1)
    c3 = fresh.saver.save("ckpt_3")
    assert _list_file(out) == "ckpt_2\nckpt_3\n"
    fresh.saver.wait()  # the pruned directories' deletion (save/pruning.py)
    assert listing(out) == ["checkpoint", "ckpt_2", "ckpt_3"]
    assert fresh.saver.checkpoints() == [c2, c3]


# ------------------------------------------------------------------------------ CheckpointManager
def test_manager_ids_restore_and_unknown_step(tmp_path):
    out = tmp_path / "run"
    job = make_job(str(out), max_keep=None, save_interval=3)
    job.train(7)  # saves ckpt_3, ckpt_6
    assert _list_file(out) == "ckpt_3\nckpt_6\n"
    assert job.manager.global_step == 7
    assert job.manager.save() == os.path.join(str(out), "ckpt_7")
    assert job.manager.save() == os.path.join(str(out), "ckpt_7")  # same step: the existing one
    at_7 = job_state(job)

    fresh = make_job(str(out), save_interval=3)
    assert fresh.manager.restore() == 7 and fresh.manager.global_step == 7
    assert_jobs_equal(job_state(fresh), at_7)

    older = make_job(str(out), save_interval=3)
    assert older.manager.restore(3) == 3 and older.reader.offset == 3
    before = job_state(older)
    with pytest.raises(CheckpointNotFoundError) as exc:
        older.manager.restore(5)
    assert isinstance(exc.value, FileNotFoundError) and "ckpt_5" in str(exc.value)
    assert_jobs_equal(job_state(older), before)
    assert older.manager.global_step == 3


def test_manager_restore_with_nothing_committed_changes_nothing(tmp_path):
    out = tmp_path / "never_written"
    job = make_job(str(out), save_interval=5)
    job.train(2)  # global_step 2, nothing saved yet
    before = job_state(job)
    assert job.manager.restore() == 0
    assert job.manager.global_step == 2
    assert_jobs_equal(job_state(job), before)
    assert job.reader.loaded == []
    assert not out.exists()

    # An output dir holding only an uncommitted leftover: nothing to restore either.
    os.makedirs(out / "ckpt_5")
    (out / "ckpt_5" / "model.pt").write_bytes(b"partial")
    fresh = make_job(str(out), save_interval=5)
    before = job_state(fresh)
    assert fresh.manager.restore() == 0
    assert_jobs_equal(job_state(fresh), before)
    assert listing(out) == ["ckpt_5"]


def test_in_place_restore_fills_storage_while_the_id_map_is_rebuilt():
    """HashTable.prepare_load(ids, columns, fill): fill runs on another thread and has finished when
    prepare_load returns; a failing fill or duplicate ids leave the table empty."""
    import threading

    table = recsave.HashTable(4, name="t")
    table.add_slot("acc", 0.5)
    ids = torch.tensor([7, -3, 2 ** 62, 11])
    seen = {}

    def fill(views):
        seen["thread"] = threading.get_ident()
        seen["shapes"] = {c: tuple(v.shape) for c, v in views.items()}
        views["embedding"].copy_(torch.arange(16.0).view(4, 4))

    views = table.prepare_load(ids, ["embedding"], fill)
    assert seen["thread"] != threading.get_ident() and seen["shapes"] == {"embedding": (4, 4)}
    assert set(views) == {"embedding"} and len(table) == 4
    assert torch.equal(table.lookup(ids, insert=False), torch.arange(4))
    assert torch.equal(table.weight[:4], torch.arange(16.0).view(4, 4))
    assert torch.equal(table.slot("acc")[:4], torch.full((4, 4), 0.5))  # unlisted: initial values

    def broken(views):
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        table.prepare_load(ids, ["embedding", "acc"], broken)
    assert len(table) == 0

    filled = []
    assert table.prepare_load(torch.tensor([1, 2, 1]), ["embedding"], lambda v: filled.append(True)) is None
    assert filled == [True] and len(table) == 0


def test_a_table_whose_ids_repeat_is_restored_by_the_general_path(tmp_path, monkeypatch):
    """A load restores its CPU tables together; one whose ids the fast path refuses (they repeat)
    is staged with load_rows instead, and the load still restores every table exactly."""
    from recsave.load.sources import CheckpointSource

    out = tmp_path / "run"
    job = _trained_job(out, steps=4)
    job.saver.save("ckpt_4")
    saved = job_state(job)
    read_table = CheckpointSource.read_table
    calls = []

    def ids_repeat_once(self, table, columns, *args, **kwargs):
        ids, data = read_table(self, table, columns, *args, **kwargs)
        calls.append((table, list(columns)))
        if table == "user" and not columns and ids is not None:  # the fast path's ids read
            ids.copy_(torch.cat([ids[:1], ids[:-1]]))  # in place: it reads into the table's row ids
        return ids, data

    monkeypatch.setattr(CheckpointSource, "read_table", ids_repeat_once)
    fresh = make_job(str(out))
    fresh.saver.load()
    assert_jobs_equal(job_state(fresh), saved)
    assert [t for t, c in calls if c] == ["user"]  # only the refused table was read again, whole
    assert sorted(t for t, c in calls if not c) == sorted(tables_of(job.model))  # each table's ids once


def test_in_place_restore_of_several_tables_has_one_fill():
    """HashTable.prepare_loads: every table's views go to one fill; a table whose ids repeat gets
    None and is left empty while the others are restored; a failing fill, or ids a table's
    partition refuses, leave every table empty."""
    tables = [recsave.HashTable(2, name=n) for n in ("a", "b", "c")]
    ids = [torch.tensor([5, 6, 7]), torch.tensor([1, 2, 1]), torch.tensor([-9, 9])]
    calls = []

    def fill(views):
        calls.append([sorted(v) for v in views])
        for k, v in enumerate(views):
            v["embedding"].fill_(float(k))
            if "count" in v:
                v["count"].fill_(3)

    out = recsave.HashTable.prepare_loads([(tables[0], ids[0], ["embedding", "count"]),
                                            (tables[1], ids[1], ["embedding"]),
                                            (tables[2], ids[2], ["embedding"])], fill)
    assert calls == [[["count", "embedding"], ["embedding"], ["embedding"]]]
    assert out[1] is None and len(tables[1]) == 0
    assert [len(tables[0]), len(tables[2])] == [3, 2] and set(out[0]) == {"embedding", "count"}
    assert torch.equal(tables[0].lookup(ids[0], insert=False), torch.arange(3))
    assert torch.equal(tables[2].weight[:2], torch.full((2, 2), 2.0))
    assert torch.equal(tables[0].row_meta(torch.arange(3))["count"], torch.full((3, 1), 3))

    def broken(views):
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        recsave.HashTable.prepare_loads([(t, i, ["embedding"]) for t, i in zip(tables[::2], ids[::2])], broken)
    assert [len(t) for t in tables] == [0, 0, 0]

    tables[2].set_partition(0, 2, 8)
    foreign = next(int(i) for i in range(100) if partition.owner_of(torch.tensor([i]), 2, 8)[0] == 1)
    with pytest.raises(UsageError):
        recsave.HashTable.prepare_loads([(tables[0], ids[0], ["embedding"]),
                                         (tables[2], torch.tensor([foreign]), ["embedding"])], fill)
    assert [len(t) for t in tables] == [0, 0, 0]

    tables[1].load_rows(ids[0], torch.ones(3, 2))
    with pytest.raises(UsageError, match="table 'b' is given twice"):
        recsave.HashTable.prepare_loads([(tables[1], ids[0], ["embedding"]), (tables[1], ids[2], ["embedding"])])
    assert len(tables[1]) == 3  # refused before anything changed


def _two_tables() -> torch.nn.ModuleDict:
    return torch.nn.ModuleDict({"user": recsave.HashTable(4, name="user"), "item": recsave.HashTable(4, name="item")})


def saved_with_int32_ids(out: str) -> "tuple[torch.nn.ModuleDict, str]":
    """A model of two tables, and its checkpoint rewritten to store table user's ids as int32 (what
    another writer may store)."""
    m = _two_tables()
    ids = torch.arange(-50, 150, 3)
    for k, table in enumerate(m.values()):
        table.load_rows(ids + k, torch.randn(len(ids), 4))
    ckpt = recsave.Saver(m, output_dir=out, max_keep=None).save("ckpt_1")
    rewrite_ids_as_int32(ckpt, "user")
    return m, ckpt


def rewrite_ids_as_int32(ckpt: str, table: str) -> None:
    """Rewrites checkpoint `ckpt`'s index to read `<table>@id` from a new file holding them as int32."""
    from recsave.format import index as index_mod
    from recsave.format.reader import read_tensors
    from recsave.format.writer import write_shards

    idx = index_mod.read(ckpt)
    name = f"{table}@id"
    stored = read_tensors(ckpt, [name], index=idx)[name]
    buckets = idx.tensors[name].chunks[0].buckets
    part = write_shards(ckpt, {name: stored.to(torch.int32)}, prefix="ids32", chunk_meta={name: {"buckets": buckets}})
    raw = read_index_json(ckpt)
    entry = part.tensors[name]
    raw["tensors"][name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                            "chunks": [entry.chunks[0].to_json({buckets: 1})]}
    raw["files"].update({f: fe.to_json() for f, fe in part.files.items()})
    write_index_json(ckpt, raw)
    assert index_mod.read(ckpt).tensors[name].dtype == "int32"


def test_a_delta_chain_of_int32_ids_restores_and_exports(tmp_path):
    """Every member's ids int32 (the merge keeps int32 when nothing promotes it): the chain's
    restore and its Parquet export take them as int64."""
    from recsave.tools.export import to_parquet
    m, base = saved_with_int32_ids(str(tmp_path / "run"))
    saver = recsave.Saver(m, output_dir=str(tmp_path / "run"), max_keep=None)
    saver.load()  # the rewritten base is the delta's parent
    m["user"].load_rows(torch.tensor([1000, -49]), torch.ones(2, 4))
    m["user"].delete(torch.tensor([-50]))
    delta = saver.save("ckpt_2", incremental=True)
    assert saver.last_save_kind == "delta"
    rewrite_ids_as_int32(delta, "user")
    fresh = _two_tables()
    recsave.Saver(fresh, output_dir=str(tmp_path / "run")).load()
    for name in ("user", "item"):
        assert_states_equal(table_state(fresh[name]), table_state(m[name]), name)
    to_parquet(delta, str(tmp_path / "export"))


def test_a_checkpoint_with_int32_ids_restores_through_the_copying_path(tmp_path):
    """Ids stored as int32 (another writer's checkpoint) cannot be read straight into a table's
    int64 row ids: that table takes them through a copy, and the restore is exact."""
    m, ckpt = saved_with_int32_ids(str(tmp_path))
    fresh = _two_tables()
    recsave.Saver(fresh, output_dir=str(tmp_path), max_keep=None).load()
    for name in ("user", "item"):
        assert_states_equal(table_state(fresh[name]), table_state(m[name]), name)
    # A second table loading the same source table (oname) takes the one-table path: int32 too.
    twice = torch.nn.ModuleDict({"user": recsave.HashTable(4, name="user"), "u2": recsave.HashTable(4, name="u2")})
    recsave.Saver(twice, output_dir=str(tmp_path / "other")).load_model_bank(
        [{"path": ckpt, "oname": [{"u2": "user"}], "strict": False}])
    for name in ("user", "u2"):
        assert_states_equal(table_state(twice[name]), table_state(m["user"]), name)


@pytest.mark.parametrize("to", ["torch", "dcp", "recsave", "parquet"])
def test_a_checkpoint_with_int32_ids_converts_and_exports_to_what_loads_it(tmp_path, to):
    """convert and to_parquet take another writer's int32 ids as int64 ids: before, convert wrote
    int32 ids that recsave's own torch / DCP reader refused (after exit 0), convert to recsave
    failed, and to_parquet called the checkpoint inconsistent."""
    m, ckpt = saved_with_int32_ids(str(tmp_path / "run"))
    dst = str(tmp_path / ("out.pt" if to == "torch" else "out"))
    if to == "parquet":
        from recsave.tools.export import to_parquet
        to_parquet(ckpt, dst)
    else:
        recsave.convert(ckpt, dst, to)
    fresh = _two_tables()
    recsave.Saver(fresh, output_dir=str(tmp_path / "other")).load_model_bank([{"path": dst}])
    for name in ("user", "item"):
        ids = m[name].ids()
        assert torch.equal(torch.sort(fresh[name].ids()).values, torch.sort(ids).values)
        assert torch.equal(fresh[name].export(ids)[1], m[name].export(ids)[1])


def test_prepare_loads_reads_ids_when_a_table_takes_them_and_keeps_no_copy():
    """Ids given as functions: each called once, in order; by the time the fill runs no id tensor
    they returned is alive (the maps were rebuilt from the tables' own row ids); the restore is the
    same as with tensors, a repeated id included."""
    tables = [recsave.HashTable(2, name=n) for n in ("a", "b", "c")]
    given = [torch.tensor([5, 6, 7]), torch.tensor([1, 2, 1]), torch.tensor([-9, 9, 2**62])]
    calls, alive, seen = [], [], []

    def reader(k):
        def read():
            calls.append(k)
            ids = given[k].clone()
            alive.append(weakref.ref(ids))
            return ids
        return read

    def fill(views):
        seen.append([ref() is not None for ref in alive])
        for k, v in enumerate(views):
            v["embedding"].fill_(float(k))

    out = recsave.HashTable.prepare_loads([(t, reader(k), ["embedding"]) for k, t in enumerate(tables)], fill)
    assert calls == [0, 1, 2] and seen == [[False, False, False]]
    assert out[1] is None and len(tables[1]) == 0
    for k in (0, 2):
        assert torch.equal(tables[k].lookup(given[k], insert=False), torch.arange(3))
        assert torch.equal(tables[k].weight[:3], torch.full((3, 2), float(k)))

    def failing():
        raise OSError("ids unreadable")

    with pytest.raises(OSError, match="ids unreadable"):
        recsave.HashTable.prepare_loads([(tables[0], reader(0), ["embedding"]), (tables[2], failing, ["embedding"])],
                                        fill)
    assert [len(t) for t in tables] == [0, 0, 0]


def test_prepare_loads_reads_deferred_ids_while_the_fill_runs():
    """Ids given as DeferredIds: read into each table's own row ids after the fill has started
    (the reader waits for the fill's start: read first, as before, it would time out), in order;
    the restore is the same as with tensors, a repeated id included. A table whose embedding is
    not read takes its ids before the fill starts; a failing id read leaves every table empty,
    and only once the fill has ended."""
    from recsave.tables.staging import DeferredIds

    tables = [recsave.HashTable(2, name=n) for n in ("a", "b", "c")]
    given = [torch.tensor([5, 6, 7]), torch.tensor([1, 2, 1]), torch.tensor([-9, 9, 2**62])]
    fill_started, fill_ended, read_failed = threading.Event(), threading.Event(), threading.Event()
    calls = []

    def deferred(k, during_fill=True):
        def read_into(dest):
            if during_fill:
                assert fill_started.wait(10), "the ids were read before the fill started"
            else:
                assert not fill_started.is_set(), "ids the rows' initial values need were read late"
            calls.append(k)
            assert dest.dtype == torch.int64 and dest.is_contiguous() and dest.numel() == 3
            dest.copy_(given[k])
        return DeferredIds(3, read_into)

    def fill(views):
        fill_started.set()
        for k, v in enumerate(views):
            v["embedding"].fill_(float(k))
        fill_ended.set()

    out = recsave.HashTable.prepare_loads([(t, deferred(k), ["embedding"]) for k, t in enumerate(tables)], fill)
    assert calls == [0, 1, 2] and out[1] is None and len(tables[1]) == 0
    for k in (0, 2):
        assert torch.equal(tables[k].lookup(given[k], insert=False), torch.arange(3))
        assert torch.equal(tables[k].weight[:3], torch.full((3, 2), float(k)))

    def fill_count(views):
        fill_started.set()
        views[0]["count"].fill_(2)

    calls.clear()
    fill_started.clear()
    out = recsave.HashTable.prepare_loads([(tables[0], deferred(0, during_fill=False), ["count"])], fill_count)
    assert calls == [0] and set(out[0]) == {"count"}
    assert torch.equal(tables[0].lookup(given[0], insert=False), torch.arange(3))
    assert torch.equal(tables[0].weight[:3], tables[0].initial_rows(given[0]))

    def unreadable(dest):
        read_failed.set()
        raise OSError("ids unreadable")

    def slow_fill(views):
        fill_started.set()
        assert read_failed.wait(10)
        time.sleep(0.2)  # still reading when the id read fails
        fill_ended.set()

    fill_started.clear()
    fill_ended.clear()
    with pytest.raises(OSError, match="ids unreadable"):
        recsave.HashTable.prepare_loads([(tables[0], deferred(0), ["embedding"]),
                                         (tables[2], DeferredIds(3, unreadable), ["embedding"])], slow_fill)
    assert fill_ended.is_set() and [len(t) for t in tables] == [0, 0, 0]

    for count, error in ((-1, UsageError), (True, UsageError), (2.0, UsageError)):
        with pytest.raises(error, match="count must be an int >= 0"):
            DeferredIds(count, unreadable)


def test_a_table_with_freed_rows_saves_by_its_row_list(tmp_path):
    """A table that never freed a row gives its ids without a list of rows (dense_row_ids): rows
    0..n-1. Once a row is freed it has none, and the save takes id_rows' rows: both round-trip."""
    from recsave import HashTable, Saver

    table = HashTable(4, name="t", seed=3)
    ids = torch.tensor([50, 7, -3, 2**40, 11], dtype=torch.int64)
    table.lookup(ids, insert=True)
    assert torch.equal(table.dense_row_ids(), ids)
    table.delete(torch.tensor([7, 2**40]))
    assert table.dense_row_ids() is None
    live, rows = table.id_rows()
    assert sorted(live.tolist()) == [-3, 11, 50] and sorted(rows.tolist()) == [0, 2, 4]
    model = torch.nn.ModuleDict({"t": table})
    want_ids, want_values, _ = table.export()
    Saver(model, output_dir=str(tmp_path / "out")).save("ckpt_1")
    fresh = torch.nn.ModuleDict({"t": HashTable(4, name="t", seed=9)})
    Saver(fresh, output_dir=str(tmp_path / "out")).load()
    got_ids, got_values, _ = fresh["t"].export(want_ids)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_values, want_values)


@pytest.mark.parametrize("ckpt_id", ["checkpoint", ".recsave-writer.lock", "checkpoint.tmp-1",
                                     ".recsave-writer.lock.tmp-12-3", "..", "a/b"])
def test_ids_that_name_the_output_dirs_own_files_are_refused(tmp_path, ckpt_id):
    job = make_job(str(tmp_path / "run"))
    job.train(1)
    job.saver.save("ckpt_1")
    before = sorted(os.listdir(tmp_path / "run"))
    with pytest.raises(UsageError, match=r"checkpoint id .* is not usable: .*'<name>\.tmp-<digits and ->'"):
        job.saver.save(ckpt_id)
    assert sorted(os.listdir(tmp_path / "run")) == before


def test_gc_leaves_a_directory_named_like_a_temp_file(tmp_path):
    """A directory is never an interrupted write of the `checkpoint` file, whatever its name."""
    from recsave.tools import catalog

    job = make_job(str(tmp_path / "run"))
    job.train(1)
    job.saver.save("ckpt_1")
    job.saver.close()
    (tmp_path / "run" / "checkpoint.tmp-1").mkdir()
    (tmp_path / "run" / "checkpoint.tmp-2").write_bytes(b"ckpt_1\n")  # an interrupted write: removed
    assert catalog.clean_output_dir(str(tmp_path / "run"))["removed_temp_files"] == ["checkpoint.tmp-2"]
    assert (tmp_path / "run" / "checkpoint.tmp-1").is_dir()


def test_last_load_is_the_report_of_the_last_load_that_completed(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out)
    job.saver.save("ckpt_1")
    fresh = make_job(out)
    assert fresh.saver.last_load is None
    report = fresh.saver.load()
    assert fresh.saver.last_load is report
    with pytest.raises(recsave.CheckpointNotFoundError):
        fresh.saver.load(ckpt_id="ckpt_9")
    assert fresh.saver.last_load is None  # a failed load may have changed tables
    bank = fresh.saver.load_model_bank([{"path": out}])
    assert fresh.saver.last_load is bank


def _trained_adagrad(out: str) -> "tuple[torch.nn.ModuleDict, torch.Tensor]":
    """A one-table model trained 3 steps with SparseAdagrad, saved into `out`; (model, its slot)."""
    from recsave.tables.optim import SparseAdagrad
    m = torch.nn.ModuleDict({"a": recsave.HashTable(4, name="a")})
    opt = SparseAdagrad(m, lr=0.1)
    for _ in range(3):
        m["a"](torch.arange(10)).sum().backward()
        opt.step()
        opt.zero_grad()
    recsave.Saver(m, opt, output_dir=out).save("ckpt_3")
    return m, m["a"].export(torch.arange(10))[2]["adagrad_acc"]


def _warm_start(path: str, out: str) -> "tuple[torch.nn.ModuleDict, object]":
    from recsave.tables.optim import SparseAdagrad
    fresh = torch.nn.ModuleDict({"a": recsave.HashTable(4, name="a")})
    opt = SparseAdagrad(fresh, lr=0.1)
    recsave.Saver(fresh, opt, output_dir=out).load_model_bank([{"path": path, "exclude": ["sparse_optim"]}])
    return fresh, opt


@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_slots_loaded_from_a_conversion_take_its_step_counts(tmp_path, to):
    """convert keeps the sparse optimizer's step counts (as `_recsave.extra.sparse_optim.steps.<t>`);
    a warm start of slots from the torch.save / DCP result takes them, as from the checkpoint
    (at 0, Adam's bias correction and Adagrad's lr_decay would restart on trained slots)."""
    _, acc = _trained_adagrad(str(tmp_path / "run"))
    dst = str(tmp_path / ("out.pt" if to == "torch" else "out"))
    recsave.convert(str(tmp_path / "run"), dst, to)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh, opt = _warm_start(dst, str(tmp_path / "other"))
    assert opt.steps["a"] == 3
    assert torch.equal(fresh["a"].export(torch.arange(10))[2]["adagrad_acc"], acc)


def test_slots_loaded_without_their_step_counts_say_so(tmp_path):
    """A torch.save file without the counts (one written by other code): the slots load with the
    live count (0 in a fresh model), and a warning, pointing at the load call, names the tables."""
    _, acc = _trained_adagrad(str(tmp_path / "run"))
    recsave.convert(str(tmp_path / "run"), str(tmp_path / "out.pt"), "torch")
    state = torch.load(str(tmp_path / "out.pt"), weights_only=True)
    torch.save({k: v for k, v in state.items() if ".steps." not in k}, str(tmp_path / "bare.pt"))
    with pytest.warns(RuntimeWarning, match=r"slots of table\(s\) \['a'\] were loaded from a source that "
                                            r"records no sparse optimizer step count.*counts stay \[0\]") as caught:
        fresh, opt = _warm_start(str(tmp_path / "bare.pt"), str(tmp_path / "other"))
    assert [w.filename for w in caught] == [__file__]  # it points at the load call, not into recsave
    assert opt.steps["a"] == 0
    assert torch.equal(fresh["a"].export(torch.arange(10))[2]["adagrad_acc"], acc)


@pytest.mark.parametrize("kind", ["torch", "dcp"])
def test_step_counts_nested_or_as_tensors_are_read_and_not_reported_unexpected(tmp_path, kind):
    """A torch.save file that nests the counts (`{"_recsave": {"extra": ...}}`, flattened with '.'
    as the rest of the file is) or keeps them as 0-d tensors: the slots take them, and the count
    entries are no dense names the load reports as unexpected."""
    from recsave.tables.optim import SparseAdagrad
    _, acc = _trained_adagrad(str(tmp_path / "run"))
    recsave.convert(str(tmp_path / "run"), str(tmp_path / "out.pt"), "torch")
    state = {k: v for k, v in torch.load(str(tmp_path / "out.pt"), weights_only=True).items() if "_recsave" not in k}
    nested = {**state, "_recsave": {"extra": {"sparse_optim": {"steps": {"a": torch.tensor(3)}}}}}
    if kind == "torch":
        torch.save(nested, str(tmp_path / "nested.pt"))
    else:
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(nested, storage_writer=dcp.FileSystemWriter(str(tmp_path / "nested.pt")), no_dist=True)
    fresh = torch.nn.ModuleDict({"a": recsave.HashTable(4, name="a")})
    opt = SparseAdagrad(fresh, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = recsave.Saver(fresh, opt, output_dir=str(tmp_path / "other")).load_model_bank(
            [{"path": str(tmp_path / "nested.pt"), "exclude": ["sparse_optim"]}])
    assert opt.steps["a"] == 3 and report.unexpected == []
    assert torch.equal(fresh["a"].export(torch.arange(10))[2]["adagrad_acc"], acc)


def test_the_uncounted_slots_warning_made_an_error_leaves_the_model_as_it_was(tmp_path):
    """With warnings as errors (python -W error) the warning was raised after the load was
    applied: the call failed, yet the model had changed. It comes before any change now."""
    _, acc = _trained_adagrad(str(tmp_path / "run"))
    recsave.convert(str(tmp_path / "run"), str(tmp_path / "out.pt"), "torch")
    state = torch.load(str(tmp_path / "out.pt"), weights_only=True)
    torch.save({k: v for k, v in state.items() if ".steps." not in k}, str(tmp_path / "bare.pt"))
    from recsave.tables.optim import SparseAdagrad
    fresh = torch.nn.ModuleDict({"a": recsave.HashTable(4, name="a")})
    fresh["a"](torch.tensor([100]))
    opt = SparseAdagrad(fresh, lr=0.1)
    saver = recsave.Saver(fresh, opt, output_dir=str(tmp_path / "other"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeWarning, match="records no sparse optimizer step count"):
            saver.load_model_bank([{"path": str(tmp_path / "bare.pt"), "exclude": ["sparse_optim"]}])
    assert fresh["a"].ids().tolist() == [100] and saver.last_load is None


class _RunsCode:
    """A pickle that runs code when loaded (what a hostile DCP entry could hold)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_dcp_directorys_step_counts_are_read_without_running_its_pickles(tmp_path):
    """DCP keeps non-tensor entries pickled, and its default planner unpickles them with
    weights_only=False: reading the counts must not run what a DCP directory from elsewhere holds,
    and an entry that is no count costs the counts (a warning), never the load."""
    import torch.distributed.checkpoint as dcp
    _, acc = _trained_adagrad(str(tmp_path / "run"))
    marker = str(tmp_path / "ran")
    state = {"a.weight": torch.randn(10, 4), "a.ids": torch.arange(10), "a.adagrad_acc": acc,
             "_recsave.extra.sparse_optim.steps.a": _RunsCode(marker),
             "_recsave.extra.sparse_optim.steps.hist": torch.arange(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "hostile")), no_dist=True)
    with pytest.warns(RuntimeWarning, match=r"slots of table\(s\) \['a'\] .*counts stay \[0\]"):
        fresh, opt = _warm_start(str(tmp_path / "hostile"), str(tmp_path / "other"))
    assert not os.path.exists(marker)
    assert opt.steps["a"] == 0
    assert torch.equal(fresh["a"].export(torch.arange(10))[2]["adagrad_acc"], acc)
