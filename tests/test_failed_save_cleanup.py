"""A failed save removes everything it created: the output dir lists exactly what it listed before
(save/pipeline.py CheckpointWriter.write). The multi-rank cases (shared and per-rank output dirs)
are in tests/test_multirank.py; rank-only saves that could never commit are refused here and in
tests/test_dist_guard.py."""
from __future__ import annotations

import hashlib
import os

import pytest
import torch

import recsave.save.pipeline as pipeline
from recsave import HashTable, Saver, StorageError, UsageError, knobs
from recsave.format.writer import RowSource
from recsave.save.snapshot import TableState
from recsave.storage.lock import LOCK_FILE


def _model():
    model = torch.nn.Module()
    model.a = HashTable(4, name="a", seed=1)
    model.b = HashTable(4, name="b", seed=2)
    model.a(torch.arange(300))
    model.b(torch.arange(200))
    model.lin = torch.nn.Linear(2, 2)
    return model


def _snapshot(root):
    """Every path under root with the sha256 of its bytes (directories map to None; the writer
    lock, rewritten as the saver holds it, maps to "lock")."""
    out = {}
    for base, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(base, d), root)] = None
        for f in files:
            if f == LOCK_FILE:
                out[os.path.relpath(os.path.join(base, f), root)] = "lock"
                continue
            with open(os.path.join(base, f), "rb") as fh:
                out[os.path.relpath(os.path.join(base, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture
def saver(tmp_path):
    s = Saver(_model(), output_dir=str(tmp_path / "out"), max_keep=None)
    s.save("ckpt_1")
    yield s
    s.close()


def _fetch_fails(monkeypatch, table):
    """Table `table`'s embedding is written from a RowSource whose fetch raises half way."""
    real = TableState.row_source

    def row_source(self, column, rows, buffers=None):
        src = real(self, column, rows, buffers)
        if self.table.table_name != table or column != "embedding":
            return src

        def fetch(a, b):
            if b >= src.shape[0]:
                raise RuntimeError("device lost (injected)")
            return src.fetch(a, b)
        return RowSource(src.dtype, src.shape, fetch)
    monkeypatch.setattr(TableState, "row_source", row_source)


def _second_write_shards_fails(monkeypatch):
    real, calls = pipeline.write_shards, []

    def write_shards(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise StorageError("sparse-0-1.safetensors: writing failed: No space left on device (injected)")
        return real(*args, **kwargs)
    monkeypatch.setattr(pipeline, "write_shards", write_shards)


def _model_pt_fails(monkeypatch):
    real = pipeline.torchio.save

    def save(storage, directory, fname, obj, rank):
        if fname == pipeline.MODEL_FILE:
            raise StorageError(f"{fname}: writing failed: Input/output error (injected)")
        return real(storage, directory, fname, obj, rank)
    monkeypatch.setattr(pipeline.torchio, "save", save)


INJECT = {
    "fetch_first_table": (lambda mp: _fetch_fails(mp, "a"), RuntimeError, "device lost"),
    "fetch_second_table": (lambda mp: _fetch_fails(mp, "b"), RuntimeError, "device lost"),
    "write_shards": (_second_write_shards_fails, StorageError, "No space left"),
    "model.pt": (_model_pt_fails, StorageError, "Input/output error"),
}


@pytest.mark.parametrize("queued", [1, 64])  # durable files committed one by one, or together
@pytest.mark.parametrize("how", sorted(INJECT))
def test_a_failed_save_leaves_the_output_dir_as_it_was(saver, monkeypatch, how, queued):
    inject, exc_type, fragment = INJECT[how]
    before = _snapshot(saver.output_dir)
    inject(monkeypatch)
    with knobs.override(max_queued_commits=queued, fsync=True, write_block_bytes=256):
        with pytest.raises(exc_type, match=fragment):
            saver.save("ckpt_2")
    assert _snapshot(saver.output_dir) == before
    monkeypatch.undo()
    saver.save("ckpt_2")  # nothing in the way of the next save
    assert [os.path.basename(p) for p in saver.checkpoints()] == ["ckpt_1", "ckpt_2"]


def test_a_failed_async_save_leaves_the_output_dir_as_it_was(saver, monkeypatch):
    before = _snapshot(saver.output_dir)
    _second_write_shards_fails(monkeypatch)
    _, write = saver.async_save("ckpt_2")
    with pytest.raises(StorageError, match="No space left"):
        write.result(timeout=60)
    with pytest.raises(StorageError):
        saver.wait()
    assert _snapshot(saver.output_dir) == before


def test_a_refused_prepare_removes_nothing(saver, monkeypatch):
    """A save refused before anything was written (here: the id is committed already) deletes
    nothing, the committed checkpoint least of all."""
    before = _snapshot(saver.output_dir)
    with pytest.raises(FileExistsError, match="committed checkpoint already"):
        saver.save("ckpt_1")
    assert _snapshot(saver.output_dir) == before


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2"}, {"WORLD_SIZE": "3", "RANK": "2"}, {"RANK": "1"},
                                 {"WORLD_SIZE": "two"}, {"RANK": "-1", "WORLD_SIZE": "2"}])
def test_a_rank_only_save_from_the_environment_is_refused_before_writing(tmp_path, monkeypatch, env):
    """RANK / WORLD_SIZE that describe a rank of a bigger job, or nothing usable, with no process
    group: such a save could never be committed by all ranks together."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "out"
    s = Saver(_model(), output_dir=str(out))
    with pytest.raises(UsageError, match="RANK|WORLD_SIZE"):
        s.save("ckpt_1")
    assert not out.exists()
