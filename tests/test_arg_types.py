"""Public entry points raise a TypeError that is also a RecsaveError (ArgumentTypeError), naming the
argument, for arguments of the wrong type; wrong values keep raising UsageError (a ValueError)."""
from __future__ import annotations

import os

import pytest
import torch

import recsave
from recsave import ArgumentTypeError, CheckpointManager, HashTable, RecsaveError, Saver, UsageError
from recsave.tables.optim import SparseAdagrad, SparseAdam, SparseSGD


class Stateful:
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _model():
    model = torch.nn.Module()
    model.t = HashTable(4, name="t")
    model.t(torch.arange(5))
    return model


@pytest.fixture
def env(tmp_path):
    """A saver (with one committed checkpoint), its manager and its table."""
    model = _model()
    saver = Saver(model, output_dir=str(tmp_path / "out"))
    mgr = CheckpointManager(saver, 0)
    saver.save("ckpt_1")
    opt = SparseSGD(model.t, lr=0.1)
    yield {"saver": saver, "mgr": mgr, "table": model.t, "model": model, "out": str(tmp_path / "out"),
           "opt": opt}
    saver.close()


def _set_step(mgr, value):
    mgr.global_step = value


# (call, argument named in the message, type name of the bad value)
TYPE_CASES = {
    # Saver
    "Saver-model": (lambda e: Saver("model", output_dir=e["out"]), "model", "str"),
    "Saver-output_dir": (lambda e: Saver(e["model"], output_dir=None), "output_dir", "NoneType"),
    "Saver-max_keep": (lambda e: Saver(e["model"], output_dir=e["out"], max_keep="3"), "max_keep", "str"),
    "Saver-max_keep-bool": (lambda e: Saver(e["model"], output_dir=e["out"], max_keep=True), "max_keep", "bool"),
    "Saver-concurrency": (lambda e: Saver(e["model"], output_dir=e["out"], concurrency=2.0), "concurrency", "float"),
    "Saver-sparse_optim": (lambda e: Saver(e["model"], sparse_optim=5, output_dir=e["out"]), "sparse_optim", "int"),
    "save-ckpt_id": (lambda e: e["saver"].save(5), "ckpt_id", "int"),
    "save-shard_id": (lambda e: e["saver"].save("ckpt_2", shard_id="0"), "shard_id", "str"),
    "save-shard_num": (lambda e: e["saver"].save("ckpt_2", shard_num=1.0), "shard_num", "float"),
    "async_save-ckpt_id": (lambda e: e["saver"].async_save(None), "ckpt_id", "NoneType"),
    "async_save-pinned": (lambda e: e["saver"].async_save("ckpt_2", pinned="yes"), "pinned", "str"),
    "load-ckpt_path": (lambda e: e["saver"].load(5), "ckpt_path", "int"),
    "load-ckpt_id": (lambda e: e["saver"].load(ckpt_id=1), "ckpt_id", "int"),
    "load-load_conf": (lambda e: e["saver"].load(load_conf=["dense"]), "load_conf", "list"),
    "load-shard_id": (lambda e: e["saver"].load(shard_id=True), "shard_id", "bool"),
    "load-direct_path": (lambda e: e["saver"].load(direct_path=1), "direct_path", "int"),
    "load-fallback": (lambda e: e["saver"].load(fallback="no"), "fallback", "str"),
    "load_by_config-ckpt_path": (lambda e: e["saver"].load_by_config(None), "ckpt_path", "NoneType"),
    "load_by_config-load_conf": (lambda e: e["saver"].load_by_config(e["out"], "dense"), "load_conf", "str"),
    "load_model_bank-entries": (lambda e: e["saver"].load_model_bank({"path": e["out"]}), "entries", "dict"),
    "plan_model_bank-entries": (lambda e: e["saver"].plan_model_bank(e["out"]), "entries", "str"),
    "execute_plan-plan": (lambda e: e["saver"].execute_plan("plan"), "plan", "str"),
    "register_for_checkpointing-name": (lambda e: e["saver"].register_for_checkpointing(5, Stateful()), "name", "int"),
    "register_for_checkpointing-obj": (lambda e: e["saver"].register_for_checkpointing("x", 5), "obj", "int"),
    "register_io_state-name": (lambda e: e["saver"].register_io_state(None, Stateful()), "name", "NoneType"),
    "register_io_state-obj": (lambda e: e["saver"].register_io_state("x", Stateful()), "obj", "Stateful"),
    "get_extra_data-name": (lambda e: e["saver"].get_extra_data(3), "name", "int"),
    "make_latest-ckpt_id": (lambda e: e["saver"].make_latest(3), "ckpt_id", "int"),
    "max_keep-setter": (lambda e: setattr(e["saver"], "max_keep", 2.5), "max_keep", "float"),
    # CheckpointManager
    "Manager-saver": (lambda e: CheckpointManager("saver", 10), "saver", "str"),
    "Manager-save_interval": (lambda e: CheckpointManager(e["saver"], save_interval="10"), "save_interval", "str"),
    "Manager-save_interval-bool": (lambda e: CheckpointManager(e["saver"], save_interval=True), "save_interval",
                                   "bool"),
    "Manager-async_mode": (lambda e: CheckpointManager(e["saver"], 0, async_mode=1), "async_mode", "int"),
    "restore-global_step": (lambda e: e["mgr"].restore("5"), "global_step", "str"),
    "restore-global_step-bool": (lambda e: e["mgr"].restore(True), "global_step", "bool"),
    "restore-fallback": (lambda e: e["mgr"].restore(fallback=None), "fallback", "NoneType"),
    "manager-save-wait": (lambda e: e["mgr"].save(wait="yes"), "wait", "str"),
    "global_step-setter": (lambda e: _set_step(e["mgr"], 3.0), "global_step", "float"),
    "manager-load_model_bank": (lambda e: e["mgr"].load_model_bank(e["out"]), "entries", "str"),
    "manager-plan_model_bank": (lambda e: e["mgr"].plan_model_bank(None), "entries", "NoneType"),
    "manager-register-name": (lambda e: e["mgr"].register_for_checkpointing(b"n", Stateful()), "name", "bytes"),
    # HashTable
    "HashTable-embedding_dim": (lambda e: HashTable("16"), "embedding_dim", "str"),
    "HashTable-embedding_dim-bool": (lambda e: HashTable(True), "embedding_dim", "bool"),
    "HashTable-name": (lambda e: HashTable(4, name=5), "name", "int"),
    "HashTable-dtype": (lambda e: HashTable(4, dtype="float32"), "dtype", "str"),
    "HashTable-init_std": (lambda e: HashTable(4, init_std="0.1"), "init_std", "str"),
    "HashTable-seed": (lambda e: HashTable(4, seed=1.5), "seed", "float"),
    "HashTable-id_map": (lambda e: HashTable(4, id_map=1), "id_map", "int"),
    "HashTable-device": (lambda e: HashTable(4, device=1.0), "device", "float"),
    "table-gather_rows-list": (lambda e: e["table"].gather_rows([0]), "rows", "list"),
    "table-gather_rows-float": (lambda e: e["table"].gather_rows(torch.tensor([0.0])), "rows", "float32"),
    "table-ids-float": (lambda e: e["table"](torch.tensor([1.0])), "ids", "float32"),
    "table-ids-list": (lambda e: e["table"]([1, 2]), "ids", "list"),
    "table-lookup": (lambda e: e["table"].lookup(torch.tensor([1], dtype=torch.int32), True), "ids", "int32"),
    "table-delete": (lambda e: e["table"].delete([1]), "ids", "list"),
    "table-export": (lambda e: e["table"].export(torch.tensor([1.0])), "ids", "float32"),
    "table-set_partition": (lambda e: e["table"].set_partition("0", 2), "rank", "str"),
    "table-add_slot": (lambda e: e["table"].add_slot(5), "slot", "int"),
    # sparse optimizers
    "SGD-model_or_tables": (lambda e: SparseSGD(3, lr=0.1), "model_or_tables", "int"),
    "SGD-tables-items": (lambda e: SparseSGD([e["table"], 3], lr=0.1), "model_or_tables", "int"),
    "SGD-lr": (lambda e: SparseSGD(e["table"], lr="0.1"), "lr", "str"),
    "Adagrad-lr-bool": (lambda e: SparseAdagrad(e["table"], lr=True), "lr", "bool"),
    "Adagrad-eps": (lambda e: SparseAdagrad(e["table"], eps=None), "eps", "NoneType"),
    "Adam-betas": (lambda e: SparseAdam(e["table"], betas="ab"), "betas", "str"),
    "Adam-betas-item": (lambda e: SparseAdam(e["table"], betas=(0.9, "x")), "betas", "str"),
    "opt-step-closure": (lambda e: e["opt"].step(closure=5), "closure", "int"),
}


@pytest.mark.parametrize("case", sorted(TYPE_CASES))
def test_wrong_argument_type_raises_argument_type_error(env, case):
    call, arg, got = TYPE_CASES[case]
    before = sorted(os.listdir(env["out"]))
    with pytest.raises(TypeError, match=rf"\b{arg} must be .*, got {got}\b") as exc:
        call(env)
    assert isinstance(exc.value, RecsaveError) and not isinstance(exc.value, ValueError)
    assert exc.value.key == arg
    assert sorted(os.listdir(env["out"])) == before


# Wrong values of the right type keep raising UsageError (a ValueError), not ArgumentTypeError.
VALUE_CASES = {
    "Saver-max_keep-0": lambda e: Saver(e["model"], output_dir=e["out"], max_keep=0),
    "save-bad-id": lambda e: e["saver"].save("a/b"),
    "Manager-save_interval-negative": lambda e: CheckpointManager(e["saver"], -1),
    "Manager-async_mode-unknown": lambda e: CheckpointManager(e["saver"], 0, async_mode="background"),
    "restore-negative": lambda e: e["mgr"].restore(-1),
    "HashTable-embedding_dim-0": lambda e: HashTable(0),
    "HashTable-float-less-dtype": lambda e: HashTable(4, dtype=torch.int64),
    "SGD-lr-negative": lambda e: SparseSGD(e["table"], lr=-0.1),
    "Adam-betas-length": lambda e: SparseAdam(e["table"], betas=(0.9,)),
}


@pytest.mark.parametrize("case", sorted(VALUE_CASES))
def test_wrong_values_keep_raising_usage_error(env, case):
    with pytest.raises(UsageError) as exc:
        VALUE_CASES[case](env)
    assert not isinstance(exc.value, TypeError)


def test_argument_type_error_is_exported():
    assert recsave.ArgumentTypeError is recsave.errors.ArgumentTypeError
    assert issubclass(recsave.ArgumentTypeError, RecsaveError)
    assert issubclass(recsave.ArgumentTypeError, TypeError)
    assert "ArgumentTypeError" in recsave.__all__ and "ArgumentTypeError" in recsave.errors.__all__


# ------------------------------------------------------------------ arguments checked at entry
def _state(table):
    ids, values, slots = table.export()
    return ids.tolist(), values.tolist(), {k: v.tolist() for k, v in slots.items()}


def _sharded_table_loading_foreign_ids(e):
    e["table"].set_partition(0, 2)
    theirs = torch.arange(1000)[recsave.partition.owner_of(torch.arange(1000), 2) == 1][:2]
    e["table"].load_rows(theirs, torch.zeros(2, 4))


def _export(e, out=None, **kw):
    from recsave.tools.export import to_parquet
    return to_parquet(kw.pop("ckpt", e["out"]), out if out is not None else os.path.join(e["out"], "..", "pq"), **kw)


def _catalog(fn, *args, **kw):
    from recsave.tools import catalog
    return getattr(catalog, fn)(*args, **kw)


_V = torch.zeros(3, 4)
_IDS = torch.arange(3)
_TYPE = recsave.ArgumentTypeError


def _entry(e):
    return {"path": e["out"], "strict": False}  # the live table has a slot the checkpoint lacks


def _plan(e):
    return e["saver"].plan_model_bank([_entry(e)])

# call -> (exception type, message fragment); every call leaves the table and output dir unchanged
ENTRY_CASES = {
    "load_rows-unknown-slot": (lambda e: e["table"].load_rows(_IDS, _V, {"nope": _V}), UsageError,
                               "table 't' has no slot(s) ['nope']; its slots: ['sgd_dummy']. Create a slot with "
                               "add_slot(name, init) first"),
    "load_rows-unknown-slot-merge": (lambda e: e["table"].load_rows(_IDS, _V, {"nope": _V}, clear=False),
                                     UsageError, "has no slot(s) ['nope']"),
    "load_rows-values-list": (lambda e: e["table"].load_rows(_IDS, [[0.0] * 4] * 3), recsave.ArgumentTypeError,
                              "load_rows: values must be a [len(ids), embedding_dim] tensor, got list"),
    "load_rows-slots-list": (lambda e: e["table"].load_rows(_IDS, _V, [_V]), recsave.ArgumentTypeError,
                             "load_rows: slots must be a dict of slot name -> tensor, got list"),
    "load_rows-slot-value-list": (lambda e: e["table"].load_rows(_IDS, _V, {"sgd_dummy": [1]}),
                                  _TYPE, "slots must map slot names (str) to tensors, got str -> list"),
    "load_rows-clear": (lambda e: e["table"].load_rows(_IDS, _V, clear="no"), recsave.ArgumentTypeError,
                        "load_rows: clear must be a bool, got str"),
    "load_rows-ids": (lambda e: e["table"].load_rows([0, 1, 2], _V), recsave.ArgumentTypeError,
                      "load_rows: ids must be an int64 tensor, got list"),
    "load_rows-foreign-ids": (_sharded_table_loading_foreign_ids, UsageError, "is the shard of rank 0 of 2"),
    "set_slot_rows-unknown-slot": (lambda e: e["table"].set_slot_rows(_IDS, {"nope": _V}), UsageError,
                                   "table 't' has no slot(s) ['nope']"),
    "set_slot_rows-slots-str": (lambda e: e["table"].set_slot_rows(_IDS, "nope"), recsave.ArgumentTypeError,
                                "set_slot_rows: slots must be a dict of slot name -> tensor, got str"),
    "set_slot_rows-ids": (lambda e: e["table"].set_slot_rows([1], {}), recsave.ArgumentTypeError,
                          "set_slot_rows: ids must be an int64 tensor, got list"),
    "set_slot_rows-rows": (lambda e: e["table"].set_slot_rows(_IDS, {"sgd_dummy": torch.zeros(2, 4)}),
                           recsave.ShapeMismatchError, "slot 'sgd_dummy' has (2, 4) rows for 3 ids"),
    "load_model_bank-str-entry": (lambda e: e["saver"].load_model_bank([e["out"]]), recsave.ConfigError,
                                  "model bank entry 0 must be a dict like {'path': ...}"),
    "manager-load_model_bank-str-entry": (lambda e: e["mgr"].load_model_bank([_entry(e), e["out"]]),
                                          recsave.ConfigError, "model bank entry 1 must be a dict like {'path': ...}"),
    "plan_model_bank-None-entry": (lambda e: e["saver"].plan_model_bank([5]), recsave.ConfigError,
                                   "model bank entry 0 must be a dict like {'path': ...}"),
    "load_model_bank-shard_id": (lambda e: e["saver"].load_model_bank([{"path": e["out"]}], shard_id="0"),
                                 _TYPE, "plan_model_bank: shard_id must be an int or None, got str"),
    "load-shard_num-2": (lambda e: e["saver"].load(shard_num=2), UsageError,
                         "load: shard_num=2; a load takes its world size from the process group"),
    "load-shard_num-str": (lambda e: e["saver"].load(shard_num="1"), _TYPE,
                           "load: shard_num must be an int or None, got str"),
    "load-shard_num-1-shard_id-1": (lambda e: e["saver"].load(shard_id=1, shard_num=1), UsageError,
                                    "load: shard_id=1 with shard_num=1; a process loading alone is rank 0 of 1"),
    "load_by_config-shard_num-0": (lambda e: e["saver"].load_by_config(e["out"], shard_num=0), UsageError,
                                   "load: shard_num=0"),
    "load_model_bank-shard_num-3": (lambda e: e["saver"].load_model_bank([{"path": e["out"]}], shard_num=3),
                                    UsageError, "plan_model_bank: shard_num=3"),
    "execute_plan-only-type": (lambda e: e["saver"].execute_plan(_plan(e), only="t"),
                               recsave.ArgumentTypeError, "execute_plan: only must be a set of model names"),
    "execute_plan-only-unknown": (lambda e: e["saver"].execute_plan(_plan(e), only={"t", "nope"}), UsageError,
                                  "only names 'nope' that the plan does not load; it loads ['global_step', 't']"),
    "restore-fallback-str": (lambda e: e["mgr"].restore(fallback="no"), recsave.ArgumentTypeError,
                             "restore: fallback must be a bool, got str 'no'"),
    "to_parquet-out_dir-None": (lambda e: _export(e, out=None, ckpt=None), recsave.ArgumentTypeError,
                                "to_parquet: ckpt must be a str"),
    "to_parquet-out_dir": (lambda e: _export(e, out=5), recsave.ArgumentTypeError, "to_parquet: out_dir must be a str"),
    "to_parquet-out_dir-empty": (lambda e: _export(e, out=""), UsageError,
                                 "to_parquet: out_dir must name a directory"),
    "to_parquet-tables-int": (lambda e: _export(e, tables=5), recsave.ArgumentTypeError,
                              "to_parquet: tables must be a table name or a list of them"),
    "to_parquet-tables-item": (lambda e: _export(e, tables=["t", 5]), recsave.ArgumentTypeError,
                               "to_parquet: tables must be a list of table names (str), got int"),
    "to_parquet-row_group_rows-str": (lambda e: _export(e, row_group_rows="5"), recsave.ArgumentTypeError,
                                      "to_parquet: row_group_rows must be an int, got str"),
    "to_parquet-row_group_rows-0": (lambda e: _export(e, row_group_rows=0), UsageError,
                                    "row_group_rows must be a positive int, got 0"),
    "to_parquet-rows_per_file-float": (lambda e: _export(e, rows_per_file=2.0), recsave.ArgumentTypeError,
                                       "to_parquet: rows_per_file must be an int or None, got float"),
    "to_parquet-progress": (lambda e: _export(e, progress=5), recsave.ArgumentTypeError,
                            "to_parquet: progress must be a callable or None, got int"),
    "list_checkpoints-None": (lambda e: _catalog("list_checkpoints", None), recsave.ArgumentTypeError,
                              "list_checkpoints: output_dir must be a str"),
    "list_checkpoints-empty": (lambda e: _catalog("list_checkpoints", ""), UsageError,
                               "list_checkpoints: output_dir must name a directory"),
    "describe-None": (lambda e: _catalog("describe", None), recsave.ArgumentTypeError, "describe: ckpt must be a str"),
    "verify-None": (lambda e: _catalog("verify", None), recsave.ArgumentTypeError, "verify: ckpt must be a str"),
    "verify-progress": (lambda e: _catalog("verify", e["out"], progress=5), recsave.ArgumentTypeError,
                        "verify: progress must be a callable or None"),
}


@pytest.mark.parametrize("case", sorted(ENTRY_CASES))
def test_arguments_are_checked_where_they_enter(env, case):
    call, exc_type, fragment = ENTRY_CASES[case]
    env["table"].add_slot("sgd_dummy")
    env["table"].set_slot_rows(_IDS, {"sgd_dummy": torch.ones(3, 4)})
    before, listing = _state(env["table"]), sorted(os.listdir(os.path.dirname(env["out"])))
    with pytest.raises(exc_type) as exc:
        call(env)
    assert fragment in str(exc.value)
    assert type(exc.value) is exc_type  # not a subclass standing in for another kind of error
    assert _state(env["table"]) == before
    assert env["table"].slot_names() == ["sgd_dummy"]
    assert sorted(os.listdir(os.path.dirname(env["out"]))) == listing


def test_empty_or_wrongly_typed_output_dirs_are_argument_errors_not_io_errors(tmp_path):
    from recsave.errors import ArgumentTypeError, UsageError
    from recsave.tools import catalog

    model = torch.nn.Module()
    model.t = recsave.HashTable(4, name="t")
    with pytest.raises(UsageError, match="output_dir must name a directory"):
        recsave.Saver(model, output_dir="")
    for fn in (catalog.clean_output_dir, catalog.collect_garbage, catalog.repair, catalog.list_checkpoints):
        with pytest.raises(ArgumentTypeError):
            fn(5)
        with pytest.raises(UsageError, match="must name a directory"):
            fn("")
    for fn in (catalog.clean_output_dir, catalog.collect_garbage):
        with pytest.raises(ArgumentTypeError, match="clean_output_dir: remove_broken must be a bool, got int 1"):
            fn("somewhere", remove_broken=1)


@pytest.mark.parametrize("kw,match", [({"seed": -1}, r"seed must be in \[0, 2\*\*64\)"),
                                      ({"seed": 2 ** 64}, r"seed must be in \[0, 2\*\*64\)"),
                                      ({"init_std": float("nan")}, "init_std must be a finite number >= 0"),
                                      ({"init_std": -1.0}, "init_std must be a finite number >= 0")])
def test_hashtable_seed_and_init_std_out_of_range_are_refused_at_construction(kw, match):
    from recsave.errors import UsageError

    with pytest.raises(UsageError, match=match):
        recsave.HashTable(4, **kw)
    assert len(recsave.HashTable(4, seed=2 ** 64 - 1, init_std=0.0)(torch.arange(3))) == 3


def test_hashtable_members_raise_recsave_errors_not_raw_ones():
    from recsave.errors import ArgumentTypeError, UsageError

    table = recsave.HashTable(4, name="t")
    table(torch.arange(3))
    with pytest.raises(UsageError, match="table 't' has no slot 'nope'"):
        table.slot_init("nope")
    with pytest.raises(ArgumentTypeError):
        table.advance_step("1")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError):
        table.initial_rows([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="other must be a HashTable"):
        table.swap_contents(5)  # type: ignore[arg-type]


def test_a_path_of_the_wrong_type_is_named_as_such_and_convert_needs_a_thread(tmp_path):
    from recsave.errors import ConfigError, UsageError

    model = torch.nn.Module()
    model.t = recsave.HashTable(4, name="t")
    saver = recsave.Saver(model, output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="'path' must be a non-empty string, got 5"):
        saver.plan_model_bank([{"path": 5}])
    with pytest.raises(ConfigError, match="'path' is required"):
        saver.plan_model_bank([{"load": ["*"]}])
    with pytest.raises(UsageError, match="concurrency must be >= 1, got 0"):
        recsave.convert(str(tmp_path / "run"), str(tmp_path / "x.pt"), "torch", concurrency=0)
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("device,says", [("tpu", "is not a torch device"), ("gpu0", "is not a torch device"),
                                         ("cuda:7", "is not available here"), (7, "is not available here")])
def test_a_table_device_that_cannot_hold_it_is_a_usage_error(device, says):
    if says == "is not available here" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    shown = f"cuda:{device}" if isinstance(device, int) else device
    with pytest.raises(UsageError, match=f"HashTable: device {shown!r} {says}"):
        HashTable(4, device=device)
    assert HashTable(4, device=torch.device("cpu")).device == torch.device("cpu")


def test_gather_rows_outside_the_table_is_a_usage_error(env):
    table = env["table"]
    n = len(table)
    assert n > 0 and table.gather_rows(torch.arange(n))[0].shape == (n, table.embedding_dim)
    assert torch.equal(table.gather_rows(torch.arange(n, dtype=torch.int32))[0], table.gather_rows(torch.arange(n))[0])
    for rows in (torch.tensor([-1]), torch.tensor([0, table.weight.shape[0]])):  # weight: rows [0, row_capacity)
        with pytest.raises(UsageError, match=r"gather_rows: rows must lie in \[0, "):
            table.gather_rows(rows)



@pytest.mark.parametrize("method", ["row_meta", "mark_rows_changed"])
def test_row_meta_and_mark_rows_changed_check_their_rows_as_gather_rows_does(env, method):
    """Rows of an absent id (-1), past row_capacity, a list or a float tensor are refused with the
    error gather_rows gives, not an IndexError, uninitialised memory or a wrong row marked (which
    failed the next incremental save far from the call)."""
    table = env["table"]
    call = getattr(table, method)
    table.reset_changes()
    for rows, error in ((torch.tensor([-1]), UsageError), (torch.tensor([0, table.weight.shape[0]]), UsageError),
                        ([0], ArgumentTypeError), (torch.tensor([0.0]), ArgumentTypeError)):
        with pytest.raises(error, match=f"{method}: rows must"):
            call(rows)
    assert table.pending_changes().ids.numel() == 0  # nothing marked by a refused call
    call(torch.tensor([0], dtype=torch.int32))
    if method == "mark_rows_changed":
        assert table.pending_changes().ids.tolist() == table.export()[0][:1].tolist()


@pytest.mark.parametrize("ids,columns,error,says", [
    ([5, 6], ["embedding"], ArgumentTypeError, "ids must be an int64 tensor"),
    (torch.tensor([5, 6], dtype=torch.int32), ["embedding"], ArgumentTypeError, "ids must be an int64 tensor"),
    (lambda: torch.tensor([5.0]), ["embedding"], ArgumentTypeError, "ids must be an int64 tensor"),
    (torch.tensor([5, 6]), "embedding", ArgumentTypeError, "columns must be a list of column names"),
    (torch.tensor([5, 6]), ["embedding", 3], ArgumentTypeError, "column must be a column name"),
    (torch.tensor([5, 6]), ["embedding", "weight"], UsageError, "slot name 'weight' is reserved"),
    (torch.tensor([5, 6]), ["embedding", "a@b"], UsageError, "slot name 'a@b' is reserved or invalid"),
])
def test_a_refused_prepare_load_leaves_the_table_and_its_slots_as_they_were(ids, columns, error, says):
    """Arguments are checked before the table is cleared (they emptied it, or made slots add_slot
    refuses: seven one-letter ones for a bare string). A function's ids, known only once called,
    are checked before its table is touched (the documented rule for errors then: cleared)."""
    table = HashTable(2, name="t")
    table(torch.tensor([1, 2, 3]))
    before = table.export()
    with pytest.raises(error, match=says):
        table.prepare_load(ids, columns)
    if not callable(ids):
        after = table.export()
        assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert table.slot_names() == []



@pytest.mark.parametrize("columns", [["embedding"], ["last_step"], []])
def test_int32_ids_a_function_returns_are_copied_into_the_int64_row_ids(columns):
    """A checkpoint may store int32 ids; those a function returns are taken as int64, also when the
    embedding is not read (its initial rows are hashed from the ids)."""
    table = HashTable(2, name="t")
    assert table.prepare_load(lambda: torch.tensor([5, 6], dtype=torch.int32), columns) is not None
    assert table.ids().tolist() == [5, 6] and table.lookup(torch.tensor([6]), insert=False).tolist() == [1]
