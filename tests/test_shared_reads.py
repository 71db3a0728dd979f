"""load/shared_reads.py in one process: what rank 0 records while it opens a load's sources, and how
another rank takes those bytes only for a file that is the same on its side. The broadcast itself,
and loads on several ranks, are in tests/test_multirank.py."""
from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from helpers import CTR, make_batch, train_step

from recsave import Saver, knobs
from recsave.errors import CheckpointNotFoundError, CorruptCheckpointError
from recsave.format import index as index_mod
from recsave.load import shared_reads
from recsave.load.shared_reads import IndexRecorder, SharedIndexReader, SharedReads
from recsave.load.sources import ChainSource, open_source
from recsave.storage import LocalStorage


@pytest.fixture
def out(tmp_path):
    """An output dir with a full checkpoint and two deltas on it."""
    model = CTR(seed=0)
    saver = Saver(model, output_dir=str(tmp_path / "out"), max_keep=None)
    for k in range(3):
        train_step(model, [], make_batch(k, 16))
        saver.save(f"ckpt_{k + 1}", incremental=True)
    assert saver.last_save_kind == "delta"
    return str(tmp_path / "out")


class CountingStorage(LocalStorage):
    """A LocalStorage that counts whole-file reads of index files and stats (ukey)."""

    def __init__(self):
        super().__init__()
        self.index_reads = 0
        self.stats = 0

    def ukey(self, path):
        self.stats += 1
        return super().ukey(path)

    def read_bytes(self, path, limit):
        self.index_reads += path.endswith("/" + index_mod.INDEX_FILE)
        return super().read_bytes(path, limit)


def record(entries):
    """What rank 0 broadcasts after opening `entries` (and the sources it opened)."""
    recorder = IndexRecorder()
    with index_mod.reading_through(recorder.read):
        sources = [open_source(*e) for e in entries]
    resolved = [(e, s.ckpt_dir) for e, s in zip(entries, sources)]
    return pickle.loads(pickle.dumps(SharedReads(resolved, recorder.indexes))), sources


def test_rank0_records_every_index_of_a_chain_and_the_checkpoint_it_resolved(out):
    shared, (src,) = record([(out, None, False)])
    assert isinstance(src, ChainSource)
    assert shared.entries == [((out, None, False), os.path.join(out, "ckpt_3"))]
    assert sorted(shared.indexes) == [os.path.join(out, f"ckpt_{k}", "index") for k in (1, 2, 3)]
    for path, known in shared.indexes.items():
        with open(path, "rb") as f:
            assert known.data == f.read()
        assert known.ukey == LocalStorage().ukey(path)


def test_another_rank_opens_the_same_chain_without_reading_an_index(out, monkeypatch):
    shared, (mine,) = record([(out, None, False)])
    storage = CountingStorage()
    monkeypatch.setattr(shared_reads, "get_storage", lambda path: storage)
    monkeypatch.setattr("recsave.load.sources.get_storage", lambda path: storage)
    reader = SharedIndexReader(shared)
    with index_mod.reading_through(reader.read):
        opening = reader.opening((out, None, False))
        theirs = open_source(*opening)
    assert opening == (os.path.join(out, "ckpt_3"), None, True)  # no list read to find the latest
    assert storage.index_reads == 0 and reader.taken == 3
    assert storage.stats == 3  # one per chain member: the one opening() checked is not asked again
    assert theirs.ckpt_dir == mine.ckpt_dir and theirs.chain_ids == mine.chain_ids == ["ckpt_1", "ckpt_2", "ckpt_3"]
    assert theirs.index == mine.index
    assert dict(theirs.contents.tables) == dict(mine.contents.tables)


def test_a_file_replaced_since_rank0_read_it_is_read_again(out, monkeypatch):
    """Same path, other file (as per-rank local dirs give): the token differs, the rank reads its own."""
    shared, _ = record([(out, None, False)])
    path = os.path.join(out, "ckpt_3", "index")
    copy = path + ".copy"
    shutil.copyfile(path, copy)
    os.replace(copy, path)  # same bytes, another inode and mtime: another file
    storage = CountingStorage()
    monkeypatch.setattr("recsave.load.sources.get_storage", lambda p: storage)
    reader = SharedIndexReader(shared)
    with index_mod.reading_through(reader.read):
        opening = reader.opening((out, None, False))
        src = open_source(*opening)
    assert opening == (out, None, False)  # not rank 0's resolution: this rank's own list decides
    assert storage.index_reads == 1 and reader.taken == 2  # ckpt_3 read here, its parents taken
    assert src.ckpt_dir == os.path.join(out, "ckpt_3")


def test_other_entries_are_opened_as_given(out, tmp_path):
    shared, _ = record([(out, "ckpt_1", False)])
    reader = SharedIndexReader(shared)
    assert reader.opening((out, None, False)) == (out, None, False)
    assert reader.opening((out, "ckpt_1", False)) == (os.path.join(out, "ckpt_1"), None, True)
    other = str(tmp_path / "elsewhere")
    assert reader.opening((other, "ckpt_1", False)) == (other, "ckpt_1", False)


def test_a_missing_index_is_not_recorded_and_reads_fail_as_before(out):
    recorder = IndexRecorder()
    with index_mod.reading_through(recorder.read), pytest.raises(CheckpointNotFoundError, match="no index"):
        index_mod.read(os.path.join(out, "ckpt_9"))
    assert recorder.indexes == {}
    shared, _ = record([(out, None, False)])
    os.remove(os.path.join(out, "ckpt_1", "index"))
    reader = SharedIndexReader(shared)
    with index_mod.reading_through(reader.read), pytest.raises(CheckpointNotFoundError, match="no index"):
        index_mod.read(os.path.join(out, "ckpt_1"))
    assert reader.taken == 0


def test_the_limit_on_index_bytes_still_holds_for_bytes_taken(out):
    shared, _ = record([(out, None, False)])
    reader = SharedIndexReader(shared)
    with knobs.override(max_index_bytes=10), index_mod.reading_through(reader.read), \
            pytest.raises(CorruptCheckpointError, match="over the 10-byte limit"):
        index_mod.read(os.path.join(out, "ckpt_3"))
    assert reader.taken == 0


def test_without_a_process_group_open_sources_opens_each_entry(out):
    sources = shared_reads.open_sources([(out, None, False), (out, "ckpt_1", False)], world=1)
    assert [s.ckpt_dir for s in sources] == [os.path.join(out, "ckpt_3"), os.path.join(out, "ckpt_1")]
    ids, columns = sources[1].read_table("user", ["embedding"], 0, 1, 2)
    want_ids, want = open_source(out, "ckpt_1").read_table("user", ["embedding"], 0, 1, 2)
    assert torch.equal(ids, want_ids) and torch.equal(columns["embedding"], want["embedding"])


def test_a_dense_file_from_rank0_is_taken_only_where_this_ranks_index_records_it(out, monkeypatch):
    """As rank 1 of 2 (the broadcast answered with chosen bytes): model.pt bytes of this checkpoint
    are decoded without a read; another checkpoint's bytes (per-rank dirs holding other states)
    do not match this index's size and CRC32C, so the rank reads its own file."""
    from recsave.load.sources import CheckpointSource
    from recsave.storage import dist

    mine, other = open_source(out, "ckpt_3"), open_source(out, "ckpt_1")
    assert isinstance(mine, CheckpointSource)
    good, stale = mine.read_pt_bytes("model.pt"), other.read_pt_bytes("model.pt")
    assert good != stale and mine.pt_matches("model.pt", good) and not mine.pt_matches("model.pt", stale)
    monkeypatch.setattr(dist, "collective", lambda world: True)
    monkeypatch.setattr(dist, "group_rank", lambda: 1)
    reads = []
    real = CheckpointSource.read_pt_bytes
    monkeypatch.setattr(CheckpointSource, "read_pt_bytes", lambda self, f: reads.append(f) or real(self, f))
    for blob, want_reads in ((good, []), (stale, ["model.pt"])):
        reads.clear()
        monkeypatch.setattr(dist, "broadcast_from_rank0", lambda obj, world, b=blob: {(0, "model.pt"): b})
        (files,) = shared_reads.read_pt_files([mine], [["model.pt"]], world=2)
        assert reads == want_reads
        expected = torch.load(os.path.join(out, "ckpt_3", "model.pt"), weights_only=True)
        assert sorted(files["model.pt"]) == sorted(expected)
        assert all(torch.equal(files["model.pt"][k], expected[k]) for k in expected)
