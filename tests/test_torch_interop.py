"""HashTables fit PyTorch: load_state_dict, torch.save / pickle, copy.deepcopy and DCP
(docs/API.md, "PyTorch interop")."""
from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch

import recsave
from recsave import HashTable
from recsave.tables.optim import SparseAdagrad

torch.set_num_threads(1)


class Tower(torch.nn.Module):
    """A named table and an unnamed one inside a submodule, and a dense layer."""

    def __init__(self, dim: int = 4, id_map: str = "auto", seed: int = 0):
        super().__init__()
        self.emb = torch.nn.Module()
        self.emb.user = HashTable(dim, name="user", seed=seed + 1, id_map=id_map)
        self.emb.anon = HashTable(dim, seed=seed + 2, id_map=id_map)
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb.user(ids) + self.emb.anon(ids * 7)).sum()


def trained(id_map: str = "auto", steps: int = 3, seed: int = 0) -> tuple:
    model = Tower(id_map=id_map, seed=seed)
    opt = SparseAdagrad(model, lr=0.1)
    for step in range(steps):
        model(torch.arange(step * 5, step * 5 + 9, dtype=torch.int64) * 1_000_003).backward()
        opt.step()
        opt.zero_grad()
    model.emb.user.delete(torch.tensor([5_000_015]))  # a freed row in the middle
    return model, opt


def table_contents(table: HashTable) -> dict:
    ids, values, slots = table.export()
    return {"ids": ids, "embedding": values, **slots}


def assert_tables_equal(a: HashTable, b: HashTable) -> None:
    ca, cb = table_contents(a), table_contents(b)
    assert sorted(ca) == sorted(cb)
    for k in ca:
        assert torch.equal(ca[k], cb[k]), k
    assert [a.slot_init(s) for s in a.slot_names()] == [b.slot_init(s) for s in b.slot_names()]


def assert_models_equal(a: Tower, b: Tower) -> None:
    assert_tables_equal(a.emb.user, b.emb.user)
    assert_tables_equal(a.emb.anon, b.emb.anon)
    assert torch.equal(a.lin.weight, b.lin.weight) and torch.equal(a.lin.bias, b.lin.bias)


# ------------------------------------------------------------------------------ state_dict
def test_state_dict_keys_live_under_the_module_path_and_split_keeps_checkpoint_names():
    model, _ = trained()
    sd = model.state_dict()
    assert set(sd) == {"emb.user.table", "emb.anon.table", "lin.weight", "lin.bias"}
    assert sd["emb.user.table"] is model.emb.user
    sparse, dense = recsave.split_sparse_dense_state_dict(sd)
    assert sparse == {"user": model.emb.user, "emb.anon": model.emb.anon}
    assert set(dense) == {"lin.weight", "lin.bias"}


@pytest.mark.parametrize("strict", [True, False])
def test_load_state_dict_round_trips_tables_exactly(strict):
    a, _ = trained()
    b = Tower(seed=9)
    SparseAdagrad(b, lr=0.1)
    result = b.load_state_dict(a.state_dict(), strict=strict)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert len(b.emb.user) == len(a.emb.user) > 0
    assert_models_equal(a, b)


def test_load_state_dict_creates_slots_with_their_init_values():
    a, _ = trained()
    b = Tower()  # no optimizer: no slots yet
    b.load_state_dict(a.state_dict())
    assert b.emb.user.slot_names() == ["adagrad_acc"]
    assert_models_equal(a, b)


def test_load_state_dict_of_a_root_table_and_of_itself():
    a, _ = trained()
    t = HashTable(4, name="user", seed=1)
    assert list(a.emb.user.state_dict()) == ["table"]
    t.load_state_dict(a.emb.user.state_dict())
    assert_tables_equal(a.emb.user, t)
    before = table_contents(t)
    t.load_state_dict(t.state_dict())
    assert all(torch.equal(before[k], v) for k, v in table_contents(t).items())


def test_missing_table_is_reported_strict_and_non_strict():
    a, _ = trained()
    b = Tower(seed=3)
    sd = a.state_dict()
    del sd["emb.anon.table"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "emb.anon.table"'):
        b.load_state_dict(sd)
    c = Tower(seed=3)
    result = c.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["emb.anon.table"] and result.unexpected_keys == []
    assert_tables_equal(a.emb.user, c.emb.user)
    assert len(c.emb.anon) == 0


def test_unexpected_keys_under_a_table_are_reported():
    a, _ = trained()
    sd = dict(a.state_dict(), **{"emb.user.ids": torch.zeros(3, dtype=torch.int64)})
    result = Tower().load_state_dict(sd, strict=False)
    assert result.unexpected_keys == ["emb.user.ids"]


@pytest.mark.parametrize("entry, message", [
    (lambda: torch.zeros(3), "emb.user.table: expected a HashTable, got Tensor"),
    (lambda: HashTable(5), "emb.user.table: the state holds a table of dim 5, float32; "
                           "this table is dim 4, float32"),
    (lambda: HashTable(4, dtype=torch.float64), "emb.user.table: the state holds a table of dim 4, "
                                                "float64; this table is dim 4, float32"),
])
def test_mismatched_entry_names_the_key_and_changes_nothing(entry, message):
    a, _ = trained()
    b, _ = trained(seed=4)
    before = table_contents(b.emb.user)
    sd = dict(a.state_dict(), **{"emb.user.table": entry()})
    for strict in (True, False):
        with pytest.raises(RuntimeError) as err:
            b.load_state_dict(sd, strict=strict)
        assert message in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in table_contents(b.emb.user).items())


class ProjectedTable(HashTable):
    """A HashTable subclass with state of its own: a parameter, a buffer and a submodule."""

    def __init__(self, dim: int, **kwargs):
        super().__init__(dim, **kwargs)
        self.scale = torch.nn.Parameter(torch.ones(dim))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(super().forward(ids) * self.scale)


def _projected(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.emb = ProjectedTable(4, name="emb", seed=seed)
    model.emb(torch.arange(6))
    with torch.no_grad():
        model.emb.scale.fill_(seed + 2.0)
        model.emb.calls.fill_(seed + 7)
    return model


def assert_rows_equal_by_id(a: HashTable, b: HashTable) -> None:
    """Same ids, rows and slots, whatever order the rows lie in."""
    ids = torch.sort(a.ids()).values
    assert torch.equal(torch.sort(b.ids()).values, ids)
    (_, va, sa), (_, vb, sb) = a.export(ids), b.export(ids)
    assert torch.equal(va, vb) and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _assert_projected_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert_rows_equal_by_id(a.emb, b.emb)
    for name in ("scale", "calls", "proj.weight", "proj.bias"):
        assert torch.equal(a.emb.get_parameter(name) if name != "calls" else a.emb.calls,
                           b.emb.get_parameter(name) if name != "calls" else b.emb.calls), name


@pytest.mark.parametrize("strict", [True, False])
def test_a_table_subclass_keeps_its_own_parameters_buffers_and_submodules(tmp_path, strict):
    """A subclass's own state was left out of state_dict (so of every save), and its submodules'
    keys were reported unexpected: a strict load of the model's own state_dict failed."""
    src, dst = _projected(0), _projected(5)
    state = src.state_dict()
    assert list(state) == ["emb.scale", "emb.calls", "emb.table", "emb.proj.weight", "emb.proj.bias"]
    result = dst.load_state_dict(state, strict=strict)
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_projected_equal(src, dst)
    recsave.Saver(src, output_dir=str(tmp_path)).save("ckpt_1")
    again = _projected(9)
    recsave.Saver(again, output_dir=str(tmp_path)).load()
    _assert_projected_equal(src, again)
    state["emb.other"] = torch.zeros(1)  # still reported: no state of the subclass's
    assert dst.load_state_dict(state, strict=False).unexpected_keys == ["emb.other"]


def test_load_state_dict_pre_hooks_of_a_table_run():
    """torch runs a module's load_state_dict pre-hooks in _load_from_state_dict, which HashTable
    overrides: a hook migrating an old key was skipped, and the table stayed empty."""
    src = HashTable(4, name="emb")
    src(torch.arange(5))
    table = HashTable(4, name="emb")
    calls = []

    def migrate(module, state_dict, prefix, *args):
        calls.append(prefix)
        if prefix + "legacy" in state_dict:
            state_dict[prefix + "table"] = state_dict.pop(prefix + "legacy")
    table.register_load_state_dict_pre_hook(migrate)
    holder = torch.nn.Module()
    holder.emb = table
    result = holder.load_state_dict({"emb.legacy": src})
    assert calls == ["emb."] and result.missing_keys == [] and result.unexpected_keys == []
    assert_tables_equal(src, table)


def test_split_refuses_two_tables_under_one_checkpoint_name():
    model = torch.nn.Module()
    model.a = HashTable(4, name="same")
    model.b = HashTable(4, name="same")
    with pytest.raises(recsave.UsageError, match="'same'.*'a.table' and 'b.table'"):
        recsave.split_sparse_dense_state_dict(model.state_dict())


# ----------------------------------------------------------------------- pickle / deepcopy
@pytest.mark.parametrize("id_map", ["cpu", "tensor"])
def test_torch_save_of_a_state_dict_round_trips(tmp_path, id_map):
    a, _ = trained(id_map)
    torch.save(a.state_dict(), tmp_path / "sd.pt")
    sd = torch.load(tmp_path / "sd.pt", weights_only=False)
    assert isinstance(sd["emb.user.table"], HashTable)
    assert_tables_equal(a.emb.user, sd["emb.user.table"])
    b = Tower(id_map=id_map, seed=5)
    b.load_state_dict(sd)
    assert_models_equal(a, b)


@pytest.mark.parametrize("id_map", ["cpu", "tensor"])
def test_pickled_table_keeps_its_configuration(id_map):
    a, _ = trained(id_map)
    a.emb.user.set_partition(0, 2)
    a.eval()
    t = pickle.loads(pickle.dumps(a.emb.user))
    assert (t.embedding_dim, t.name, t.dtype, t.device, t.init_std, t.seed, t.partition, t.training) == \
        (4, "user", torch.float32, torch.device("cpu"), 0.01, 1, (0, 2, 4096), False)
    assert type(t.lookup(torch.tensor([1]), insert=False)) is torch.Tensor
    assert_tables_equal(a.emb.user, t)
    new = torch.tensor([123456789])
    assert torch.equal(t.initial_rows(new), a.emb.user.initial_rows(new))


@pytest.mark.parametrize("id_map", ["cpu", "tensor"])
def test_deepcopy_is_exact_and_independent(id_map):
    a, _ = trained(id_map)
    before = {k: v.clone() for k, v in table_contents(a.emb.user).items()}
    b = copy.deepcopy(a)
    assert_models_equal(a, b)
    assert b.emb.user is not a.emb.user
    opt_b = SparseAdagrad(b, lr=0.5)
    b(torch.arange(100, 120, dtype=torch.int64)).backward()
    opt_b.step()
    assert len(b.emb.user) > len(a.emb.user)
    after = table_contents(a.emb.user)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_weights_only_load_refuses_a_pickled_table(tmp_path):
    a, _ = trained()
    torch.save(a.state_dict(), tmp_path / "sd.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "sd.pt", weights_only=True)


def test_plain_state_dict_loads_with_weights_only(tmp_path):
    a, _ = trained()
    plain = recsave.to_dcp_state_dict(a)
    per_table = ("ids", "embedding", "slot.adagrad_acc", "last_step", "count", "step")
    assert set(plain) == {f"emb.{t}.table.{c}" for t in ("user", "anon") for c in per_table} | {"lin.weight",
                                                                                                "lin.bias"}
    assert all(type(v) is torch.Tensor for v in plain.values())
    buf = io.BytesIO()
    torch.save(plain, buf)
    buf.seek(0)
    b = Tower(seed=6)
    b.emb.user.step = 42  # replaced by the saved step, as a load_state_dict of the table does
    recsave.from_dcp_state_dict(b, torch.load(buf, weights_only=True))
    assert_models_equal(a, b)
    for name in ("user", "anon"):  # row metadata and table steps come back: evict() sees the same ages
        ta, tb = getattr(a.emb, name), getattr(b.emb, name)
        ids = torch.sort(ta.ids()).values
        assert tb.step == ta.step > 0
        ma, mb = ta.row_meta(ta.lookup(ids, insert=False)), tb.row_meta(tb.lookup(ids, insert=False))
        assert all(torch.equal(ma[m], mb[m]) for m in ma) and int(ma["count"].sum()) > 0

    # A plain state written before the metadata existed still loads; the table keeps its step.
    old = {k: v for k, v in plain.items() if not k.endswith((".last_step", ".count", ".step"))}
    c = Tower(seed=7)
    c.emb.user.step = 9
    recsave.from_dcp_state_dict(c, old)
    assert c.emb.user.step == 9 and bool((c.emb.user.row_meta(torch.arange(len(c.emb.user)))["last_step"] == 9).all())


def test_plain_state_dict_missing_table_raises_naming_it():
    a, _ = trained()
    plain = recsave.to_dcp_state_dict(a)
    del plain["emb.anon.table.embedding"]
    b = Tower(seed=6)
    with pytest.raises(recsave.UsageError, match="emb.anon.table.embedding"):
        recsave.from_dcp_state_dict(b, plain)
    assert len(b.emb.user) == 0  # nothing loaded
    plain = {k: v for k, v in recsave.to_dcp_state_dict(a).items() if not k.startswith("emb.anon.")}
    with pytest.raises(recsave.UsageError, match=r"missing \['emb.anon.table'\], unexpected \[\]"):
        recsave.from_dcp_state_dict(b, plain)
    result = recsave.from_dcp_state_dict(b, plain, strict=False)
    assert result.missing_keys == ["emb.anon.table"] and result.unexpected_keys == []
    assert_tables_equal(a.emb.user, b.emb.user)


@pytest.mark.parametrize("column", ["embedding", "slot.acc"])
def test_from_dcp_state_dict_refuses_another_dtype_and_loads_nothing(column):
    src = HashTable(4, name="user", dtype=torch.float64)
    src(torch.arange(5))
    src.add_slot("acc", 0.5)
    state = {f"t.{k}": v for k, v in recsave.to_dcp_state_dict(src).items()}  # t.table.ids, ...
    if column == "slot.acc":  # the embedding already matches; only a slot differs
        state = {k: v.float() if k.endswith(".embedding") else v for k, v in state.items()}
    _refused_and_unchanged(HashTable(4, name="user", dtype=torch.float32), state,
                           rf"from_dcp_state_dict: t\.table\.{column} is float64; table t\.table is float32; "
                           rf"convert the state's tensors")


def _refused_and_unchanged(table, state, match):
    """from_dcp_state_dict of `state` into a model holding `table` (ids 0, 1) raises UsageError
    matching `match`, and the table keeps its ids and rows."""
    dst = torch.nn.Module()
    dst.t = table
    dst.t(torch.arange(2))
    before = dst.t.export()
    with pytest.raises(recsave.UsageError, match=match):
        recsave.from_dcp_state_dict(dst, state)
    after = dst.t.export()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_from_dcp_state_dict_refuses_repeated_ids_and_loads_nothing():
    """ids [7, 8, 7] with three rows loaded as ids [7, 8]: one of id 7's rows dropped, silently
    (convert refuses the same input). Refused now, before the model changes."""
    src = HashTable(2, name="user")
    src(torch.tensor([7, 8, 9]))
    state = {f"t.{k}": v for k, v in recsave.to_dcp_state_dict(src).items()}
    state["t.table.ids"] = torch.tensor([7, 8, 7])
    _refused_and_unchanged(HashTable(2, name="user"), state,
                           r"from_dcp_state_dict: t\.table\.ids repeats ids \(3 ids, 2 distinct\); each id "
                           r"must appear once")


# ---------------------------------------------------------------------------------------- DCP
def test_dcp_save_load_round_trip(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    a, _ = trained()
    path = str(tmp_path / "dcp")
    b = Tower(seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(recsave.to_dcp_state_dict(a), checkpoint_id=path)
        reader = dcp.FileSystemReader(path)
        dest = recsave.to_dcp_state_dict(b, metadata=reader.read_metadata())
        dcp.load(dest, storage_reader=reader)
    recsave.from_dcp_state_dict(b, dest)
    assert_models_equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_table_pickles_and_deep_copies():
    t = HashTable(4, name="g", device="cuda", seed=2)
    t(torch.arange(10, dtype=torch.int64))
    t.add_slot("acc", 0.5)
    for other in (pickle.loads(pickle.dumps(t)), copy.deepcopy(t)):
        assert other.device.type == "cuda"
        assert_tables_equal(t, other)


# ----------------------------------------------------------------- under torch.inference_mode()
def _train_once(model: Tower, opt: SparseAdagrad) -> None:
    model(torch.arange(3, dtype=torch.int64)).backward()
    opt.step()
    opt.zero_grad()


def _storage_is_normal(table: HashTable) -> bool:
    return not any(t.is_inference() for t in [table.weight, *table.columns().values()])


@pytest.mark.parametrize("id_map", ["cpu", "tensor"])
@pytest.mark.parametrize("how", ["training_lookup", "load_state_dict", "saver_load", "from_dcp_state_dict",
                                 "deepcopy"])
def test_a_table_grown_or_loaded_under_inference_mode_still_trains(tmp_path, id_map, how):
    """Tensors allocated in inference mode can never be updated in place outside it: a table that
    allocated storage there would fail every later optimizer step."""
    source, _ = trained(id_map=id_map)
    saver = recsave.Saver(source, output_dir=str(tmp_path))
    saver.save("ckpt_1")
    model = Tower(id_map=id_map, seed=5)
    opt = SparseAdagrad(model, lr=0.1)
    with torch.inference_mode():
        if how == "training_lookup":  # e.g. a validation pass before model.eval()
            model(torch.arange(1000, 3000, dtype=torch.int64))
        elif how == "load_state_dict":
            model.load_state_dict(source.state_dict())
        elif how == "saver_load":
            recsave.Saver(model, output_dir=str(tmp_path)).load()
        elif how == "from_dcp_state_dict":
            recsave.from_dcp_state_dict(model, recsave.to_dcp_state_dict(source))
        else:
            model.emb.user = copy.deepcopy(source.emb.user)
            opt = SparseAdagrad(model, lr=0.1)
        assert not torch.is_grad_enabled()  # the caller's grad mode is kept inside the calls
    assert _storage_is_normal(model.emb.user) and _storage_is_normal(model.emb.anon)
    _train_once(model, opt)  # raised "Inplace update to inference tensor outside InferenceMode"
    ids = torch.arange(3, dtype=torch.int64)
    _, rows, _ = model.emb.user.export(ids)
    assert not torch.equal(rows, model.emb.user.initial_rows(ids)) or how != "training_lookup"


# ----------------------------------------------------------- Module.to / .double() / .half()
@pytest.mark.parametrize("convert", ["double", "half", "to_bfloat16"])
def test_module_dtype_conversion_converts_the_tables_rows_and_slots(convert):
    model, opt = trained()
    before = {name: table_contents(t) for name, t in (("user", model.emb.user), ("anon", model.emb.anon))}
    meta_before = model.emb.user.row_meta(model.emb.user.lookup(model.emb.user.ids(), insert=False))
    dtype = {"double": torch.float64, "half": torch.float16, "to_bfloat16": torch.bfloat16}[convert]
    out = model.double() if convert == "double" else model.half() if convert == "half" else model.to(dtype)
    assert out is model and model.lin.weight.dtype == dtype
    for name, table in (("user", model.emb.user), ("anon", model.emb.anon)):
        assert table.dtype == dtype and table.weight.dtype == dtype
        assert all(t.dtype == dtype for t in table.columns().values())
        after = table_contents(table)
        assert torch.equal(after["ids"], before[name]["ids"])
        for key in before[name]:
            if key != "ids":
                assert torch.equal(after[key], before[name][key].to(dtype)), key
    meta_after = model.emb.user.row_meta(model.emb.user.lookup(model.emb.user.ids(), insert=False))
    assert all(torch.equal(meta_after[m], meta_before[m]) for m in meta_before)
    model(torch.arange(4, dtype=torch.int64)).backward()  # forward and a step in the new dtype
    opt.step()


def test_a_save_after_a_dtype_conversion_is_full_and_restores_in_that_dtype(tmp_path):
    model, _ = trained()
    saver = recsave.Saver(model, output_dir=str(tmp_path), max_keep=None)
    saver.save("ckpt_1")
    model.double()
    saver.save("ckpt_2", incremental=True)
    assert saver.last_save.kind == "full"  # every row changed bytes: no delta of the float32 base
    restored = Tower(seed=4).double()
    SparseAdagrad(restored, lr=0.1)  # its slot
    recsave.Saver(restored, output_dir=str(tmp_path)).load()
    for a, b in ((model.emb.user, restored.emb.user), (model.emb.anon, restored.emb.anon)):
        ids = torch.sort(a.ids()).values  # a restore puts rows in bucket order
        assert torch.equal(torch.sort(b.ids()).values, ids)
        (_, va, sa), (_, vb, sb) = a.export(ids), b.export(ids)
        assert vb.dtype == torch.float64 and torch.equal(va, vb) and sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(model.lin.weight, restored.lin.weight)


def test_a_device_move_leaves_the_table_on_its_device():
    """CPU tables beside dense layers that model.cuda() moved: the table stays (its id map lives
    on its device); a dtype in the same call still converts it."""
    model = Tower()
    model(torch.arange(3, dtype=torch.int64))
    out = model.to("meta", torch.float64)
    assert out is model and model.lin.weight.device.type == "meta"
    assert model.emb.user.device.type == "cpu" and model.emb.user.weight.device.type == "cpu"
    assert model.emb.user.dtype == torch.float64 and len(model.emb.user) == 3
    assert model.emb.user.cpu() is model.emb.user


def test_a_table_on_the_meta_device_is_refused():
    with pytest.raises(recsave.UsageError, match="device 'meta' holds no data"):
        HashTable(4, device="meta")


def test_saving_a_model_with_meta_tensors_is_refused_before_anything_is_written(tmp_path):
    """A dense layer left on the meta device (a model built under torch.device('meta') and never
    materialized) has no values: the save names it instead of torch's 'Cannot copy out of meta
    tensor' half way through the commit."""
    model, _ = trained()
    model.lin.to("meta")
    saver = recsave.Saver(model, output_dir=str(tmp_path))
    for save in (saver.save, lambda ckpt: saver.async_save(ckpt).result()):
        with pytest.raises(recsave.UsageError, match=r"'lin.bias', 'lin.weight' are on the meta device"):
            save("ckpt_1")
    saver.close()
    assert saver.checkpoints() == [] and not (tmp_path / "ckpt_1").exists()


def test_loading_into_meta_tensors_is_refused_and_changes_nothing(tmp_path):
    """A copy into a meta tensor is a no-op: the load would report the dense layer loaded while
    it stayed without values. It is refused before any table changes; materialized, it loads."""
    model, _ = trained()
    recsave.Saver(model, output_dir=str(tmp_path)).save("ckpt_1")
    fresh = Tower(seed=5)
    fresh.lin.to("meta")
    with pytest.raises(recsave.UsageError, match=r"'lin.bias', 'lin.weight' are on the meta device.*to_empty"):
        recsave.Saver(fresh, output_dir=str(tmp_path)).load()
    assert len(fresh.emb.user) == 0 and len(fresh.emb.anon) == 0
    fresh.to_empty(device="cpu")
    SparseAdagrad(fresh, lr=0.1)
    recsave.Saver(fresh, output_dir=str(tmp_path)).load()
    for name in ("user", "anon"):
        assert_rows_equal_by_id(getattr(model.emb, name), getattr(fresh.emb, name))
    assert torch.equal(model.lin.weight, fresh.lin.weight) and torch.equal(model.lin.bias, fresh.lin.bias)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only build")
def test_a_device_move_torch_cannot_make_leaves_a_tables_only_module_as_it_was():
    module = torch.nn.Module()
    module.user = HashTable(4, name="user")
    module.user(torch.arange(3))
    assert module.to("cuda") is module and module.user.device.type == "cpu" and len(module.user) == 3


# ------------------------------------------------------ torch.utils.checkpoint (activation recompute)
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_counts_each_lookup_once_and_trains_alike(reentrant):
    """torch.utils.checkpoint runs the forward again during backward: that second lookup must not
    count the rows' use again, and the gradients (so the rows after a step) match a plain run."""
    from torch.utils.checkpoint import checkpoint

    ids = torch.tensor([[3, 5, 3], [7, 5, 11]], dtype=torch.int64) * 1_000_003
    results = []
    for recompute in (False, True):
        model = Tower(seed=0)
        opt = SparseAdagrad(model, lr=0.1)
        for _ in range(2):
            # The reentrant form needs an input that requires grad (the ids cannot): a zero one.
            zero = torch.zeros((), requires_grad=True)
            loss = checkpoint(lambda i, z, m=model: m(i) + z, ids, zero, use_reentrant=reentrant) if recompute \
                else model(ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
        table = model.emb.user
        rows = table.lookup(torch.unique(ids), insert=False)
        results.append((table_contents(table), table.row_meta(rows)["count"].reshape(-1).tolist()))
    (plain, plain_count), (recomputed, recomputed_count) = results
    assert plain_count == [4, 4, 2, 2]  # ids 3 and 5 twice a batch, 7 and 11 once; two steps
    assert recomputed_count == plain_count
    assert plain.keys() == recomputed.keys()
    for name in plain:
        assert torch.equal(plain[name], recomputed[name]), name


@pytest.mark.parametrize("reentrant", [None, False, True])
def test_an_id_deleted_before_a_recompute_stays_deleted(reentrant):
    """An id deleted between a checkpointed forward and its backward: the recompute's training
    lookup inserted it anew (a fresh row, trained by the step, its tombstone gone). Its gradient
    is dropped, as without activation checkpointing (reentrant None: a plain forward)."""
    from torch.utils.checkpoint import checkpoint

    from recsave.optim import SparseSGD
    table = HashTable(4, name="t", seed=1)
    opt = SparseSGD(table, lr=1.0)
    zero = torch.zeros((), requires_grad=True)
    ids = torch.tensor([1, 2])
    out = table(ids) + zero if reentrant is None else \
        checkpoint(lambda i, z: table(i) + z, ids, zero, use_reentrant=reentrant)
    table.reset_changes()
    before = table.export(torch.tensor([2]))[1]
    assert table.delete(torch.tensor([1])) == 1
    out.sum().backward()
    opt.step()
    assert table.ids().tolist() == [2] and table.pending_changes().tombstones.tolist() == [1]
    assert torch.equal(table.export(torch.tensor([2]))[1], before - 1.0)  # id 2 trained as usual


def test_a_lookup_in_a_backward_hook_still_counts():
    """Only the recompute is skipped: a lookup a hook makes during backward (grad mode off there)
    counts and sets last_step like any training lookup."""
    model = Tower(seed=0)
    table = model.emb.user
    hook_ids = torch.tensor([424242], dtype=torch.int64)
    out = model(torch.tensor([1, 2], dtype=torch.int64))
    looked = []
    out.register_hook(lambda grad: looked.append(table(hook_ids)))
    out.backward()
    assert len(looked) == 1
    meta = table.row_meta(table.lookup(hook_ids, insert=False))
    assert meta["count"].reshape(-1).tolist() == [1]



def test_an_eval_lookup_of_a_new_table_gives_zero_rows():
    """A table nothing was inserted into yet (no storage): every id is absent, its row zeros, with
    grad mode on or off (index_select on empty storage raised before)."""
    table = HashTable(4, name="fresh")
    table.eval()
    ids = torch.tensor([[1, 2], [3, 4]], dtype=torch.int64)
    out = table(ids)
    assert out.shape == (2, 2, 4) and not out.any()
    out.sum().backward()  # nothing to update: no rows
    with torch.no_grad():
        assert not table(ids).any()
    assert len(table) == 0
