"""Model bank: dry-run plans equal what the load does, dynamic entries, dim / dtype policies."""
import os

import pytest
import torch
from helpers import make_job, model_state, table_state

from recsave import CheckpointManager, HashTable, Saver
from recsave.errors import CheckpointNotFoundError, ConfigError, ShapeMismatchError
from recsave.tables.optim import SparseAdagrad, SparseAdam


def trained_job(path, steps=6, seed=0, **kw):
    job = make_job(str(path), seed=seed, **kw)
    job.train(steps)
    job.saver.save(f"ckpt_{steps}")
    return job


def test_plan_lists_sources_rows_bytes_and_load_does_exactly_that(tmp_path):
    a = trained_job(tmp_path / "a", seed=1)
    b = trained_job(tmp_path / "b", steps=8, seed=2)
    target = make_job(str(tmp_path / "t"), save_interval=10)
    entries = [
        {"path": str(tmp_path / "a"), "load": ["*"], "exclude": ["io_state", "extra"]},
        {"path": str(tmp_path / "b"), "load": ["item*", "mlp.0.*"]},
    ]
    before = model_state(target.model)
    plan = target.manager.plan_model_bank(entries)
    assert model_state(target.model).keys() == before.keys()
    for k, v in before.items():  # the dry run changed nothing
        assert torch.equal(model_state(target.model)[k], v)

    assert plan.items["user"].checkpoint.endswith("ckpt_6") and plan.items["user"].entry == 0
    assert plan.items["item"].checkpoint.endswith("ckpt_8") and plan.items["item"].entry == 1
    assert plan.items["item@adagrad_acc"].entry == 1 and plan.items["mlp.0.weight"].entry == 1
    assert plan.items["mlp.2.weight"].entry == 0
    assert plan.items["user"].rows == len(a.model.user)
    assert plan.items["item"].rows == len(b.model.item)
    assert set(plan.left_initialised) == {"dense_opt", "global_step", "reader"}
    assert plan.nbytes == sum(i.nbytes for i in plan.items.values()) > 0
    # A table's first item books its ids and row metadata (read with the embedding) beside its own.
    n = len(a.model.user)
    assert plan.items["user"].nbytes == n * (8 + 8 + 8) + n * a.model.user.embedding_dim * 4
    text = str(plan)
    assert "user@adagrad_acc" in text and "left initialised" in text

    report = target.manager.load_model_bank(entries)
    assert set(report.loaded) == set(plan.items)
    for name, item in plan.items.items():
        got = report.loaded[name]
        assert (got.category, got.checkpoint, got.source, got.rows, got.nbytes) == \
            (item.category, item.checkpoint, item.source, item.rows, item.nbytes), name
    assert report.bytes_read == plan.nbytes and report.rows_read == plan.rows
    # Values: user from a, item from b.
    for k, v in table_state(a.model.user).items():
        assert torch.equal(table_state(target.model.user)[k], v)
    for k, v in table_state(b.model.item).items():
        assert torch.equal(table_state(target.model.item)[k], v)
    assert torch.equal(target.model.mlp[0].weight, b.model.mlp[0].weight)
    assert torch.equal(target.model.mlp[2].weight, a.model.mlp[2].weight)


def test_dynamic_entry_reloads_only_when_its_source_has_a_newer_version(tmp_path):
    src = make_job(str(tmp_path / "src"), max_keep=None)
    src.train(3)
    src.saver.save("ckpt_3")
    follower = make_job(str(tmp_path / "f"), save_interval=10)
    mgr = follower.manager
    entries = [{"path": str(tmp_path / "src"), "load": ["user*"], "is_dynamic": True},
               {"path": str(tmp_path / "src"), "load": ["item"]}]
    mgr.load_model_bank(entries)
    assert mgr.update_model_bank() is None  # nothing newer

    src.train(3)
    src.saver.save("ckpt_6")
    follower.model.item.clear()  # a static entry must not be re-applied
    report = mgr.update_model_bank()
    assert report is not None and set(report.loaded) == {"user", "user@adagrad_acc"}
    assert report.loaded["user"].checkpoint.endswith("ckpt_6")
    for k, v in table_state(src.model.user).items():
        assert torch.equal(table_state(follower.model.user)[k], v)
    assert len(follower.model.item) == 0
    assert mgr.update_model_bank() is None  # and not twice


def test_an_update_takes_a_static_entrys_part_from_the_checkpoint_it_loaded(tmp_path):
    """A dynamic entry's table reloaded cleared takes its slots again from the entry that won them:
    a static entry's from the checkpoint it loaded, not its output dir's newer one (whose slots,
    and step count, belong to another version). Gone since, the update says so."""
    a = make_job(str(tmp_path / "a"), max_keep=None, seed=1)
    a.train(2)
    a.saver.save("ckpt_2")
    b = make_job(str(tmp_path / "b"), max_keep=1, seed=2)
    b.train(3)
    b.saver.save("ckpt_3")
    follower = make_job(str(tmp_path / "f"), save_interval=10)
    mgr = follower.manager
    mgr.load_model_bank([{"path": str(tmp_path / "a"), "load": ["user"], "is_dynamic": True},
                         {"path": str(tmp_path / "b"), "load": ["user@*"]}])
    b.train(3)
    b.saver.save("ckpt_6")  # max_keep=1: b's ckpt_3 is pruned ...
    a.train(1)
    a.saver.save("ckpt_3")
    with pytest.raises(CheckpointNotFoundError, match="entry 1 .*ckpt_3, which is gone"):
        mgr.update_model_bank()  # ... and the reload of user needs its slots
    b.saver.max_keep = None
    b.train(1)
    b.saver.save("ckpt_7")
    mgr.load_model_bank([{"path": str(tmp_path / "a"), "load": ["user"], "is_dynamic": True},
                         {"path": str(tmp_path / "b"), "load": ["user@*"]}])  # b's ckpt_7
    at_7 = table_state(b.model.user)
    b.train(2)
    b.saver.save("ckpt_9")
    a.train(1)
    a.saver.save("ckpt_4")
    report = mgr.update_model_bank()
    assert report is not None and set(report.loaded) == {"user", "user@adagrad_acc"}
    assert report.loaded["user"].checkpoint.endswith(os.path.join("a", "ckpt_4"))
    assert report.loaded["user@adagrad_acc"].checkpoint.endswith(os.path.join("b", "ckpt_7"))
    got, b_now = table_state(follower.model.user), table_state(b.model.user)
    assert torch.equal(got["@id"], table_state(a.model.user)["@id"])
    # where both tables hold an id, its slot is b's at ckpt_7 (not at ckpt_9, which differs there)
    common = torch.isin(got["@id"], at_7["@id"])
    assert common.any() and torch.equal(got["@id"][common], at_7["@id"][torch.isin(at_7["@id"], got["@id"])])
    assert torch.equal(got["@adagrad_acc"][common], at_7["@adagrad_acc"][torch.isin(at_7["@id"], got["@id"])])
    later = b_now["@adagrad_acc"][torch.isin(b_now["@id"], got["@id"][common])]
    assert not torch.equal(later, got["@adagrad_acc"][common])


def test_a_merge_that_wins_a_table_an_earlier_entry_loads_says_the_earlier_one_is_not_read(tmp_path):
    """[load A's user, merge B's user]: the later entry wins `user`, so A's rows are never read and
    B merges into the model's live rows, which reads as "A, then B on top". Said, not silent."""
    import warnings

    a = make_job(str(tmp_path / "a"), max_keep=None, seed=1)
    a.train(1)
    a.saver.save("ckpt_1")
    b = make_job(str(tmp_path / "b"), max_keep=None, seed=2)
    b.train(2)
    b.saver.save("ckpt_2")
    target = make_job(str(tmp_path / "t"))
    live_ids = set(target.model.user.ids().tolist())
    with pytest.warns(RuntimeWarning, match=r"entry 1 merges table 'user' .* entry\(ies\) \[0\] do not load it"):
        report = target.saver.load_model_bank([
            {"path": str(tmp_path / "a"), "load": ["user"]},
            {"path": str(tmp_path / "b"), "load": ["user"], "hashtable_clear": False}])
    assert report.loaded["user"].checkpoint.endswith(os.path.join("b", "ckpt_2"))
    assert set(target.model.user.ids().tolist()) == live_ids | set(b.model.user.ids().tolist())
    with warnings.catch_warnings():  # a merge alone, or after an entry of other tables, is quiet
        warnings.simplefilter("error")
        target.saver.load_model_bank([{"path": str(tmp_path / "a"), "load": ["item"]},
                                      {"path": str(tmp_path / "b"), "load": ["user"], "hashtable_clear": False}])


class Small(torch.nn.Module):
    def __init__(self, dim, dtype=torch.float32):
        super().__init__()
        self.emb = HashTable(dim, name="emb", seed=5, dtype=dtype)


def saved_small(path, dim, dtype=torch.float32):
    m = Small(dim, dtype)
    opt = SparseAdagrad(m, lr=0.1, initial_accumulator_value=0.25)
    m.emb(torch.arange(50))
    m.emb.slot("adagrad_acc")[:50] = torch.arange(50 * dim, dtype=torch.float32).view(50, dim)
    Saver(m, sparse_optim=opt, output_dir=str(path)).save("ckpt_1")
    return m


@pytest.mark.parametrize("policy,ckpt_dim,model_dim", [("truncate", 8, 5), ("pad", 5, 8)])
def test_dim_policy(tmp_path, policy, ckpt_dim, model_dim):
    src = saved_small(tmp_path / "s", ckpt_dim)
    m = Small(model_dim)
    opt = SparseAdagrad(m, lr=0.1, initial_accumulator_value=0.25)
    saver = Saver(m, sparse_optim=opt, output_dir=str(tmp_path / "t"))
    with pytest.raises(ShapeMismatchError, match=f"dim_policy='{policy}'"):
        saver.load_model_bank([{"path": str(tmp_path / "s"), "load": ["emb*"]}])
    saver.load_model_bank([{"path": str(tmp_path / "s"), "load": ["emb*"], "dim_policy": policy}])
    ids = torch.arange(50)
    _, want, want_slots = src.emb.export(ids)
    _, got, got_slots = m.emb.export(ids)
    k = min(ckpt_dim, model_dim)
    assert torch.equal(got[:, :k], want[:, :k])
    assert torch.equal(got_slots["adagrad_acc"][:, :k], want_slots["adagrad_acc"][:, :k])
    if policy == "pad":  # new columns get what new rows would get
        assert torch.equal(got[:, k:], m.emb.initial_rows(ids)[:, k:])
        assert bool((got_slots["adagrad_acc"][:, k:] == 0.25).all())
    wrong = "pad" if policy == "truncate" else "truncate"
    with pytest.raises(ShapeMismatchError):
        saver.load_model_bank([{"path": str(tmp_path / "s"), "load": ["emb*"], "dim_policy": wrong}])


def test_dtype_policy_casts_only_when_asked(tmp_path):
    saved_small(tmp_path / "s", 4, torch.float32)
    m = Small(4, torch.bfloat16)
    saver = Saver(m, output_dir=str(tmp_path / "t"))
    with pytest.raises(ShapeMismatchError, match="dtype_policy='cast'"):
        saver.load_model_bank([{"path": str(tmp_path / "s"), "load": ["emb"]}])
    assert len(m.emb) == 0
    saver.load_model_bank([{"path": str(tmp_path / "s"), "load": ["emb"], "dtype_policy": "cast"}])
    assert len(m.emb) == 50 and m.emb.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("key,value", [("dim_policy", "stretch"), ("dtype_policy", 1), ("is_dynamic", "yes")])
def test_bad_policy_values(tmp_path, key, value):
    saved_small(tmp_path / "s", 4)
    saver = Saver(Small(4), output_dir=str(tmp_path / "t"))
    with pytest.raises(ConfigError, match=key):
        saver.plan_model_bank([{"path": str(tmp_path / "s"), key: value}])


@pytest.mark.parametrize("world", [1, 2])
def test_bank_entry_from_a_parquet_export_warm_starts_tables(tmp_path, world, monkeypatch):
    from recsave import partition
    from recsave.tools.export import to_parquet

    src = trained_job(tmp_path / "src")
    to_parquet(str(tmp_path / "src"), str(tmp_path / "pq"))
    if world > 1:  # rank 1 of 2 gets exactly its ids
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", str(world))
    target = make_job(str(tmp_path / "t"))
    entries = [{"path": str(tmp_path / "pq"), "load": ["user*", "item"]}]
    plan = target.saver.plan_model_bank(entries)
    assert set(plan.items) == {"user", "user@adagrad_acc", "item"}
    report = target.saver.load_model_bank(entries)
    assert set(report.loaded) == set(plan.items)
    want = table_state(src.model.user)
    got = table_state(target.model.user)
    if world > 1:
        keep = partition.owner_of(want["@id"], world) == 1
        want = {k: v[keep] for k, v in want.items()}
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # `item` loaded without its slot: the slot holds its initial value for the loaded ids.
    assert bool((table_state(target.model.item)["@adagrad_acc"] == 0.1).all())


def _two_tables(user_ids, item_ids=None):
    model = torch.nn.Module()
    model.user = HashTable(4, name="user", seed=1)
    model.user.lookup(torch.tensor(user_ids, dtype=torch.int64), insert=True)
    if item_ids is not None:
        model.item = HashTable(4, name="item", seed=2)
        model.item.lookup(torch.tensor(item_ids, dtype=torch.int64), insert=True)
    return model


def test_a_renamed_slot_left_out_on_purpose_is_skipped_not_unexpected(tmp_path):
    source = _two_tables([1, 2, 3])
    source.user.add_slot("acc", 0.5)
    Saver(source, output_dir=str(tmp_path / "a")).save("ckpt_1")
    model = torch.nn.Module()
    model.u = HashTable(4, name="u", seed=1)
    model.u.add_slot("acc", 0.0)
    report = Saver(model, output_dir=str(tmp_path / "t")).load_model_bank(
        [{"path": str(tmp_path / "a"), "oname": {"u": "user"}, "exclude": ["u@*"]}])
    assert sorted(report.loaded) == ["u"] and report.skipped == ["u@acc"] and report.unexpected == []


def test_a_name_one_entry_lacks_and_another_loads_is_not_reported_missing(tmp_path):
    Saver(_two_tables([1, 2, 3]), output_dir=str(tmp_path / "a")).save("ckpt_1")
    Saver(_two_tables([1, 2], [7, 8]), output_dir=str(tmp_path / "b")).save("ckpt_1")
    model = _two_tables([], [])
    saver = Saver(model, output_dir=str(tmp_path / "job"))
    entries = [{"path": str(tmp_path / "a"), "strict": False}, {"path": str(tmp_path / "b"), "load": ["item"]}]
    plan = saver.plan_model_bank(entries)
    assert plan.missing == [] and plan.left_initialised == []
    report = saver.load_model_bank(entries)
    assert sorted(report.loaded) == ["item", "user"] and report.missing == []
    assert sorted(model.item.ids().tolist()) == [7, 8] and sorted(model.user.ids().tolist()) == [1, 2, 3]


def test_a_dim_that_does_not_fit_is_refused_only_where_that_entry_wins_the_name(tmp_path):
    """Entry 0 holds `item` at dim 8, entry 1 (later: it wins `item`) at the model's dim 4: a
    valid bank, refused before because entry 0's item was checked too. Where entry 0 wins it, it
    is still refused."""
    saved_small(str(tmp_path / "wide"), 8)
    saved_small(str(tmp_path / "fits"), 4)
    model = Small(4)
    saver = Saver(model, output_dir=str(tmp_path / "t"))
    report = saver.load_model_bank([{"path": str(tmp_path / "wide")},
                                    {"path": str(tmp_path / "fits"), "load": ["emb"]}])
    assert report.loaded["emb"].checkpoint.startswith(str(tmp_path / "fits"))
    with pytest.raises(ShapeMismatchError, match="table 'emb' has dim 8 but the model's 'emb' has dim 4"):
        saver.load_model_bank([{"path": str(tmp_path / "fits"), "load": ["emb"]},
                               {"path": str(tmp_path / "wide"), "load": ["emb"]}])
    # a slot loaded alone is named as the slot it is
    model = Small(4)
    SparseAdagrad(model, lr=0.1, initial_accumulator_value=0.25)
    with pytest.raises(ShapeMismatchError, match="slot 'emb@adagrad_acc' has dim 8 but the model's "
                                                 "'emb@adagrad_acc' has dim 4"):
        Saver(model, output_dir=str(tmp_path / "t2")).load_model_bank([{"path": str(tmp_path / "wide"),
                                                                         "load": ["emb@*"]}])


def test_an_optional_name_a_later_entry_loads_gets_no_kept_note(tmp_path):
    Saver(_two_tables([1]), output_dir=str(tmp_path / "plain")).save("ckpt_1")  # no global_step
    source = CheckpointManager(Saver(_two_tables([2]), output_dir=str(tmp_path / "job_a")), 0)
    source.global_step = 77
    source.save()
    manager = CheckpointManager(Saver(_two_tables([]), output_dir=str(tmp_path / "job")), 0)
    report = manager.load_model_bank([{"path": str(tmp_path / "plain")},
                                      {"path": str(tmp_path / "job_a"), "load": ["global_step"]}])
    assert manager.global_step == 77 and report.loaded["global_step"].checkpoint.endswith("ckpt_77")
    assert report.notes == [] and report.skipped == []


def test_another_optimizers_state_is_refused_before_anything_is_read_whole(tmp_path):
    """An Adagrad checkpoint loaded into a model stepped by Adam: its optimizer's load_state_dict
    refused the state only as the load was applied, without naming the checkpoint. The staging
    step names it and the exclude that loads the tables; the model is unchanged."""
    saved_small(tmp_path / "adagrad", 4)
    model = Small(4)
    opt = SparseAdam(model, lr=0.01)
    model.emb(torch.tensor([7])).sum().backward()
    opt.step()
    saver = Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "t"))
    with pytest.raises(ConfigError, match=r"adagrad/ckpt_1: its sparse optimizer state is a SparseAdagrad's, "
                                          r"the model's optimizer is a SparseAdam; exclude 'sparse_optim'"):
        saver.load(str(tmp_path / "adagrad"), load_conf={"strict": False})
    assert model.emb.ids().tolist() == [7] and opt.steps == {"emb": 1}
    report = saver.load(str(tmp_path / "adagrad"), load_conf={"strict": False, "exclude": ["sparse_optim"]})
    assert "emb" in report.loaded and len(model.emb) == 50


def test_rows_count_each_read_when_a_tables_columns_come_from_two_entries(tmp_path):
    def source(path, ids):
        model = _two_tables(ids)
        model.user.add_slot("acc", 0.5)
        Saver(model, output_dir=str(path)).save("ckpt_1")
    source(tmp_path / "a", list(range(100)))
    source(tmp_path / "b", list(range(90, 95)))
    model = _two_tables([])
    model.user.add_slot("acc", 0.0)
    saver = Saver(model, output_dir=str(tmp_path / "job"))
    entries = [{"path": str(tmp_path / "a"), "load": ["user"]}, {"path": str(tmp_path / "b"), "load": ["user@acc"]}]
    plan = saver.plan_model_bank(entries)
    assert (plan.items["user"].rows, plan.items["user@acc"].rows, plan.rows) == (100, 5, 105)
    report = saver.load_model_bank(entries)
    assert report.rows_read == 105 and len(model.user) == 100
    one = saver.load_model_bank([{"path": str(tmp_path / "a")}])  # embedding and slot: one read
    assert one.rows_read == 100


def test_a_slot_only_load_reports_the_rows_it_read_not_those_it_updated(tmp_path):
    """A load of slots alone reads every row of the source's table and sets the ids the live
    table holds: `rows` (and `rows_read`) count the rows read, as the plan said and as an
    embedding's do, not the 5 ids it updated (docs/API.md, LoadReport)."""
    source = _two_tables(list(range(100)))
    source.user.add_slot("acc", 0.5)
    Saver(source, output_dir=str(tmp_path / "a")).save("ckpt_1")
    model = _two_tables(list(range(95, 105)))  # 5 ids of the source, 5 it lacks
    model.user.add_slot("acc", 0.0)
    saver = Saver(model, output_dir=str(tmp_path / "job"))
    entries = [{"path": str(tmp_path / "a"), "load": ["user@acc"]}]
    plan = saver.plan_model_bank(entries)
    assert (plan.items["user@acc"].rows, plan.rows) == (100, 100)
    report = saver.load_model_bank(entries)
    assert (report.loaded["user@acc"].rows, report.rows_read) == (100, 100)
    acc = model.user.slot("acc")[model.user.lookup(torch.arange(95, 105), insert=False)]
    assert acc[:, 0].tolist() == [0.5] * 5 + [0.0] * 5 and len(model.user) == 10  # 5 updated, none added


def _adam_job(names):
    model = torch.nn.Module()
    for n in names:
        setattr(model, n, HashTable(4, name=n, seed=len(n)))
    return model, SparseAdam(model, lr=0.1)


def test_oname_carries_the_sparse_optimizers_step_counts_with_the_slots(tmp_path):
    src, opt = _adam_job(["user", "item"])
    for step in range(10):  # user: 10 steps, item: 2
        loss = src.user(torch.tensor([1, 2])).sum()
        if step < 2:
            loss = loss + src.item(torch.tensor([3])).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    Saver(src, sparse_optim=opt, output_dir=str(tmp_path / "src")).save("ckpt_1")
    swapped, swapped_opt = _adam_job(["user", "item"])
    Saver(swapped, sparse_optim=swapped_opt, output_dir=str(tmp_path / "a")).load(
        str(tmp_path / "src"), load_conf={"oname": [{"user": "item"}, {"item": "user"}]})
    assert swapped_opt.steps == {"user": 2, "item": 10}  # as the adam_m / adam_v each table now holds
    both, both_opt = _adam_job(["user", "item"])  # item loads item, and user loads item too
    Saver(both, sparse_optim=both_opt, output_dir=str(tmp_path / "c")).load(
        str(tmp_path / "src"), load_conf={"oname": [{"user": "item"}]})
    assert both_opt.steps == {"user": 2, "item": 2}
    renamed, renamed_opt = _adam_job(["u2", "item"])
    saver = Saver(renamed, sparse_optim=renamed_opt, output_dir=str(tmp_path / "b"))
    plan = saver.plan_model_bank([{"path": str(tmp_path / "src"), "oname": [{"u2": "user"}]}])
    saver.execute_plan(plan)  # raised ConfigError at apply: "the state has tables ['user'] ..."
    assert renamed_opt.steps == {"u2": 10, "item": 2} and len(renamed.u2) == 2


def _adam_trained(names_steps):
    """A model of HashTables under SparseAdam, table n stepped names_steps[n] times."""
    model, opt = _adam_job(list(names_steps))
    for step in range(max(names_steps.values())):
        loss = sum(getattr(model, n)(torch.tensor([1, 2])).sum() for n, k in names_steps.items() if step < k)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_partial_load_moves_the_step_counts_of_the_slots_it_loads_only(tmp_path):
    """A count goes with its table's slots (Adam's bias correction reads it): an excluded table,
    a table the checkpoint lacks, a table whose slots another entry loads and a table replaced with
    its slots at init keep or take the count that matches their slots; a source table the model
    lacks is never taken."""
    src, src_opt = _adam_trained({"user": 6, "item": 6, "x": 6})
    a = Saver(src, sparse_optim=src_opt, output_dir=str(tmp_path / "a")).save("ckpt_6")
    other, other_opt = _adam_trained({"user": 9, "item": 9})
    b = Saver(other, sparse_optim=other_opt, output_dir=str(tmp_path / "b")).save("ckpt_9")

    model, opt = _adam_trained({"user": 4, "item": 3, "extra": 4})  # extra: not in a
    Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "t1")).load(
        a, load_conf={"strict": False, "exclude": ["item", "item@*"]})
    assert opt.steps == {"user": 6, "item": 3, "extra": 4}  # a's x never enters

    model, opt = _adam_trained({"user": 1, "item": 1})
    Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "t2")).load_model_bank(
        [{"path": a, "strict": False}, {"path": b, "load": ["user", "user@*"]}])
    assert opt.steps == {"user": 9, "item": 6}  # user's slots are b's
    assert torch.equal(model.user.export()[2]["adam_m"], other.user.export()[2]["adam_m"])

    model, opt = _adam_trained({"user": 1, "item": 1})  # slots without the optimizer's state
    Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "t3")).load(
        b, load_conf={"exclude": ["sparse_optim"]})
    assert opt.steps == {"user": 9, "item": 9}

    model, opt = _adam_trained({"user": 2, "item": 2})  # tables replaced, slots at init: from 0 again
    Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "t4")).load(b, load_conf={"load": ["user", "item"]})
    assert opt.steps == {"user": 0, "item": 0}
    model, opt = _adam_trained({"user": 2, "item": 2})  # merged rows: the live slots stay, so the counts
    Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "t5")).load(
        b, load_conf={"load": ["user", "item"], "hashtable_clear": False})
    assert opt.steps == {"user": 2, "item": 2}

    # A later entry replacing a table before the slots are loaded (staging replaces every entry's
    # tables, then loads every entry's slots): user's slots, and so its count, are a's.
    model, opt = _adam_trained({"user": 1, "item": 1})
    report = Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "t6")).load_model_bank(
        [{"path": a, "strict": False}, {"path": b, "load": ["user"]}])
    assert report.loaded["user"].checkpoint == b and report.loaded["user@adam_m"].checkpoint == a
    assert opt.steps == {"user": 6, "item": 6}


def test_tables_without_slots_take_their_count_with_their_rows(tmp_path):
    """An optimizer without slots (SGD): the count goes with the table's rows."""
    from recsave.tables.optim import SparseSGD

    def trained(steps):
        model = torch.nn.Module()
        model.user, model.item = HashTable(4, name="user", seed=1), HashTable(4, name="item", seed=2)
        opt = SparseSGD(model, lr=0.1)
        for k in range(max(steps.values())):
            sum(getattr(model, n)(torch.tensor([1, 2])).sum() for n, c in steps.items() if k < c).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    src, src_opt = trained({"user": 5, "item": 3})
    path = Saver(src, sparse_optim=src_opt, output_dir=str(tmp_path / "src")).save("ckpt_5")
    model, opt = trained({"user": 1, "item": 1})
    Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "a")).load(path)
    assert opt.steps == {"user": 5, "item": 3}
    model, opt = trained({"user": 1, "item": 1})
    Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "b")).load(
        path, load_conf={"load": ["item"]})  # sparse_optim not loaded: the count comes along anyway
    assert opt.steps == {"user": 1, "item": 3}
    model, opt = trained({"user": 2, "item": 2})
    Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "c")).load(
        path, load_conf={"hashtable_clear": False})  # a merge: the live rows stay, so do the counts
    assert opt.steps == {"user": 2, "item": 2}


def test_an_oname_whose_model_side_matches_nothing_is_refused(tmp_path):
    """{"usr": "item"} meant {"user": "item"}: ignored, the model's user would load the source's
    user (same dim) without a word; it is a ConfigError, as a load / exclude pattern is."""
    Saver(_two_tables([1, 2], [100, 101]), output_dir=str(tmp_path / "src")).save("ckpt_1")
    model = _two_tables([7])
    saver = Saver(model, output_dir=str(tmp_path / "t"))
    with pytest.raises(ConfigError, match="'oname' 'usr' -> 'item': 'usr' matches no name of the model"):
        saver.load_model_bank([{"path": str(tmp_path / "src"), "oname": {"usr": "item"}}])
    assert model.user.ids().tolist() == [7]  # nothing loaded
    with pytest.raises(ConfigError, match="'oname' 'x\\*' -> 'item\\*'"):
        saver.load_model_bank([{"path": str(tmp_path / "src"), "oname": [{"user": "item"}, {"x*": "item*"}]}])
    saver.load_model_bank([{"path": str(tmp_path / "src"), "oname": {"user": "item"}}])
    assert sorted(model.user.ids().tolist()) == [100, 101]
    report = saver.load_model_bank([{"path": str(tmp_path / "src"), "oname": [{"usr": "item"}],
                                     "ignore_error": True}])
    assert sorted(model.user.ids().tolist()) == [1, 2] and report.loaded["user"].source == "user"


@pytest.mark.parametrize("change", ["narrower table", "double", "table removed"])
def test_a_plan_executed_after_the_model_changed_is_checked_again(tmp_path, change):
    """plan_model_bank checks dims and dtypes against the model as it is then; execute_plan against
    the model as it is when it runs (a table cut to another dim, or cast, silently otherwise)."""
    saved_small(tmp_path / "s", 4)
    m = Small(4)
    saver = Saver(m, output_dir=str(tmp_path / "t"))
    plan = saver.plan_model_bank([{"path": str(tmp_path / "s"), "load": ["emb"]}])
    if change == "narrower table":
        m.emb = HashTable(2, name="emb", seed=5)
        error, match = ShapeMismatchError, "has dim 4 but the model's 'emb' has dim 2"
    elif change == "double":
        m.double()
        error, match = ShapeMismatchError, "is float32 but the model's 'emb' is float64"
    else:
        del m.emb
        m.other = HashTable(4, name="other", seed=5)
        error, match = ConfigError, "the plan loads sparse 'emb', which the model no longer has"
    with pytest.raises(error, match=match):
        saver.execute_plan(plan)
    assert all(len(t) == 0 for t in m.modules() if isinstance(t, HashTable))  # nothing loaded


def test_a_category_word_that_also_names_a_table_warns_and_the_table_is_picked_by_a_class(tmp_path):
    """'dense' in load / exclude is the category; a table named dense is picked by '[d]ense'."""
    model = torch.nn.Module()
    model.dense = HashTable(4, name="dense", seed=1)
    model.dense.lookup(torch.arange(5), insert=True)
    Saver(model, output_dir=str(tmp_path / "src")).save("ckpt_1")
    fresh = torch.nn.Module()
    fresh.dense = HashTable(4, name="dense", seed=1)
    saver = Saver(fresh, output_dir=str(tmp_path / "t"))
    with pytest.warns(RuntimeWarning, match=r"means the category 'dense', not the sparse name 'dense'.*'\[d\]ense'"):
        saver.load_model_bank([{"path": str(tmp_path / "src"), "exclude": ["dense"]}])
    assert len(fresh.dense) == 5  # the category excluded nothing here
    fresh.dense.clear()
    with pytest.raises(ConfigError, match="selects nothing of the model"):  # the class excludes the table
        saver.load_model_bank([{"path": str(tmp_path / "src"), "exclude": ["[d]ense"]}])
    assert len(fresh.dense) == 0
    saver.load_model_bank([{"path": str(tmp_path / "src"), "load": ["[d]ense"]}])
    assert len(fresh.dense) == 5


def test_a_managers_bank_load_keeps_its_own_global_step(tmp_path):
    """A warm start from another manager job's checkpoint (default load: everything) must not
    take that job's global_step: this job's checkpoint ids and schedules follow its own. Named
    in `load`, it is taken."""
    from helpers import make_job

    other = make_job(str(tmp_path / "a"), save_interval=5, max_keep=None)
    other.train(10)
    other.manager.close()
    job = make_job(str(tmp_path / "b"), save_interval=5, max_keep=None, seed=3)
    job.train(20)
    job.manager.load_model_bank([{"path": str(tmp_path / "a")}])
    assert job.manager.global_step == 20
    job.train(5)  # ckpt_25, not a refused ckpt_15
    assert job.manager.global_step == 25
    job.manager.load_model_bank([{"path": str(tmp_path / "a"), "load": ["sparse", "global_step"]}])
    assert job.manager.global_step == 10
    job.manager.close()


def test_a_checkpoint_without_a_partition_loads_in_one_process(tmp_path):
    """docs/FORMAT.md allows `"partition": null` (an index that says nothing of buckets, e.g. a
    hand-built one): one process needs no buckets to load it whole. It was refused with "cannot
    be loaded by several ranks", by a load of one rank."""
    from helpers import read_index_json, write_index_json

    source = _two_tables([1, 2, 3], [7, 8])
    source.user.add_slot("acc", 0.5)
    ckpt = Saver(source, output_dir=str(tmp_path / "src")).save("ckpt_1")
    raw = read_index_json(ckpt)
    raw["partition"] = None
    write_index_json(ckpt, raw)
    model = _two_tables([9], [])
    model.user.add_slot("acc", 0.0)
    report = Saver(model, output_dir=str(tmp_path / "t")).load_model_bank([{"path": ckpt}])
    assert sorted(report.loaded) == ["item", "user", "user@acc"]
    assert table_state(model.user)["@id"].tolist() == [1, 2, 3] and table_state(model.item)["@id"].tolist() == [7, 8]
    assert torch.equal(table_state(model.user)["@acc"], torch.full((3, 4), 0.5))
    assert model.user.partition is None


def test_a_managers_bank_load_takes_its_global_step_where_a_load_pattern_names_it(tmp_path):
    """A `load` pattern that selects global_step names it as the exact word does: it was excluded
    anyway, so `["user", "global_st?p"]` left the step behind without a word, and `["global_*"]`
    was refused for an exclude the entry never wrote. Categories (`*`, `extra`) still keep it."""
    source = CheckpointManager(Saver(_two_tables([1, 2]), output_dir=str(tmp_path / "a")), 0)
    source.global_step = 77
    source.save()
    manager = CheckpointManager(Saver(_two_tables([]), output_dir=str(tmp_path / "b")), 0)
    report = manager.load_model_bank([{"path": str(tmp_path / "a"), "load": ["user", "global_st?p"]}])
    assert manager.global_step == 77 and sorted(report.loaded) == ["global_step", "user"]
    manager.global_step = 0
    report = manager.load_model_bank([{"path": str(tmp_path / "a"), "load": "global_*"}])
    assert manager.global_step == 77 and sorted(report.loaded) == ["global_step"]
    manager.global_step = 0
    manager.load_model_bank([{"path": str(tmp_path / "a"), "load": ["*"]}])
    assert manager.global_step == 0
