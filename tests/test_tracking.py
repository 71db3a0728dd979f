"""Change tracking, row metadata and eviction of HashTable (tables/tracking.py): the input of
incremental checkpoints. Run for the C++ id map and the torch-ops map."""
import copy
import pickle

import pytest
import torch

from recsave import knobs
from recsave.errors import ArgumentTypeError, ShapeMismatchError, UsageError
from recsave.optim import SparseAdam, SparseSGD
from recsave.tables.hashtable import HashTable

MAPS = ["cpu", "tensor"]


def _table(id_map: str, dim: int = 4) -> HashTable:
    return HashTable(dim, "t", seed=3, id_map=id_map)


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _sorted(t: torch.Tensor) -> list:
    return sorted(t.tolist())


@pytest.mark.parametrize("id_map", MAPS)
def test_new_table_baseline_is_empty(id_map):
    t = _table(id_map)
    t(_ids(5, 6, 7))
    ch = t.pending_changes()
    assert ch.tracked and ch.cleared
    assert _sorted(ch.ids) == [5, 6, 7]
    assert ch.tombstones.tolist() == []
    # rows index the table's storage: the ids at those rows are the ids
    ids, rows = t.id_rows()
    assert dict(zip(ids.tolist(), rows.tolist())) == dict(zip(ch.ids.tolist(), ch.rows.tolist()))


@pytest.mark.parametrize("id_map", MAPS)
def test_id_rows_follow_every_way_rows_change(id_map):
    """id_rows (what a save writes): every live id once, by ascending row, at the row lookup gives
    it, as a copy; after inserts (no row ever freed), a delete (a hole), an insert into the freed
    row, a restore, a merge and a deep copy."""
    t = _table(id_map)
    live = set()

    def check(table: HashTable) -> None:
        ids, rows = table.id_rows()
        assert sorted(ids.tolist()) == sorted(live) and len(ids) == len(live)
        assert rows.tolist() == sorted(rows.tolist())
        assert torch.equal(table.lookup(ids, insert=False), rows)
        ids.fill_(-5)  # a copy: the next call sees the table's ids
        assert -5 not in table.id_rows()[0].tolist()

    t(_ids(10, 11, 12, 13))
    live |= {10, 11, 12, 13}
    check(t)
    t.delete(_ids(11))
    live -= {11}
    check(t)
    t(_ids(20))  # takes the freed row: no hole again
    live |= {20}
    check(t)
    t(_ids(21, 22))
    live |= {21, 22}
    check(t)
    assert t.prepare_load(_ids(7, 3, 9), ["embedding"]) is not None
    live = {7, 3, 9}
    check(t)
    t.load_rows(_ids(3, 100), torch.zeros(2, 4), clear=False)
    live |= {100}
    check(t)
    check(copy.deepcopy(t))


@pytest.mark.parametrize("id_map", MAPS)
def test_take_moves_the_baseline(id_map):
    t = _table(id_map)
    t(_ids(1, 2, 3, 4))
    epoch = t.change_epoch
    first = t.take_changes()
    assert first.epoch == epoch and t.change_epoch != epoch
    assert _sorted(first.ids) == [1, 2, 3, 4]
    after = t.pending_changes()
    assert not after.cleared and after.ids.tolist() == [] and after.tombstones.tolist() == []
    t.eval()
    t(_ids(1, 9))  # eval lookups change nothing
    assert t.pending_changes().ids.tolist() == []
    t.train()
    t(_ids(2, 10))  # a training lookup (count, last_step) and an insert
    assert _sorted(t.pending_changes().ids) == [2, 10]


@pytest.mark.parametrize("id_map", MAPS)
def test_every_write_path_marks_rows(id_map):
    t = _table(id_map)
    t.add_slot("acc", 0.5)
    t.load_rows(_ids(1, 2, 3, 4, 5), torch.zeros(5, 4))
    t.reset_changes()
    t.set_slot_rows(_ids(2, 99), {"acc": torch.ones(2, 4)})
    t.load_rows(_ids(3), torch.ones(1, 4), clear=False)
    with torch.no_grad():
        t.weight[t.lookup(_ids(4), insert=False)] = 7.0
    assert t.mark_changed(_ids(4, 1234)) == 1
    assert _sorted(t.pending_changes().ids) == [2, 3, 4]


@pytest.mark.parametrize("id_map", MAPS)
def test_delete_evict_clear_give_tombstones(id_map):
    t = _table(id_map)
    t.load_rows(_ids(1, 2, 3, 4, 5, 6), torch.zeros(6, 4))
    t.reset_changes()
    assert t.delete(_ids(1, 2, 77)) == 2
    t.load_rows(_ids(2), torch.ones(1, 4), clear=False)  # deleted, then inserted again: an upsert
    ch = t.pending_changes()
    assert ch.tombstones.tolist() == [1]
    assert ch.ids.tolist() == [2] and not ch.cleared
    # a freed row taken by a new id is changed; the deleted id's stale mark is gone
    t.load_rows(_ids(50), torch.ones(1, 4), clear=False)
    assert _sorted(t.pending_changes().ids) == [2, 50]
    t.clear()
    t.load_rows(_ids(8), torch.ones(1, 4), clear=False)
    ch = t.pending_changes()
    assert ch.cleared and ch.tombstones.tolist() == [] and ch.ids.tolist() == [8]


@pytest.mark.parametrize("id_map", MAPS)
def test_metadata_follows_training(id_map):
    t = _table(id_map)
    opt = SparseSGD(t, lr=0.1)
    for batch in ([1, 2], [2, 3], [2]):
        t(_ids(*batch)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert t.step == 3
    ids, rows = t.id_rows()
    meta = t.row_meta(rows)
    got = {i: (s, c) for i, s, c in zip(ids.tolist(), meta["last_step"].reshape(-1).tolist(),
                                         meta["count"].reshape(-1).tolist())}
    assert got == {1: (0, 1), 2: (2, 3), 3: (1, 1)}
    assert set(t.meta_columns()) == {"last_step", "count"}
    assert t.meta_columns()["count"].shape == (t.weight.shape[0], 1)
    # duplicates in one batch count once each
    t(_ids(1, 1, 1))
    assert int(t.row_meta(t.lookup(_ids(1), insert=False))["count"]) == 4


@pytest.mark.parametrize("id_map", MAPS)
def test_evict(id_map):
    t = _table(id_map)
    for step in range(5):
        t(_ids(step, 100))  # id `step` touched at table step `step`; id 100 every step
        t.advance_step()
    assert t.step == 5
    t.reset_changes()
    # last_step < 5 - 2 = 3: ids 0, 1, 2
    assert t.evict(older_than_steps=2) == 3
    assert _sorted(t.ids()) == [3, 4, 100]
    assert _sorted(t.pending_changes().tombstones) == [0, 1, 2]
    assert t.evict(min_count=2) == 2  # 3 and 4 were looked up once
    assert _sorted(t.ids()) == [100]
    assert t.evict() == 0
    with pytest.raises(UsageError, match="older_than_steps"):
        t.evict(older_than_steps=-1)
    with pytest.raises(ArgumentTypeError):
        t.evict(min_count=1.5)


def test_optimizer_updates_mark_rows_even_in_eval_mode():
    t = _table("cpu")
    opt = SparseAdam(t, lr=0.1)
    t(_ids(1, 2, 3))
    t.reset_changes()
    t.eval()  # no insert, no metadata; gradients still reach the rows looked up
    t(_ids(2)).sum().backward()
    opt.step()
    assert t.pending_changes().ids.tolist() == [2]


@pytest.mark.parametrize("id_map", MAPS)
def test_restore_marks_every_row_and_sets_meta(id_map):
    t = _table(id_map)
    ids = _ids(10, 11, 12)

    def fill(views):
        views["embedding"].copy_(torch.ones(3, 4))
        views["count"].copy_(torch.tensor([[1], [2], [3]]))

    views = t.prepare_load(ids, ["embedding", "count"], fill)
    assert views is not None and views["count"].shape == (3, 1)
    ch = t.pending_changes()
    assert ch.cleared and _sorted(ch.ids) == [10, 11, 12]
    meta = t.row_meta(t.lookup(ids, insert=False))
    assert meta["count"].reshape(-1).tolist() == [1, 2, 3]
    assert meta["last_step"].reshape(-1).tolist() == [0, 0, 0]


@pytest.mark.parametrize("id_map", MAPS)
def test_load_rows_meta(id_map):
    t = _table(id_map)
    t.step = 9
    t.load_rows(_ids(1, 2), torch.zeros(2, 4), meta={"count": torch.tensor([4, 5])})
    meta = t.row_meta(t.lookup(_ids(1, 2), insert=False))
    assert meta["count"].reshape(-1).tolist() == [4, 5]
    assert meta["last_step"].reshape(-1).tolist() == [9, 9]  # not given: the step at insert
    with pytest.raises(UsageError, match="unknown row metadata"):
        t.load_rows(_ids(3), torch.zeros(1, 4), meta={"age": torch.tensor([1])})
    with pytest.raises(ShapeMismatchError):
        t.load_rows(_ids(3), torch.zeros(1, 4), meta={"count": torch.tensor([1, 2])})
    assert _sorted(t.ids()) == [1, 2]


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "new_like", "load_state_dict"])
def test_copies_carry_metadata_and_step(how):
    t = _table("cpu")
    t.add_slot("acc", 0.0)
    t(_ids(1, 2, 2))
    t.advance_step(4)
    t(_ids(2))
    if how == "pickle":
        c = pickle.loads(pickle.dumps(t))
    elif how == "deepcopy":
        c = copy.deepcopy(t)
    elif how == "new_like":
        c = t.new_like(copy_rows=True)
    else:
        c = _table("cpu")
        c.load_state_dict(t.state_dict())
    assert c.step == 4
    ids = _ids(1, 2)
    for got, want in zip(c.row_meta(c.lookup(ids, insert=False)).values(),
                         t.row_meta(t.lookup(ids, insert=False)).values()):
        assert torch.equal(got, want)
    ch = c.pending_changes()
    assert ch.cleared and _sorted(ch.ids) == [1, 2]  # a copy's baseline is the empty table


def test_swap_moves_tracking_with_the_rows():
    a, b = _table("cpu"), _table("cpu")
    a(_ids(1))
    a.reset_changes()
    a(_ids(2))
    b(_ids(3))
    epoch_a, epoch_b = a.change_epoch, b.change_epoch
    a.swap_contents(b)
    assert a.change_epoch == epoch_b and b.change_epoch == epoch_a
    assert a.pending_changes().ids.tolist() == [3]
    assert b.pending_changes().ids.tolist() == [2]


def test_tracking_off():
    with knobs.override(track_changes=False):
        t = _table("cpu")
    t(_ids(1, 2))
    t.delete(_ids(1))
    ch = t.take_changes()
    assert not ch.tracked and ch.ids.numel() == 0
    # metadata is still kept
    assert int(t.row_meta(t.lookup(_ids(2), insert=False))["count"]) == 1


def test_step_setter_checks():
    t = _table("cpu")
    with pytest.raises(UsageError):
        t.step = -1
    with pytest.raises(ArgumentTypeError):
        t.step = 1.0
