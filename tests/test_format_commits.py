"""Durable shard files committed together (recsave/format/commits.py)."""
import os

import pytest
import torch
from conftest import raw_bytes

import recsave.knobs
from recsave import format as fmt
from recsave.errors import RecsaveError
from recsave.format.commits import DeferredCommits


def _tensors(k: int) -> dict:
    return {f"t{k}": torch.arange(1000, dtype=torch.float32) * (k + 1)}


def _write(directory, commits, k: int) -> dict:
    with recsave.knobs.override(fsync=True):
        return fmt.write_shards(str(directory), _tensors(k), first_part=k, commits=commits)


def test_queued_files_appear_only_when_committed_together(tmp_path):
    with DeferredCommits() as commits:
        parts = [_write(tmp_path, commits, k) for k in range(3)]
        names = [next(iter(p.files)) for p in parts]
        assert not any(os.path.exists(tmp_path / n) for n in names)
        assert len(os.listdir(tmp_path)) == 3  # the temporaries
    assert sorted(os.listdir(tmp_path)) == sorted(names)
    fmt.write_index(str(tmp_path), fmt.merge_parts(parts))
    got = fmt.read_tensors(str(tmp_path))
    want = {k: v for i in range(3) for k, v in _tensors(i).items()}
    assert set(got) == set(want) and all(raw_bytes(got[k]) == raw_bytes(want[k]) for k in want)


def test_error_in_the_block_removes_the_queued_files(tmp_path):
    with pytest.raises(KeyError):
        with DeferredCommits() as commits:
            _write(tmp_path, commits, 0)
            _write(tmp_path, commits, 1)
            raise KeyError("boom")
    assert os.listdir(tmp_path) == []


def test_a_failed_commit_is_raised_after_the_others_finish(tmp_path):
    blocker = tmp_path / fmt.shard_file_name("sparse", 0, 1)
    blocker.mkdir()  # the second file cannot be renamed onto a non-empty directory
    (blocker / "x").write_bytes(b"x")
    with pytest.raises(RecsaveError) as exc:
        with DeferredCommits() as commits:
            parts = [_write(tmp_path, commits, k) for k in range(3)]
    assert str(blocker) in str(exc.value)
    names = [next(iter(p.files)) for p in parts]
    assert sorted(os.listdir(tmp_path)) == sorted(names)  # 0 and 2 committed, 1's temporary removed
    assert os.path.isdir(blocker) and os.listdir(blocker) == ["x"]


def test_a_long_queue_is_committed_early(tmp_path):
    with recsave.knobs.override(max_queued_commits=2), DeferredCommits() as commits:
        parts = [_write(tmp_path, commits, k) for k in range(3)]
        names = [next(iter(p.files)) for p in parts]
        assert [os.path.exists(tmp_path / n) for n in names] == [True, True, False]
    assert sorted(os.listdir(tmp_path)) == sorted(names)


def test_files_that_are_not_durable_are_committed_at_once(tmp_path):
    with DeferredCommits() as commits:
        with recsave.knobs.override(fsync=False):
            part = fmt.write_shards(str(tmp_path), _tensors(0), commits=commits)
        assert os.listdir(tmp_path) == list(part.files)
