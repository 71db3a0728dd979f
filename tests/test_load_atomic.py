"""Loads are all-or-nothing: a load that fails (damaged bytes, an object refusing its state) leaves
the model, its optimizers and registered objects exactly as they were (load/transaction.py)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import assert_jobs_equal, job_state, make_job, tables_of

import recsave
from recsave import CorruptCheckpointError
from recsave.tables.hashtable import HashTable


def _flip(ckpt: str, tensor: str) -> None:
    """Flips one byte in the middle of `tensor`'s bytes in its shard file."""
    with open(os.path.join(ckpt, "index")) as f:
        (chunk,) = json.load(f)["tensors"][tensor]["chunks"]
    with open(os.path.join(ckpt, chunk["file"]), "r+b") as f:
        f.seek(chunk["offset"] + chunk["length"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))


def _trained(out, steps: int = 4):
    job = make_job(str(out))
    job.train(steps)
    return job


@pytest.mark.parametrize("tensor", ["item@id", "item@embedding", "user@adagrad_acc", "user@embedding"])
def test_a_damaged_table_leaves_the_trained_model_unchanged(tmp_path, tensor):
    """The first table in load order ('item') loads fine and the second ('user') is damaged, or the
    first is: either way neither table, the dense part nor the optimizers change."""
    out = tmp_path / "run"
    job = _trained(out)
    ckpt = job.saver.save("ckpt_4")
    job.train(3)  # the live model now differs from the checkpoint
    before = job_state(job)
    _flip(ckpt, tensor)
    with pytest.raises(CorruptCheckpointError):
        job.saver.load()
    assert_jobs_equal(job_state(job), before)
    assert all(len(t) > 0 for t in tables_of(job.model).values())


class _Refuses:
    """A registered object whose state cannot be loaded back."""

    def __init__(self) -> None:
        self.value = 1

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state) -> None:
        raise RuntimeError("refusing this state")


def test_an_extra_that_fails_to_load_undoes_tables_and_dense(tmp_path):
    out = tmp_path / "run"
    job = _trained(out)
    job.saver.register_for_checkpointing("stubborn", _Refuses())
    job.saver.save("ckpt_4")
    job.train(3)
    before = job_state(job)
    with pytest.raises(RuntimeError, match="refusing this state"):
        job.saver.load()
    assert_jobs_equal(job_state(job), before)


class _Reader:
    """An io state that fails after partly applying a state (as a buggy reader might)."""

    def __init__(self) -> None:
        self.offset = 7

    def dump_io_state(self):
        return {"offset": self.offset}

    def load_io_state(self, state) -> None:
        self.offset = state["offset"]
        if state["offset"] == 99:
            raise RuntimeError("reader cannot seek there")


def test_an_io_state_that_fails_undoes_everything_before_it(tmp_path):
    out = tmp_path / "run"
    job = _trained(out)
    reader = _Reader()
    job.saver.register_io_state("feed", reader)
    reader.offset = 99
    job.saver.save("ckpt_4")
    reader.offset = 7
    job.train(3)
    before = job_state(job)
    with pytest.raises(RuntimeError, match="cannot seek"):
        job.saver.load()
    assert reader.offset == 7  # its own partial change undone too
    assert_jobs_equal(job_state(job), before)


def test_a_model_bank_with_one_damaged_entry_changes_nothing(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    _trained(good).saver.save("ckpt_4")
    bad_ckpt = _trained(bad, steps=6).saver.save("ckpt_6")
    _flip(bad_ckpt, "item@embedding")
    job = _trained(tmp_path / "live", steps=2)
    before = job_state(job)
    with pytest.raises(CorruptCheckpointError):
        job.saver.load_model_bank([{"path": str(good)}, {"path": str(bad), "load": ["item*"]}])
    assert_jobs_equal(job_state(job), before)


def test_a_successful_reload_replaces_the_live_rows(tmp_path):
    """The staged path still loads exactly: reload into a model that trained on (more rows)."""
    out = tmp_path / "run"
    job = _trained(out)
    job.saver.save("ckpt_4")
    saved = job_state(job)
    job.train(5)
    job.saver.load()
    assert_jobs_equal(job_state(job), saved)


def test_swap_contents_commits_and_rolls_back(tmp_path):
    live = HashTable(4, "t")
    live(torch.tensor([1, 2, 3]))
    staged = live.new_like()
    assert len(staged) == 0 and staged.embedding_dim == 4
    staged(torch.tensor([7]))
    before = live.export()
    live.swap_contents(staged)
    assert live.ids().tolist() == [7] and sorted(staged.ids().tolist()) == [1, 2, 3]
    live.swap_contents(staged)
    after = live.export()
    assert all(torch.equal(a, b) for a, b in zip(before[:2], after[:2]))
    with pytest.raises(recsave.UsageError, match="cannot swap"):
        live.swap_contents(HashTable(8, "t"))


def test_new_like_copies_rows_slots_and_partition():
    live = HashTable(4, "t")
    live.add_slot("acc", 0.5)
    ids = torch.tensor([5, 6])
    live(ids)
    live.slot("acc")[:2] = 3.0
    copy = live.new_like(copy_rows=True)
    a, b = live.export(ids), copy.export(ids)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2]["acc"], b[2]["acc"])
    assert copy.slot_init("acc") == 0.5


@pytest.mark.parametrize("nth", [1, 2])
def test_an_error_right_after_a_table_is_swapped_in_is_undone(tmp_path, monkeypatch, nth):
    """An error (or an interrupt) that lands after a table's contents were swapped in, before the
    transaction recorded it, leaves the model as it was (benchmarks/stress_load.py found it)."""
    out = tmp_path / "run"
    job = _trained(out)
    job.saver.save("ckpt_4")
    job.train(3)
    before = job_state(job)
    real, calls = HashTable.swap_contents, []

    def swap_then_fail(self, other):
        real(self, other)
        calls.append(self.table_name)
        if len(calls) == nth:
            raise KeyboardInterrupt("interrupted right after the swap")
    monkeypatch.setattr(HashTable, "swap_contents", swap_then_fail)
    with pytest.raises(KeyboardInterrupt):
        job.saver.load()
    monkeypatch.undo()
    assert_jobs_equal(job_state(job), before)


def _saved_then_rank0_of_2(out, monkeypatch):
    """A job that saved ckpt_4 and trained on, its state then, and RANK / WORLD_SIZE saying rank 0
    of 2 (a load then makes its tables rank 0's shards)."""
    job = _trained(out)
    job.saver.save("ckpt_4")
    job.train(3)
    before = job_state(job)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    return job, before


def test_a_failed_partition_change_after_the_swap_is_undone(tmp_path, monkeypatch):
    job, before = _saved_then_rank0_of_2(tmp_path / "run", monkeypatch)

    def refuse(self, *args):
        raise RuntimeError("set_partition failed (injected)")
    monkeypatch.setattr(HashTable, "set_partition", refuse)
    with pytest.raises(RuntimeError, match="injected"):
        job.saver.load(load_conf={"exclude": ["io_state"]})
    monkeypatch.undo()
    assert_jobs_equal(job_state(job), before)
    assert all(t.partition is None for t in tables_of(job.model).values())


def test_a_failed_load_drops_its_staged_tables_even_while_the_error_is_kept(tmp_path, monkeypatch):
    """The caller may keep the exception (its traceback references the load's frames): the scratch
    tables holding the staged rows must not live on with it."""
    import gc
    import weakref

    out = tmp_path / "run"
    job = _trained(out)
    ckpt = job.saver.save("ckpt_4")
    _flip(ckpt, "user@embedding")
    staged = []
    real_new_like = HashTable.new_like

    def tracked(self, copy_rows=False):
        table = real_new_like(self, copy_rows)
        staged.append(weakref.ref(table))
        return table

    monkeypatch.setattr(HashTable, "new_like", tracked)
    with pytest.raises(CorruptCheckpointError) as kept:
        job.saver.load()
    gc.collect()
    assert staged and all(ref() is None for ref in staged), "staged tables outlived the failed load"
    assert kept.value is not None


def test_rollback_runs_every_undo_step_and_names_the_one_that_failed():
    from recsave.load.transaction import LoadTransaction

    undone = []

    def change(name, undo_fails=False, apply_fails=False):
        def apply():
            if apply_fails:
                raise RuntimeError(f"{name} refused its state")

            def undo():
                undone.append(name)
                if undo_fails:
                    raise RuntimeError(f"{name} cannot go back")
            return undo
        return apply

    tx = LoadTransaction({}, {})
    tx.stage_call("extra a", change("a", undo_fails=True))
    tx.stage_call("extra b", change("b"))
    tx.stage_call("extra c", change("c", apply_fails=True))
    with pytest.raises(recsave.RecsaveError, match="could not restore extra a") as exc:
        tx.apply()
    assert undone == ["b", "a"]  # newest first, and b's undo ran although a's failed after it
    assert "c refused its state" in str(exc.value.__context__)


@pytest.mark.parametrize("fails", [False, True, "slots_only"])
def test_a_load_in_one_process_makes_a_shard_whole_again(tmp_path, fails):
    """A table left the shard of rank 0 of 2 (by an earlier multi-rank save or load) takes a
    one-process load whole: every id of the checkpoint, no longer partitioned. A load that fails
    after staging leaves it the shard it was, with its rows; so does a load of its slots alone
    (its rows stay the shard's)."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.user = HashTable(4, name="user")

    src = M()
    src.user(torch.arange(100))
    source = recsave.Saver(src, output_dir=str(tmp_path / "a"))
    source.register_for_checkpointing("stubborn", _Refuses())
    source.save("ckpt_1")
    model = M()
    model.user.set_partition(0, 2)
    mine = torch.arange(100)[recsave.partition.owner_of(torch.arange(100), 2) == 0]
    model.user(mine)
    before = model.user.export(mine)[1].clone()
    saver = recsave.Saver(model, output_dir=str(tmp_path / "t"))
    if fails == "slots_only":
        model.user.add_slot("acc")
        src.user.add_slot("acc", 0.5)
        recsave.Saver(src, output_dir=str(tmp_path / "b")).save("ckpt_1")
        saver.load_model_bank([{"path": str(tmp_path / "b"), "load": ["sparse_opt"]}])
        assert model.user.partition == (0, 2, 4096) and len(model.user) == mine.numel()
        assert torch.equal(model.user.export(mine)[1], before)
        assert float(model.user.export(mine)[2]["acc"].min()) == 0.5
        return
    if fails:  # its state is refused once every table is staged
        saver.register_for_checkpointing("stubborn", _Refuses())
        with pytest.raises(RuntimeError, match="refusing this state"):
            saver.load_model_bank([{"path": str(tmp_path / "a")}])
        assert model.user.partition == (0, 2, 4096) and len(model.user) == mine.numel()
        assert torch.equal(model.user.export(mine)[1], before)
        return
    saver.load_model_bank([{"path": str(tmp_path / "a"), "exclude": ["stubborn"]}])
    assert model.user.partition is None and len(model.user) == 100
    assert torch.equal(model.user.export(torch.arange(100))[1], src.user.export(torch.arange(100))[1])


def test_a_merge_as_one_rank_of_a_table_holding_other_ranks_ids_is_refused_unchanged(tmp_path, monkeypatch):
    """A load keeping the table's rows (hashtable_clear=False) as rank 0 of 2 makes the table that
    rank's shard: the rows of rank 1's buckets it held would have stayed in it (its next save
    refuses them, their owner never finds them). Refused first, the model as it was."""
    job, before = _saved_then_rank0_of_2(tmp_path / "run", monkeypatch)
    with pytest.raises(recsave.UsageError, match=r"holds id -?\d+ of rank 1 \(\d+ id\(s\) of other ranks in all\); "
                                                 r"route the ids .* or load with hashtable_clear=True"):
        job.saver.load(load_conf={"exclude": ["io_state"], "hashtable_clear": False})
    monkeypatch.undo()
    assert_jobs_equal(job_state(job), before)
    assert all(t.partition is None for t in tables_of(job.model).values())
