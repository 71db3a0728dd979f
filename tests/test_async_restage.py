"""Knob stage_changed_rows: an async full save copies only the rows changed since the Saver's
previous async save (or its prepare_async) into the host copy it keeps, and still writes the same
bytes as a synchronous save of the same state. Whenever the copy may be out of date (another save
moved the change baseline, a delta or a load since, a new slot, a cleared table, the knob off)
every row is copied. prepare_async fills that copy ahead of the first async save, also while
training writes rows."""
from __future__ import annotations

import shutil
import threading

import pytest
import torch
from helpers import assert_jobs_equal, checkpoint_bytes, job_state, make_job, tables_of, train
from test_async_save import held_async_save

from recsave import HashTable, Saver, knobs
from recsave.errors import UsageError
from recsave.storage.lock import LOCK_FILE
from recsave.tables.optim import SparseAdagrad
from recsave.tables.rows import copy_rows


def _rows(job) -> int:
    return sum(len(t) for t in tables_of(job.model).values())


def _async(job, ckpt_id: str) -> str:
    _, write = job.saver.async_save(ckpt_id)
    return write.result(timeout=60)


def _same_bytes(sync_dir: str, async_dir: str) -> None:
    a, b = checkpoint_bytes(sync_dir), checkpoint_bytes(async_dir)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name


def _twins(tmp_path):
    """Two identical jobs: `ref` saves synchronously, `job` asynchronously."""
    return make_job(str(tmp_path / "ref")), make_job(str(tmp_path / "job"))


def _both(ref, job, fn) -> None:
    fn(ref)
    fn(job)


def test_changed_rows_only_and_byte_identical_to_a_sync_save(tmp_path):
    ref, job = _twins(tmp_path)
    with knobs.override(stage_changed_rows=True):
        _both(ref, job, lambda j: train(j.model, [j.sparse_opt, j.dense_opt], 4))
        _async(job, "ckpt_4")
        assert job.saver.last_save.staged_rows == _rows(job)  # the first copies every row
        _both(ref, job, lambda j: train(j.model, [j.sparse_opt, j.dense_opt], 2, start=4))
        # rows written directly and marked, rows deleted (their row later reused by a new id)
        for j in (ref, job):
            table = tables_of(j.model)["user"]
            ids = table.ids()[:3]
            with torch.no_grad():
                table.weight[table.lookup(ids, insert=False)] += 1.0
            assert table.mark_changed(ids) == 3
            assert table.delete(table.ids()[5:9]) == 4
        _both(ref, job, lambda j: train(j.model, [j.sparse_opt, j.dense_opt], 1, start=6))
        path = _async(job, "ckpt_7")
        staged = job.saver.last_save.staged_rows
        assert 0 < staged < _rows(job)
        _same_bytes(ref.saver.save("ckpt_7"), path)
        # nothing changed: only the ids and dense state are copied again
        path = _async(job, "ckpt_8")
        assert job.saver.last_save.staged_rows == 0
        _same_bytes(ref.saver.save("ckpt_8"), path)
    ref.saver.close()
    job.saver.close()


def _check_second_copy(tmp_path, between, whole=("item", "user")) -> None:
    """Two async saves with `between(job)` run in between (after a training step; no deletes): the
    second is byte-identical to a synchronous save of the same state and copies every row of the
    tables in `whole`, and of the others only the rows changed since the first."""
    ref, job = _twins(tmp_path)
    with knobs.override(stage_changed_rows=True):
        _both(ref, job, lambda j: train(j.model, [j.sparse_opt, j.dense_opt], 3))
        _async(job, "ckpt_3")
        _both(ref, job, lambda j: train(j.model, [j.sparse_opt, j.dense_opt], 1, start=3))
        between(job)
        between(ref)
        expect = sum(len(t) if name in whole else t.pending_changes().rows.numel()
                     for name, t in tables_of(job.model).items())
        path = _async(job, "ckpt_9")
        _same_bytes(ref.saver.save("ckpt_9"), path)
        assert job.saver.last_save.staged_rows == expect
    ref.saver.close()
    job.saver.close()


def _on_job(action):
    return lambda j: action(j) if j.saver.output_dir.endswith("job") else None


def test_a_step_in_between_copies_the_changed_rows(tmp_path):
    _check_second_copy(tmp_path, lambda j: None, whole=())


def test_a_sync_save_in_between_makes_the_next_copy_whole(tmp_path):
    _check_second_copy(tmp_path, _on_job(lambda j: j.saver.save("ckpt_5")))


def _async_delta(j, ckpt_id: str) -> None:
    _, write = j.saver.async_save(ckpt_id, incremental=True)
    write.result(timeout=60)
    assert j.saver.last_save.kind == "delta"


def test_an_async_delta_in_between_keeps_the_copy_current(tmp_path):
    """The delta copies its changed rows into the whole copy and writes them from there: the next
    full save copies only what changed after the delta."""
    _check_second_copy(tmp_path, _on_job(lambda j: _async_delta(j, "ckpt_5")), whole=())


def test_an_async_delta_without_a_current_copy_drops_it(tmp_path):
    def sync_then_delta(j):
        j.saver.save("ckpt_4b")  # moves the baseline: the copy is stale
        train(j.model, [j.sparse_opt, j.dense_opt], 1, start=50)
        _async_delta(j, "ckpt_5")  # copies its rows apart, over the stale copy's buffers
    _check_second_copy(tmp_path, lambda j: (sync_then_delta(j) if j.saver.output_dir.endswith("job")
                                            else train(j.model, [j.sparse_opt, j.dense_opt], 1, start=50)))


def test_a_new_slot_makes_that_tables_copy_whole(tmp_path):
    _check_second_copy(tmp_path, lambda j: tables_of(j.model)["item"].add_slot("extra", 0.5), whole=("item",))


def test_a_cleared_table_is_copied_whole(tmp_path):
    def clear_and_refill(j):
        table = tables_of(j.model)["item"]
        ids = table.ids()
        table.clear()
        table.lookup(ids[:10], insert=True)
    _check_second_copy(tmp_path, clear_and_refill, whole=("item",))


def test_a_restore_in_between_makes_the_copy_whole(tmp_path):
    def restore(j):
        j.saver.load(ckpt_id="ckpt_3")
        train(j.model, [j.sparse_opt, j.dense_opt], 1, start=3)  # back to the reference's state
    _check_second_copy(tmp_path, _on_job(restore))


def test_knob_off_copies_every_row(tmp_path):
    job = make_job(str(tmp_path / "job"))
    train(job.model, [job.sparse_opt, job.dense_opt], 3)
    _async(job, "ckpt_3")
    _async(job, "ckpt_4")
    assert job.saver.last_save.staged_rows == _rows(job)
    job.saver.close()


def test_unmarked_direct_writes_are_what_the_knob_trusts_away(tmp_path):
    """The documented contract: with the knob on, a row written through `weight` without
    mark_changed keeps its staged value; marking it brings the write into the next save."""
    job = make_job(str(tmp_path / "job"))
    with knobs.override(stage_changed_rows=True):
        train(job.model, [job.sparse_opt, job.dense_opt], 3)
        _async(job, "ckpt_3")
        table = tables_of(job.model)["user"]
        ids = table.ids()[:1]
        row = table.lookup(ids, insert=False)
        with torch.no_grad():
            table.weight[row] = 7.0
        _async(job, "ckpt_4")
        table.mark_changed(ids)
        _async(job, "ckpt_5")
    for ckpt, expect in (("ckpt_4", False), ("ckpt_5", True)):
        other = make_job(str(tmp_path / f"load-{ckpt}"))
        other.saver.load(str(tmp_path / "job"), ckpt_id=ckpt)
        got = tables_of(other.model)["user"].export(ids)[1]
        assert bool((got == 7.0).all()) is expect, ckpt
        other.saver.close()
    job.saver.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_copy_rows_copies_exactly_the_rows_given(dtype):
    src = torch.arange(5000 * 3).view(5000, 3).to(dtype)
    dst = torch.zeros(5000, 3, dtype=dtype)
    rows = torch.tensor([0, 1, 2, 7, 4096, 4097, 4999])  # runs, singles, both ends
    copy_rows(dst, src, rows, threads=2)
    expect = torch.zeros_like(dst)
    expect[rows] = src[rows]
    assert torch.equal(dst, expect)


def test_copy_rows_refuses_a_row_outside_either_tensor():
    src, dst = torch.ones(10, 4), torch.zeros(8, 4)
    with pytest.raises(UsageError, match="outside"):
        copy_rows(dst, src, torch.tensor([3, 8]))
    assert torch.equal(dst, torch.zeros(8, 4))  # nothing copied
    with pytest.raises(UsageError, match="outside"):
        copy_rows(dst, src, torch.tensor([-1]))


def _restored_twins(tmp_path, knob: bool):
    """A checkpoint ckpt_4 in `src`; `job` restores it through an async CheckpointManager (which
    calls prepare_async) and `ref` through a synchronous one; both then train two steps."""
    first = make_job(str(tmp_path / "src"))
    train(first.model, [first.sparse_opt, first.dense_opt], 4)
    first.saver.save("ckpt_4")
    first.saver.close()
    with knobs.override(stage_changed_rows=knob):
        job = make_job(str(tmp_path / "src"), save_interval=1000, async_mode="async")
        assert job.manager.restore() == 4
    shutil.copytree(tmp_path / "src", tmp_path / "ref", ignore=shutil.ignore_patterns(LOCK_FILE))
    ref = make_job(str(tmp_path / "ref"), save_interval=1000)
    assert ref.manager.restore() == 4
    _both(ref, job, lambda j: train(j.model, [j.sparse_opt, j.dense_opt], 2, start=4))
    return ref, job


@pytest.mark.parametrize("knob", [True, False])
def test_prepare_async_after_a_restore_gives_the_first_async_save_its_copy(tmp_path, knob):
    ref, job = _restored_twins(tmp_path, knob)
    changed = sum(t.pending_changes().rows.numel() for t in tables_of(job.model).values())
    with knobs.override(stage_changed_rows=knob):
        path = _async(job, "ckpt_6")
    _same_bytes(ref.saver.save("ckpt_6"), path)
    # with the knob only the rows written since the restore; without, every row (into filled buffers)
    assert job.saver.last_save.staged_rows == (changed if knob else _rows(job))
    assert 0 < changed < _rows(job)
    ref.saver.close()
    job.saver.close()


def test_a_load_after_prepare_async_makes_the_copy_whole(tmp_path):
    ref, job = _restored_twins(tmp_path, True)
    with knobs.override(stage_changed_rows=True):
        job.saver.prepare_async()
        job.saver.load(ckpt_id="ckpt_4")  # waits for the copy, then replaces the rows under it
        train(job.model, [job.sparse_opt, job.dense_opt], 2, start=4)
        path = _async(job, "ckpt_6")
    _same_bytes(ref.saver.save("ckpt_6"), path)
    assert job.saver.last_save.staged_rows == _rows(job)
    ref.saver.close()
    job.saver.close()


def test_prepare_async_checks_its_argument(tmp_path):
    job = make_job(str(tmp_path / "job"))
    with pytest.raises(TypeError, match="pinned"):
        job.saver.prepare_async(pinned="yes")
    job.saver.close()


def test_prepare_async_while_training_writes_rows(tmp_path):
    """Training runs while prepare_async copies a 200 MB table: the rows it writes meanwhile are
    changed since the copy's epoch, so the async save after copies them again and writes exactly
    what a synchronous save of the same state writes."""
    torch.manual_seed(0)
    table = HashTable(64, name="big", seed=1)
    model = torch.nn.ModuleDict({"big": table, "head": torch.nn.Linear(64, 1)})
    opt = SparseAdagrad(model, lr=0.1)
    rows = 400_000
    ids = torch.randperm(4 * rows)[:rows] * 7919
    table.load_rows(ids, torch.randn(rows, 64), {"adagrad_acc": torch.full((rows, 64), 0.1)})
    table.lookup(torch.tensor([-1]), insert=True)  # the storage doubles now, not during the copy
    table.reset_changes()  # a baseline, as a restore leaves (a new table's is the empty table)
    saver = Saver(model, opt, output_dir=str(tmp_path / "a"), max_keep=None)
    with knobs.override(stage_changed_rows=True):
        saver.prepare_async()
        for _ in range(40):  # each step rewrites 256 rows, some of them new
            batch = torch.cat([ids[torch.randint(0, rows, (224,))], torch.randint(1 << 40, 1 << 41, (32,))])
            model["head"](table(batch)).sum().backward()
            opt.step()
            opt.zero_grad()
        _, write = saver.async_save("ckpt_1")
        path = write.result(timeout=60)
    assert 0 < saver.last_save.staged_rows < len(table)
    sync = Saver(model, opt, output_dir=str(tmp_path / "b"), max_keep=None)
    _same_bytes(sync.save("ckpt_1"), path)
    saver.close()
    sync.close()


def test_prepare_async_waits_for_the_pending_write_whose_buffers_it_fills(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    job = make_job(out)
    job.train(3)
    gate, write, at_3 = held_async_save(job, monkeypatch, "ckpt_3")
    job.train(3)  # the model moves on while the write of ckpt_3 is held
    prepare = threading.Thread(target=job.saver.prepare_async)
    prepare.start()
    prepare.join(0.5)
    assert prepare.is_alive()  # waiting for the write, not copying over its buffers
    gate.release.set()
    prepare.join(60)
    assert write.result(timeout=60).endswith("ckpt_3")
    fresh = make_job(str(tmp_path / "fresh"))
    fresh.saver.load(out, ckpt_id="ckpt_3")
    assert_jobs_equal(job_state(fresh), at_3)
    job.saver.close()


def test_a_prefill_thread_that_cannot_start_costs_only_the_head_start(tmp_path, monkeypatch, caplog):
    job = make_job(str(tmp_path / "job"))
    train(job.model, [job.sparse_opt, job.dense_opt], 3)

    def no_thread(self):
        raise RuntimeError("can't start new thread")
    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", no_thread)
        job.saver.prepare_async()
    assert "could not start its thread" in caplog.text
    path = _async(job, "ckpt_3")  # still saves, copying everything
    assert job.saver.last_save.staged_rows == _rows(job)
    job.saver.close()
    assert path.endswith("ckpt_3")


def test_copy_rows_of_zero_width_still_checks_the_rows():
    dst, src = torch.zeros(4, 0), torch.zeros(4, 0)
    copy_rows(dst, src, torch.tensor([0, 3]))
    with pytest.raises(UsageError, match="outside"):
        copy_rows(dst, src, torch.tensor([4]))


class _DenseNamedLikeAColumn(torch.nn.Module):
    """A table named "dense" next to a dense parameter named "embedding": their host copies must not
    share a buffer."""

    def __init__(self):
        super().__init__()
        self.t = HashTable(8, name="dense", seed=1)
        self.embedding = torch.nn.Parameter(torch.randn(64, 8))


def test_a_table_named_dense_and_a_dense_tensor_named_embedding(tmp_path):
    torch.manual_seed(0)
    model = _DenseNamedLikeAColumn()
    model.t.lookup(torch.arange(64), insert=True)  # 64 rows of 8: the parameter's numel exactly
    saver = Saver(model, output_dir=str(tmp_path / "a"), max_keep=None)
    sync = Saver(model, output_dir=str(tmp_path / "b"), max_keep=None)
    with knobs.override(stage_changed_rows=True):
        for k in range(3):
            with torch.no_grad():
                model.embedding.add_(1.0)
                model.t.weight[:4] += 1.0
            model.t.mark_changed(torch.arange(4))
            _, write = saver.async_save(f"ckpt_{k}")
            _same_bytes(sync.save(f"ckpt_{k}"), write.result(timeout=60))
    saver.close()
    sync.close()


def test_an_async_delta_written_from_the_copy_restores_exactly(tmp_path):
    out = str(tmp_path / "job")
    job = make_job(out, max_keep=None)
    with knobs.override(stage_changed_rows=True):
        train(job.model, [job.sparse_opt, job.dense_opt], 3)
        _async(job, "ckpt_3")
        expected = {}
        for k in (5, 7):
            train(job.model, [job.sparse_opt, job.dense_opt], 2, start=k - 2)
            table = tables_of(job.model)["user"]
            table.delete(table.ids()[:2])  # tombstones, and freed rows a later insert reuses
            expected[k] = job_state(job)
            changed = sum(t.pending_changes().rows.numel() for t in tables_of(job.model).values())
            _async_delta(job, f"ckpt_{k}")
            assert job.saver.last_save.staged_rows == changed < _rows(job)
    for k, state in expected.items():
        fresh = make_job(str(tmp_path / f"fresh{k}"))
        fresh.saver.load(out, ckpt_id=f"ckpt_{k}")
        assert_jobs_equal(job_state(fresh), state)
    job.saver.close()


class _Tied(torch.nn.Module):
    """One unnamed HashTable under two module paths (a shared embedding): saved as 'x' and 'y'."""

    def __init__(self):
        super().__init__()
        self.x = self.y = HashTable(4, seed=3)
        self.lin = torch.nn.Linear(4, 1)

    def step(self, opt, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 300, (2, 64), generator=g)
        self.lin(self.x(ids[0]) + self.y(ids[1])).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("how", ["delta", "async_changed_rows"])
def test_a_table_under_two_names_keeps_its_changes_under_both(tmp_path, how):
    """The changes of a table reachable under two names are taken once and given to both: taken
    per name, the second name's delta (or async copy) came out empty and a restore, applying it
    last, brought back the parent's rows without an error."""
    torch.manual_seed(0)
    model = _Tied()
    opt = SparseAdagrad(model, lr=0.1)
    saver = Saver(model, opt, output_dir=str(tmp_path / "out"), max_keep=None)
    with knobs.override(stage_changed_rows=how == "async_changed_rows"):
        model.step(opt, 1)
        if how == "delta":
            saver.save("ckpt_1")
        else:
            saver.async_save("ckpt_1")[1].result(timeout=60)
        for seed in (2, 3):
            model.step(opt, seed)
        ids = torch.sort(model.x.ids()).values
        live = model.x.export(ids)
        if how == "delta":
            path = saver.save("ckpt_3", incremental=True)
            assert saver.last_save_kind == "delta"
        else:
            _, write = saver.async_save("ckpt_3")
            path = write.result(timeout=60)
            assert 0 < saver.last_save.staged_rows < 2 * len(model.x)
    saver.close()
    fresh = _Tied()
    Saver(fresh, SparseAdagrad(fresh, lr=0.1), output_dir=str(tmp_path / "fresh")).load(path, direct_path=True)
    assert torch.equal(torch.sort(fresh.x.ids()).values, ids)
    got = fresh.x.export(ids)
    assert torch.equal(got[1], live[1]) and all(torch.equal(got[2][s], live[2][s]) for s in live[2])
