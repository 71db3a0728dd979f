"""Delta chains across writers and damage marks: a save never replaces a checkpoint a listed delta
builds on, and a Saver never writes a delta of a parent another writer has saved again since (its
remembered parents, steps and metrics are read again once its writer lock is taken anew)."""
from __future__ import annotations

import glob
import os
import shutil
import warnings

import pytest
import torch

from recsave import CheckpointExistsError, HashTable, Saver


class _Model(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.t = HashTable(4, name="t", seed=seed)
        self.lin = torch.nn.Linear(2, 1)


def _set(model: _Model, ids, value: float) -> None:
    ids = torch.tensor(ids, dtype=torch.int64)
    rows = model.t.lookup(ids, insert=True)
    with torch.no_grad():
        model.t.weight[rows] = value
    model.t.mark_changed(ids)


def _state(model: _Model):
    ids = torch.sort(model.t.ids()).values
    return {int(i): float(v[0]) for i, v in zip(ids, model.t.export(ids)[1])}


def _restored(out: str, ckpt_id: str):
    model = _Model(seed=99)
    saver = Saver(model, output_dir=out, max_keep=None)
    saver.load(ckpt_id=ckpt_id)
    saver.close()
    return _state(model)


def _listed(out: str):
    with open(os.path.join(out, "checkpoint")) as f:
        return f.read().split()


def _another_writer_saves_again(out: str, ckpt_id: str, ids, value: float, load=None) -> None:
    """A second Saver (restored from `load`, if given) deletes `ckpt_id` and saves it anew."""
    model = _Model()
    saver = Saver(model, output_dir=out, max_keep=None)
    if load is not None:
        saver.load(ckpt_id=load)
    shutil.rmtree(os.path.join(out, ckpt_id))
    _set(model, ids, value)
    saver.save(ckpt_id)
    saver.close()


def _next_delta_save_is_full(saver: Saver, model: _Model, ids, value: float) -> None:
    _set(model, ids, value)
    saver.save("c", incremental=True)
    assert saver.last_save_kind == "full"
    saver.close()


def _save_a_b_c(out: str):
    """a (full), b (delta of a), c (delta of b); returns the Saver (open) and c's state."""
    model = _Model()
    saver = Saver(model, output_dir=out, max_keep=None)
    _set(model, [1, 2, 3], 1.0)
    saver.save("a")
    _set(model, [2], 2.0)
    saver.save("b", incremental=True)
    _set(model, [3], 3.0)
    saver.save("c", incremental=True)
    return saver, _state(model)


def _save_a_x(out: str):
    """a = {1: 1, 2: 1} and x = {1: 5, 2: 1}, both full; the Saver closed (its lock released)."""
    model = _Model()
    saver = Saver(model, output_dir=out, max_keep=None)
    _set(model, [1, 2], 1.0)
    saver.save("a")
    _set(model, [1], 5.0)
    saver.save("x")
    saver.close()
    return saver, model


def _chain_a_b_c(out: str):
    """_save_a_b_c; then b's shard goes missing and a fallback load of a fresh Saver skips c and
    b (both marked damaged), loads a, and the shard comes back."""
    saver, expected = _save_a_b_c(out)
    saver.close()
    shard = glob.glob(os.path.join(out, "b", "sparse-*"))[0]
    os.rename(shard, shard + ".away")  # a network file system's hiccup
    again = Saver(_Model(seed=5), output_dir=out, max_keep=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        again.load(fallback=True)
    assert sorted(again.damaged_checkpoints) == ["b", "c"]
    os.rename(shard + ".away", shard)
    return again, expected


@pytest.mark.parametrize("then", ["save_b", "make_latest_c"])
def test_a_load_of_a_delta_clears_the_damage_marks_of_its_whole_chain(tmp_path, then):
    out = str(tmp_path / "out")
    saver, expected = _chain_a_b_c(out)
    saver.load(ckpt_id="c")  # reads c's chain whole, b included
    assert _state(saver.model) == expected
    assert saver.damaged_checkpoints == set()
    if then == "make_latest_c":  # b stays listed: c needs it
        saver.make_latest("c")
        assert _listed(out) == ["a", "b", "c"]
    with pytest.raises(CheckpointExistsError):
        saver.save("b")
    saver.close()
    assert _restored(out, "c") == expected


def test_make_latest_keeps_a_damaged_checkpoint_a_listed_delta_needs(tmp_path):
    """make_latest unlists what a fallback found damaged, as a save does, but not a chain member
    of a checkpoint that stays listed: c listed without b could never load."""
    out = str(tmp_path / "out")
    saver, expected = _chain_a_b_c(out)
    saver.make_latest("c")
    assert _listed(out) == ["a", "b", "c"]
    saver.close()
    assert _restored(out, "c") == expected


@pytest.mark.parametrize("shard_away", [False, True])
def test_an_unlisted_checkpoint_a_listed_delta_needs_is_never_replaced(tmp_path, shard_away):
    """b left out of the `checkpoint` list (edited by hand) while listed c builds on it: a save of
    id b is refused instead of taking b for a crashed save's leftover and replacing it, also while
    one of its shard files is away (only the index tells: with per-rank disks rank 0 never holds
    the other ranks' shards, and a file missing for a while is no proof of loss)."""
    out = str(tmp_path / "out")
    saver, expected = _save_a_b_c(out)
    with open(os.path.join(out, "checkpoint"), "w") as f:
        f.write("a\nc\n")
    shard = glob.glob(os.path.join(out, "b", "sparse-*"))[0]
    if shard_away:
        os.rename(shard, shard + ".away")
    with pytest.raises(CheckpointExistsError, match="delta chain member of the committed checkpoint"):
        saver.save("b")
    saver.close()
    if shard_away:
        os.rename(shard + ".away", shard)
    assert _listed(out) == ["a", "c"]
    assert _restored(out, "c") == expected


def test_a_saver_never_writes_a_delta_of_a_parent_another_writer_saved_again(tmp_path):
    """s1 saves a and x, and closes; s2 rewinds to a and saves x anew; s1's next incremental save
    must not be a delta of the new x (it would restore rows s1 never had): it is full."""
    out = str(tmp_path / "out")
    s1, m1 = _save_a_x(out)
    _another_writer_saves_again(out, "x", [2, 3], 7.0, load="a")
    _next_delta_save_is_full(s1, m1, [2], 9.0)
    assert _restored(out, "c") == {1: 5.0, 2: 9.0}


def test_rotation_reads_parents_again_once_its_lock_is_taken_anew(tmp_path):
    """s1 remembers x as a full checkpoint; s2 (max_keep=1) prunes it and saves x anew as a delta
    of b. s1's next save with max_keep=2 keeps x, and so must keep b (the new x needs it): every
    listed checkpoint loads."""
    out = str(tmp_path / "out")
    s1, m1 = _save_a_x(out)
    m2 = _Model()
    s2 = Saver(m2, output_dir=out, max_keep=1)
    s2.load(ckpt_id="a")
    _set(m2, [2], 7.0)
    s2.save("b", incremental=True)  # rotation prunes x
    s2.wait()
    _set(m2, [3], 8.0)
    s2.save("x", incremental=True)  # x is now a delta of b
    x_state = _state(m2)
    s2.close()
    s1.max_keep = 2
    _next_delta_save_is_full(s1, m1, [4], 9.0)  # its parent x is another writer's now
    assert _listed(out) == ["a", "b", "x", "c"]  # max_keep's two, and the chain the new x needs
    assert _restored(out, "x") == x_state
    assert _restored(out, "c") == {1: 5.0, 2: 1.0, 4: 9.0}


def test_a_parent_saved_again_during_a_delta_save_fails_it_and_commits_nothing(tmp_path, monkeypatch):
    """The parent is replaced after the save decided on a delta (here: its check is skipped):
    the commit finds the parent's index changed, raises WriterLockedError and writes nothing."""
    import recsave.save.delta as delta
    from recsave import WriterLockedError

    out = str(tmp_path / "out")
    s1, m1 = _save_a_x(out)
    _another_writer_saves_again(out, "x", [3], 7.0)
    monkeypatch.setattr(delta, "_parent_problem", lambda *args: None)
    _set(m1, [2], 9.0)
    with pytest.raises(WriterLockedError, match="saved again by another writer"):
        s1.save("c", incremental=True)
    assert _listed(out) == ["a", "x"] and not os.path.exists(os.path.join(out, "c"))
    monkeypatch.undo()
    _next_delta_save_is_full(s1, m1, [2], 9.0)  # the failed save forgot its baseline
    assert _restored(out, "c") == {1: 5.0, 2: 9.0}


def test_a_saver_restored_from_a_checkpoint_another_writer_saved_again_saves_full(tmp_path):
    """s1 restores x whole (its next delta's parent); s2 replaces x; s1's incremental save must
    not be a delta of s2's x: it is full, and restores s1's rows."""
    out = str(tmp_path / "out")
    _save_a_x(out)
    m1 = _Model()
    s1 = Saver(m1, output_dir=out, max_keep=None)
    s1.load(ckpt_id="x")
    assert s1.delta_parent is not None and s1.delta_parent.endswith("x")
    _another_writer_saves_again(out, "x", [3], 7.0)
    _next_delta_save_is_full(s1, m1, [2], 9.0)
    assert _restored(out, "c") == {1: 5.0, 2: 9.0}


def test_a_saver_restored_from_its_own_checkpoint_still_saves_deltas(tmp_path):
    out = str(tmp_path / "out")
    m0 = _Model()
    s0 = Saver(m0, output_dir=out, max_keep=None)
    _set(m0, [1, 2], 1.0)
    s0.save("a")
    _set(m0, [2], 2.0)
    s0.save("b", incremental=True)
    s0.close()
    m1 = _Model()
    s1 = Saver(m1, output_dir=out, max_keep=None)
    s1.load(ckpt_id="b")
    _set(m1, [3], 3.0)
    s1.save("c", incremental=True)
    assert s1.last_save_kind == "delta"
    s1.close()
    from recsave.format import read_index
    assert (read_index(os.path.join(out, "c")).parent.id, read_index(os.path.join(out, "c")).base) == ("b", "a")
    assert _restored(out, "c") == {1: 1.0, 2: 2.0, 3: 3.0}


@pytest.mark.parametrize("writer_lock", [True, False])
def test_rotation_reads_no_index_again_while_the_saver_holds_the_dir(tmp_path, monkeypatch, writer_lock):
    """What a writer remembers of other checkpoints is dropped only when it takes the directory
    anew (after close()), with the writer_lock knob on or off: not on every save."""
    from recsave import knobs
    from recsave.format import chain

    reads = []
    real = chain.parent_ids
    monkeypatch.setattr(chain, "parent_ids", lambda *args: reads.append(args[-1]) or real(*args))
    model = _Model()
    out = str(tmp_path / "out")
    with knobs.override(writer_lock=writer_lock):
        saver = Saver(model, output_dir=out, max_keep=2)
        for i in range(5):
            _set(model, [i], float(i))
            saver.save(f"ckpt_{i}")
        assert reads == []
        saver.close()
        saver.save("ckpt_5")  # taken anew: the kept ckpt_4's parents are read again
        assert reads == ["ckpt_4"]
        saver.close()


def test_a_partial_load_of_a_delta_keeps_the_marks_of_a_parent_damaged_for_good(tmp_path):
    """b's shard is gone for good: a load of c's dense part alone reads none of b's shards (nor
    c's), so both stay marked damaged, and a save of id b replaces it (c cannot be loaded whole
    anyway)."""
    out = str(tmp_path / "out")
    saver, _ = _chain_a_b_c(out)
    os.remove(glob.glob(os.path.join(out, "b", "sparse-*"))[0])
    report = saver.load(ckpt_id="c", load_conf={"load": ["lin*"]})
    assert report.read_whole == []
    assert saver.damaged_checkpoints == {"b", "c"}
    saver.save("b")
    saver.close()
    assert _listed(out)[-1] == "b"


def test_a_re_save_between_a_restore_and_its_end_is_noticed(tmp_path, monkeypatch):
    """Another writer saves x again after the restore read x's index, before the restore returns:
    the CRC the Saver keeps is that of the bytes the load read, so the next save is full."""
    from recsave.save import restore

    out = str(tmp_path / "out")
    _save_a_x(out)
    real = restore.baseline_after_load

    def racing(*args, **kwargs):
        baseline = real(*args, **kwargs)
        _another_writer_saves_again(out, "x", [3], 7.0)
        return baseline
    monkeypatch.setattr(restore, "baseline_after_load", racing)
    m1 = _Model()
    s1 = Saver(m1, output_dir=out, max_keep=None)
    s1.load(ckpt_id="x")
    monkeypatch.undo()
    _next_delta_save_is_full(s1, m1, [2], 9.0)
    assert _restored(out, "c") == {1: 5.0, 2: 9.0}


def test_a_partial_load_clears_no_damage_mark_not_even_its_own(tmp_path):
    """c's shard is gone for good: a fallback load marks c damaged; a load of c's dense part alone
    reads none of its shards, so c stays marked, and a save of id c replaces it."""
    out = str(tmp_path / "out")
    saver, _ = _save_a_b_c(out)
    saver.close()
    os.remove(glob.glob(os.path.join(out, "c", "sparse-*"))[0])
    again = Saver(_Model(seed=5), output_dir=out, max_keep=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        again.load(fallback=True)
    assert again.damaged_checkpoints == {"c"}
    report = again.load(ckpt_id="c", load_conf={"load": ["lin*"]})
    assert report.read_whole == [] and again.damaged_checkpoints == {"c"}
    again.save("c")
    again.close()
    assert _listed(out) == ["a", "b", "c"]
