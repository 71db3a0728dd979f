"""A multi-rank save without a torch.distributed process group is refused before anything is
written (it would otherwise commit an index holding only this rank's part); loads in that setting
stay legitimate (a rank reads its own buckets)."""
from __future__ import annotations

import hashlib
import os

import pytest
import torch

from recsave import HashTable, Saver, UsageError
from recsave.storage.lock import LOCK_FILE

NO_GROUP = (r"cannot save as rank \d of \d: no torch\.distributed process group is initialised.*"
            r"initialise torch\.distributed.*or unset RANK/WORLD_SIZE")


def _model():
    model = torch.nn.Module()
    model.t = HashTable(4, name="t", seed=3)
    model.t(torch.arange(50))
    model.lin = torch.nn.Linear(2, 2)
    return model


def _snapshot(root):
    """Every path under root with the sha256 of its bytes (directories map to None)."""
    out = {}
    for base, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(base, d), root)] = None
        for f in files:
            with open(os.path.join(base, f), "rb") as fh:
                out[os.path.relpath(os.path.join(base, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture
def committed(tmp_path):
    """An output dir with one committed checkpoint, its saver closed (no lock file left)."""
    out = tmp_path / "out"
    saver = Saver(_model(), output_dir=str(out))
    saver.save("ckpt_1")
    saver.close()
    assert not (out / LOCK_FILE).exists()
    return out


@pytest.mark.parametrize("how", ["env", "args"])
@pytest.mark.parametrize("call", ["save", "async_save"])
def test_multirank_save_without_a_group_writes_nothing(committed, monkeypatch, how, call):
    if how == "env":
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        kw = {}
    else:
        kw = {"shard_id": 0, "shard_num": 2}
    before = _snapshot(committed)
    saver = Saver(_model(), output_dir=str(committed))
    with pytest.raises(UsageError, match=NO_GROUP):
        getattr(saver, call)("ckpt_2", **kw)
    assert saver.pending_checkpoint is None  # raised at the call, nothing went to the background
    assert saver.model.t.partition is None   # the table was not declared a shard either
    assert _snapshot(committed) == before    # no ckpt_2, same `checkpoint` bytes, no lock file
    saver.close()


def test_multirank_save_without_a_group_into_a_new_dir_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    out = tmp_path / "new"
    saver = Saver(_model(), output_dir=str(out))
    with pytest.raises(UsageError, match=NO_GROUP):
        saver.save("ckpt_1")
    assert not out.exists()


def test_single_rank_env_still_saves(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    out = tmp_path / "out"
    saver = Saver(_model(), output_dir=str(out))
    saver.save("ckpt_1")
    assert (out / "ckpt_1" / "index").exists()
    saver.close()


def test_load_with_rank_env_and_no_group_reads_this_ranks_share(committed, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    fresh = torch.nn.Module()
    fresh.t = HashTable(4, name="t", seed=9)
    fresh.lin = torch.nn.Linear(2, 2)
    report = Saver(fresh, output_dir=str(committed)).load()
    assert "t" in report.loaded
    assert fresh.t.partition[:2] == (1, 2)
    assert 0 < len(fresh.t) < 50


@pytest.mark.parametrize("fallback", [False, True])
def test_load_alone_with_rank_env_reads_whole_tables(committed, monkeypatch, fallback):
    """shard_num=1: this process loads as rank 0 of 1 whatever RANK / WORLD_SIZE say (replicas)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    whole = _model()
    fresh = torch.nn.Module()
    fresh.t = HashTable(4, name="t", seed=9)
    fresh.lin = torch.nn.Linear(2, 2)
    report = Saver(fresh, output_dir=str(committed)).load(shard_num=1, fallback=fallback)
    assert "t" in report.loaded
    assert fresh.t.partition is None
    ids = torch.arange(50)
    assert sorted(fresh.t.export()[0].tolist()) == ids.tolist()
    assert torch.equal(fresh.t.export(ids)[1], whole.t.export(ids)[1])
