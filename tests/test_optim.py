"""recsave.tables.optim against torch's own sparse optimizers on nn.Embedding(sparse=True)."""
from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch

from recsave.errors import ArgumentTypeError, ConfigError, UsageError
from recsave.tables.hashtable import HashTable, split_sparse_dense_state_dict
from recsave.tables.optim import SparseAdagrad, SparseAdam, SparseOptimizer, SparseSGD

DIM = 8
ATOL = 1e-6
N_IDS = 24          # ids[:16] are trained on, ids[16:] never touched
N_TOUCHED = 16


def _ids(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-2 ** 62, 2 ** 62, (N_IDS * 2,), generator=g).unique()[:N_IDS]
    assert ids.numel() == N_IDS
    return ids[torch.randperm(N_IDS, generator=g)]


def _initial_rows(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Rows a fresh table gives these ids: a pure function of (seed, id), so a twin table tells us."""
    twin = HashTable(DIM, name="twin", seed=seed, init_std=0.5)
    return twin(ids).detach().clone()


def _setup(name: str = "emb", seed: int = 3) -> Tuple[torch.Tensor, HashTable, torch.nn.Embedding]:
    """A table holding the untouched ids and half of the trained ones (the rest are inserted while
    training, after the optimizer made its slots), and an Embedding holding all ids' initial rows."""
    ids = _ids()
    table = HashTable(DIM, name=name, seed=seed, init_std=0.5)
    table.lookup(ids[N_TOUCHED // 2:], insert=True)
    emb = torch.nn.Embedding(N_IDS, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(_initial_rows(ids, seed))
    return ids, table, emb


def _batches(steps: int = 7, seed: int = 1, pool: int = N_TOUCHED) -> List[torch.Tensor]:
    """Index batches into ids: duplicates within a batch, ids missing from some steps, one empty step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        if k == 3:
            out.append(torch.empty(0, dtype=torch.int64))  # no gradient at all this step
            continue
        sub = torch.arange(k % 2, pool, 2) if k % 3 == 1 else torch.arange(pool)  # only some ids
        pick = sub[torch.randint(0, sub.numel(), (3, 5), generator=g)]
        pick[0, :2] = pick[1, 0]  # guaranteed duplicates
        out.append(pick)
    return out


def _loss(out: torch.Tensor, k: int) -> torch.Tensor:
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + k))
    return (out * target).sum() + 0.3 * (out ** 2).sum()  # non-linear in the rows


def _rows(table: HashTable, ids: torch.Tensor) -> torch.Tensor:
    rows = table.lookup(ids, insert=False)
    assert bool((rows >= 0).all())
    return rows


def _train(opt: SparseOptimizer, table: HashTable, ids: torch.Tensor, batches: List[torch.Tensor],
           start: int = 0) -> None:
    for k, pos in enumerate(batches, start):
        opt.zero_grad()
        if pos.numel():
            _loss(table(ids[pos]), k).backward()
        opt.step()


def _train_torch(opt: torch.optim.Optimizer, emb: torch.nn.Embedding, batches: List[torch.Tensor]) -> None:
    for k, pos in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        if pos.numel():
            _loss(emb(pos), k).backward()
        opt.step()


pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch-internal, adagrad

CASES: Dict[str, Tuple[Callable, Callable, Dict[str, str]]] = {
    "sgd": (lambda t: SparseSGD(t, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1), {}),
    "adagrad": (lambda t: SparseAdagrad(t, lr=0.2, lr_decay=0.05, initial_accumulator_value=0.1, eps=1e-10),
                lambda p: torch.optim.Adagrad(p, lr=0.2, lr_decay=0.05, initial_accumulator_value=0.1,
                                              eps=1e-10),
                {"adagrad_acc": "sum"}),
    "adam": (lambda t: SparseAdam(t, lr=0.05, betas=(0.8, 0.95), eps=1e-8),
             lambda p: torch.optim.SparseAdam(p, lr=0.05, betas=(0.8, 0.95), eps=1e-8),
             {"adam_m": "exp_avg", "adam_v": "exp_avg_sq"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch(case: str) -> None:
    make, make_torch, slot_map = CASES[case]
    ids, table, emb = _setup()
    opt, topt = make(table), make_torch(emb.parameters())
    assert set(table.slot_names()) == set(opt.slot_names) == set(slot_map)
    untouched_before = table.weight[_rows(table, ids[N_TOUCHED:])].clone()
    batches = _batches()
    _train(opt, table, ids, batches)
    _train_torch(topt, emb, batches)

    touched = torch.cat([b.reshape(-1) for b in batches]).unique()
    assert touched.numel() == N_TOUCHED
    got = table.weight[_rows(table, ids[touched])]
    torch.testing.assert_close(got, emb.weight.detach()[touched], atol=ATOL, rtol=0)
    assert not torch.allclose(got, _initial_rows(ids, 3)[touched])  # the test can fail: rows moved
    torch.testing.assert_close(table.weight[_rows(table, ids[N_TOUCHED:])], untouched_before, atol=0, rtol=0)
    state = topt.state[emb.weight]
    for slot, torch_name in slot_map.items():
        torch.testing.assert_close(table.slot(slot)[_rows(table, ids[touched])], state[torch_name][touched],
                                   atol=ATOL, rtol=0)
        # untouched rows keep the slot's initial value
        init = 0.1 if case == "adagrad" else 0.0
        assert bool((table.slot(slot)[_rows(table, ids[N_TOUCHED:])] == init).all())
    if "step" in state:  # one step had no gradient: neither counts it
        assert opt.steps == {"emb": int(state["step"])} == {"emb": len(batches) - 1}


@pytest.mark.parametrize("case", ["sgd", "adagrad"])
def test_weight_decay_equals_dense_torch_when_every_row_is_touched(case: str) -> None:
    """torch refuses weight decay with sparse gradients; ours is lazy (touched rows only), so it equals
    dense torch exactly when every row gets a gradient each step."""
    ids, table, emb = _setup()
    emb.sparse = False
    if case == "sgd":
        opt, topt = SparseSGD(table, lr=0.1, weight_decay=0.2), torch.optim.SGD(emb.parameters(), lr=0.1,
                                                                                 weight_decay=0.2)
    else:
        opt = SparseAdagrad(table, lr=0.1, weight_decay=0.2, lr_decay=0.01)
        topt = torch.optim.Adagrad(emb.parameters(), lr=0.1, weight_decay=0.2, lr_decay=0.01)
    g = torch.Generator().manual_seed(5)
    batches = [torch.cat([torch.randperm(N_IDS, generator=g), torch.randint(0, N_IDS, (6,), generator=g)])
               for _ in range(5)]
    _train(opt, table, ids, batches)
    _train_torch(topt, emb, batches)
    torch.testing.assert_close(table.weight[_rows(table, ids)], emb.weight.detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip_resumes_identically(case: str, tmp_path) -> None:
    make, _make_torch, _slots = CASES[case]
    ids, table_a, _ = _setup()
    _, table_b, _ = _setup()
    opt_a, opt_b = make(table_a), make(table_b)
    batches = _batches(steps=8)
    _train(opt_a, table_a, ids, batches[:4])
    _train(opt_b, table_b, ids, batches[:4])

    torch.save(opt_b.state_dict(), tmp_path / "opt.pt")
    saved_ids, values, slots = table_b.export()
    # A restart: new table and optimizer (another lr, which the state overrides), then the restore.
    table_c = HashTable(DIM, name="emb", seed=3, init_std=0.5)
    opt_c = type(opt_b)(table_c, **{k: v for k, v in opt_b.hparams.items() if k != "lr"}, lr=123.0)
    table_c.load_rows(saved_ids, values, slots)
    opt_c.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert opt_c.state_dict() == opt_a.state_dict()

    _train(opt_a, table_a, ids, batches[4:], start=4)
    _train(opt_c, table_c, ids, batches[4:], start=4)
    torch.testing.assert_close(table_c.weight[_rows(table_c, ids)], table_a.weight[_rows(table_a, ids)],
                               atol=0, rtol=0)
    for slot in opt_a.slot_names:
        torch.testing.assert_close(table_c.slot(slot)[_rows(table_c, ids)], table_a.slot(slot)[_rows(table_a, ids)],
                                   atol=0, rtol=0)


def test_state_dict_is_plain_python() -> None:
    opt = SparseAdam(HashTable(DIM, name="t"), lr=0.01)
    sd = opt.state_dict()
    assert sd == {"optimizer": "SparseAdam", "hparams": {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8},
                  "steps": {"t": 0}}
    sd["steps"]["t"] = 5  # a copy: mutating it does not touch the optimizer
    assert opt.steps == {"t": 0}


def test_hparams_set_between_steps_are_saved_as_plain_numbers_that_load() -> None:
    opt = SparseAdam(HashTable(DIM, name="t"), lr=0.1)
    opt.hparams["lr"] = torch.tensor(0.5)  # what an lr schedule computing in tensors leaves
    opt.hparams["betas"] = [0.8, 0.9]
    sd = opt.state_dict()
    assert sd["hparams"] == {"lr": 0.5, "betas": (0.8, 0.9), "eps": 1e-8}
    assert type(sd["hparams"]["lr"]) is float
    other = SparseAdam(HashTable(DIM, name="t"), lr=0.1)
    other.load_state_dict(sd)
    assert other.hparams == sd["hparams"]
    opt.hparams["lr"] = -1.0
    with pytest.raises(UsageError, match=r"SparseAdam: invalid learning rate \(must be >= 0\): -1.0"):
        opt.state_dict()


def test_numpy_hparams_are_saved_as_plain_numbers_and_json_states_load() -> None:
    """An lr a schedule computed with numpy is saved as a float (torch.load(weights_only=True)
    refuses numpy scalars), and a state that went through JSON (betas as a list) loads."""
    import io
    import json

    import numpy as np
    opt = SparseAdam(HashTable(DIM, name="t"), lr=0.1)
    opt.hparams["lr"] = 0.1 * np.cos(0.5)
    opt.hparams["eps"] = np.float32(1e-6)
    opt.hparams["betas"] = (np.float64(0.8), np.array([0.9]))
    sd = opt.state_dict()
    assert [type(v) for v in (sd["hparams"]["lr"], sd["hparams"]["eps"], *sd["hparams"]["betas"])] == [float] * 4
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == sd
    for betas in (np.array([0.8, 0.99]), torch.tensor([0.8, 0.99], dtype=torch.float64)):  # what step() takes
        opt.hparams["betas"] = betas
        assert opt.state_dict()["hparams"]["betas"] == (0.8, 0.99)
    opt.hparams["betas"] = (np.float64(0.8), np.array([0.9]))
    sd = opt.state_dict()
    other = SparseAdam(HashTable(DIM, name="t"), lr=0.1)
    other.load_state_dict(json.loads(json.dumps(sd)))
    assert other.hparams == sd["hparams"] and other.hparams["betas"] == (0.8, 0.9)


@pytest.mark.parametrize("case", sorted(CASES))
def test_zero_grad_and_accumulation(case: str) -> None:
    make, make_torch, _slots = CASES[case]
    ids, table, emb = _setup()
    opt, topt = make(table), make_torch(emb.parameters())
    table(ids[:4]).sum().backward()  # inserts ids[:4] (not in the table yet)
    before = table.weight.clone()
    opt.zero_grad()
    assert table.coalesced_grad() is None
    opt.step()  # nothing to do: no row changes, no step counted
    torch.testing.assert_close(table.weight, before, atol=0, rtol=0)
    assert opt.steps == {"emb": 0}

    # Without zero_grad between two backward passes the gradients add up, as in torch.
    pos = torch.tensor([0, 2, 2, 5])
    for k in range(2):
        _loss(table(ids[pos]), k).backward()
        _loss(emb(pos), k).backward()
    opt.step()
    topt.step()
    torch.testing.assert_close(table.weight[_rows(table, ids[pos])], emb.weight.detach()[pos], atol=ATOL, rtol=0)


class _CTR(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = HashTable(DIM, name="user", seed=3, init_std=0.5)
        self.item = HashTable(DIM, name="item", seed=4, init_std=0.5)
        self.mlp = torch.nn.Linear(2 * DIM, 1)


def test_model_with_two_tables_counts_steps_per_table() -> None:
    model = _CTR()
    opt = SparseAdam(model, lr=0.05)
    assert opt.tables == {"user": model.user, "item": model.item}
    ids = _ids()
    embs = {n: torch.nn.Embedding(N_IDS, DIM, sparse=True) for n in ("user", "item")}
    with torch.no_grad():
        embs["user"].weight.copy_(_initial_rows(ids, 3))
        embs["item"].weight.copy_(_initial_rows(ids, 4))
    topt = torch.optim.SparseAdam([embs["user"].weight, embs["item"].weight], lr=0.05)
    touched: Dict[str, List[torch.Tensor]] = {"user": [], "item": []}
    for k, pos in enumerate(_batches(steps=6)):
        opt.zero_grad()
        topt.zero_grad(set_to_none=True)
        if not pos.numel():
            continue
        use_item = k % 2 == 0  # the item table misses every other step: its bias correction lags
        touched["user"].append(pos.reshape(-1))
        if use_item:
            touched["item"].append(pos.reshape(-1))
        out = model.user(ids[pos]) + (model.item(ids[pos]) if use_item else 0)
        tout = embs["user"](pos) + (embs["item"](pos) if use_item else 0)
        _loss(out, k).backward()
        _loss(tout, k).backward()
        opt.step()
        topt.step()
    assert opt.steps == {"user": 5, "item": 3}
    for name in ("user", "item"):
        assert opt.steps[name] == topt.state[embs[name].weight]["step"]
        table = opt.tables[name]
        rows = torch.cat(touched[name]).unique()
        torch.testing.assert_close(table.weight[_rows(table, ids[rows])], embs[name].weight.detach()[rows],
                                   atol=ATOL, rtol=0)
        torch.testing.assert_close(table.slot("adam_v")[_rows(table, ids[rows])],
                                   topt.state[embs[name].weight]["exp_avg_sq"][rows], atol=ATOL, rtol=0)


def test_unnamed_tables_take_their_module_path() -> None:
    model = torch.nn.Module()
    model.emb = HashTable(4)
    model.tower = torch.nn.Sequential(HashTable(4), torch.nn.Linear(4, 4))
    model.named = HashTable(4, name="given")
    opt = SparseAdagrad(model, lr=0.1)
    assert set(opt.tables) == {"emb", "tower.0", "given"}
    assert opt.tables["tower.0"] is model.tower[0]
    # the names split_sparse_dense_state_dict (the Saver) gives them, so checkpoints and optimizer
    # state line up
    assert set(opt.tables) == set(split_sparse_dense_state_dict(model.state_dict())[0])
    assert all(t.slot_names() == ["adagrad_acc"] for t in opt.tables.values())


def test_tables_given_directly() -> None:
    a, b = HashTable(4, name="a"), HashTable(4, name="b")
    assert SparseSGD(a, lr=0.1).tables == {"a": a}
    assert SparseSGD([a, b, a], lr=0.1).tables == {"a": a, "b": b}
    assert SparseSGD.slot_names == () and SparseAdam.slot_names == ("adam_m", "adam_v")


@pytest.mark.parametrize("make", [
    lambda: SparseSGD(torch.nn.Linear(2, 2), lr=0.1),
    lambda: SparseAdam([], lr=0.1),
    lambda: SparseSGD(HashTable(4), lr=0.1),                              # no name and no model
    lambda: SparseSGD([HashTable(4, name="a"), HashTable(4, name="a")], lr=0.1),
    lambda: SparseSGD(HashTable(4, name="a"), lr=-0.1),
    lambda: SparseSGD(HashTable(4, name="a"), lr=0.1, weight_decay=-1.0),
    lambda: SparseAdagrad(HashTable(4, name="a"), lr=float("nan")),
    lambda: SparseAdagrad(HashTable(4, name="a"), eps=-1e-10),
    lambda: SparseAdagrad(HashTable(4, name="a"), initial_accumulator_value=-1.0),
    lambda: SparseAdam(HashTable(4, name="a"), betas=(0.9, 1.0)),
    lambda: SparseAdam(HashTable(4, name="a"), betas=(-0.1, 0.9)),
    lambda: SparseAdam(HashTable(4, name="a"), betas=(0.9,)),
    lambda: SparseAdam(HashTable(4, name="a"), eps=-1e-8),
    lambda: SparseAdam(HashTable(4, name="a"), eps=0.0),
])
def test_usage_errors(make) -> None:
    with pytest.raises(UsageError):
        make()


@pytest.mark.parametrize("make", [
    lambda: SparseSGD([HashTable(4, name="a"), torch.zeros(3)], lr=0.1),
    lambda: SparseSGD(3, lr=0.1),
])
def test_tables_of_the_wrong_type(make) -> None:
    with pytest.raises(ArgumentTypeError, match="model_or_tables must be an nn.Module, a HashTable or an "
                                                "iterable of HashTables, got (Tensor|int)"):
        make()


def test_no_tables_message() -> None:
    with pytest.raises(UsageError, match="holds no HashTable"):
        SparseAdagrad(torch.nn.Linear(2, 2))


def test_load_state_dict_errors() -> None:
    table = HashTable(4, name="a")
    adam = SparseAdam(table)
    with pytest.raises(ConfigError, match="SparseAdagrad"):
        adam.load_state_dict(SparseAdagrad(table).state_dict())
    other = SparseAdam([table, HashTable(4, name="b")]).state_dict()
    with pytest.raises(ConfigError, match="'b'"):
        adam.load_state_dict(other)
    bad = [
        {"steps": {}},
        {**adam.state_dict(), "steps": {"a": -1}},
        {**adam.state_dict(), "steps": [1]},
        {**adam.state_dict(), "hparams": {"lr": 0.1}},
        {**adam.state_dict(), "hparams": {"lr": 0.1, "betas": (0.9, 2.0), "eps": 1e-8}},
        torch.zeros(3),
    ]
    for sd in bad:
        with pytest.raises(ConfigError):
            adam.load_state_dict(sd)
    assert adam.state_dict() == SparseAdam(table).state_dict()  # nothing half-loaded
    with pytest.raises(ConfigError, match="initial_accumulator_value"):
        SparseAdagrad(table, initial_accumulator_value=0.5).load_state_dict(SparseAdagrad(table).state_dict())
    # a table the state does not mention (added to the model since) starts at step 0
    two = SparseAdam([table, HashTable(4, name="b")])
    two.load_state_dict({**adam.state_dict(), "steps": {"a": 4}})
    assert two.steps == {"a": 4, "b": 0}


def test_slots_follow_new_rows_and_growth() -> None:
    table = HashTable(DIM, name="t", seed=0)
    old = torch.arange(10, dtype=torch.int64)
    table.lookup(old, insert=True)
    opt = SparseAdagrad(table, lr=0.1, initial_accumulator_value=0.25)
    table(old).sum().backward()
    opt.step()
    acc_old = table.slot("adagrad_acc")[_rows(table, old)].clone()
    assert bool((acc_old == 1.25).all())
    new = torch.arange(10, 5000, dtype=torch.int64)  # past the first capacity: storage grows
    opt.zero_grad()
    table(new)
    torch.testing.assert_close(table.slot("adagrad_acc")[_rows(table, old)], acc_old, atol=0, rtol=0)
    assert bool((table.slot("adagrad_acc")[_rows(table, new)] == 0.25).all())


# ----------------------------------------------------- gradients the usual torch idioms leave
class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = HashTable(DIM, name="user", seed=1)
        self.lin = torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.user(ids)).sum()


def test_a_step_that_reapplies_uncleared_gradients_warns_naming_the_fix() -> None:
    model = _Model()
    opt = SparseSGD(model, lr=1.0)
    ids = torch.tensor([7])
    model.zero_grad()
    model(ids).backward()
    opt.step()  # first application: no warning
    model.zero_grad()  # the torch idiom: does not reach the table
    model(ids).backward()
    with pytest.warns(RuntimeWarning, match=r"HashTable 'user': its gradients were applied by an earlier step\(\) "
                                            r"and not cleared since.*call the sparse optimizer's zero_grad\(\)") as rec:
        opt.step()
    assert rec[0].filename == __file__  # points at the caller's step()
    opt.zero_grad()
    model(ids).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # cleared in between: fine


def test_accumulating_several_backwards_before_one_step_does_not_warn() -> None:
    model = _Model()
    opt = SparseSGD(model, lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            model(torch.tensor([1, 2])).backward()
        opt.step()
        opt.zero_grad()


def test_a_frozen_table_records_no_gradient_and_keeps_its_rows() -> None:
    model = _Model()
    opt = SparseSGD(model, lr=1.0)
    ids = torch.tensor([3, 4])
    assert model.user.requires_grad_(False) is model.user and model.user.requires_grad is False
    model(ids).backward()  # the dense layer still gets its gradient
    assert model.lin.weight.grad is not None and model.user.coalesced_grad() is None
    before = model.user.export(ids)[1].clone()
    opt.step()
    assert torch.equal(model.user.export(ids)[1], before) and opt.steps == {"user": 0}
    model.user.requires_grad_(True)
    model(ids).backward()
    opt.step()
    assert not torch.equal(model.user.export(ids)[1], before) and opt.steps == {"user": 1}
    with pytest.raises(ArgumentTypeError):
        model.user.requires_grad_("no")  # type: ignore[arg-type]



def test_a_table_frozen_between_forward_and_backward_gets_no_gradient() -> None:
    """As torch drops the gradient of a parameter frozen after its forward (AccumulateGrad), a
    table frozen before the backward of a graph recorded while it trained keeps its rows."""
    model = _Model()
    opt = SparseSGD(model, lr=1.0)
    ids = torch.tensor([3, 4])
    model(ids)  # the rows exist
    before = model.user.export(ids)[1].clone()
    loss = model(ids)
    model.user.requires_grad_(False)
    loss.backward()
    assert model.user.coalesced_grad() is None and model.lin.weight.grad is not None
    opt.step()
    assert torch.equal(model.user.export(ids)[1], before) and opt.steps == {"user": 0}

def test_gradients_no_optimizer_takes_are_summed_not_kept_per_backward() -> None:
    table = HashTable(DIM, name="t", seed=2)
    ids = torch.arange(5)
    expected = torch.zeros(5, DIM)
    for k in range(600):
        weights = torch.full((5, DIM), float(k % 7))
        (table(ids) * weights).sum().backward()
        expected += weights
    rows, summed = table.coalesced_grad()
    assert len(table._grads._parts) <= table._grads.MAX_PARTS  # the bound under test
    assert rows.tolist() == table.lookup(ids, insert=False).sort().values.tolist()
    order = torch.argsort(table.lookup(ids, insert=False))
    assert torch.equal(summed, expected[order])


def test_a_backward_after_a_delete_reused_the_row_updates_no_other_id() -> None:
    table = HashTable(DIM, name="t", seed=4)
    opt = SparseSGD(table, lr=1.0)
    table(torch.tensor([1, 2]))  # rows 0 and 1
    out = table(torch.tensor([1]))
    table.delete(torch.tensor([1]))
    table(torch.tensor([3]))  # takes the freed row of id 1
    before = table.export(torch.tensor([2, 3]))[1].clone()
    out.sum().backward()  # id 1's gradient: id 1 is gone
    assert table.coalesced_grad() is None or table.coalesced_grad()[0].numel() == 0
    opt.step()
    assert torch.equal(table.export(torch.tensor([2, 3]))[1], before)


def test_a_backward_after_a_load_updates_the_looked_up_id_where_it_is_now() -> None:
    table = HashTable(DIM, name="t", seed=4)
    opt = SparseSGD(table, lr=1.0)
    table(torch.tensor([10, 20]))  # id 10 at row 0, id 20 at row 1
    out = table(torch.tensor([10]))
    other = HashTable(DIM, name="t", seed=5)
    other(torch.tensor([20, 10]))  # id 20 at row 0, id 10 at row 1
    table.load_state_dict(other.state_dict())
    before = table.export(torch.tensor([10, 20]))[1].clone()
    out.sum().backward()
    opt.step()
    after = table.export(torch.tensor([10, 20]))[1]
    assert torch.equal(after[0], before[0] - 1.0) and torch.equal(after[1], before[1])


def test_refilling_the_id_buffer_before_backward_is_fine() -> None:
    """A data loader may reuse its id tensor for the next batch before this one's backward."""
    table = HashTable(DIM, name="t", seed=4)
    buf = torch.arange(5)
    out = table(buf)
    buf.copy_(torch.arange(100, 105))
    out.sum().backward()
    rows, _ = table.coalesced_grad()
    assert rows.tolist() == table.lookup(torch.arange(5), insert=False).sort().values.tolist()


def test_an_empty_table_is_true_as_a_module_is() -> None:
    """`if self.table:` asks whether an optional module is there: an empty HashTable must not read
    as absent (with __len__ alone it would, and the lookups behind the check would never run)."""
    table = HashTable(DIM, name="t")
    assert len(table) == 0 and bool(table) is True
    table(torch.tensor([1]))
    assert len(table) == 1 and bool(table) is True


@pytest.mark.parametrize("make", [lambda t: SparseSGD(t, lr=0.1), lambda t: SparseAdagrad(t, lr=0.1),
                                  lambda t: SparseAdam(t, lr=0.1)], ids=["sgd", "adagrad", "adam"])
def test_a_one_element_lr_of_any_shape_steps_as_its_number(make):
    """torch.optim takes a one-element tensor lr, and state_dict() saves one as its number, but
    step() raised TypeError (index_add_'s alpha, mul_) for an lr of shape [1] (tensor or numpy)."""
    ids = torch.tensor([1, 2, 2])
    results = []
    f64 = torch.float64  # exact 0.1, as the float
    for lr in (0.1, torch.tensor([0.1], dtype=f64), np.array([0.1]), torch.tensor(0.1, dtype=f64)):
        table = HashTable(3, name="t", seed=1)
        opt = make(table)
        opt.hparams["lr"] = lr
        for _ in range(2):
            opt.zero_grad()
            table(ids).pow(2).sum().backward()
            opt.step()
        assert opt.state_dict()["hparams"]["lr"] == pytest.approx(0.1)
        results.append(table.weight[table.lookup(ids, insert=False)].clone())
    for got in results[1:]:
        torch.testing.assert_close(got, results[0], atol=0, rtol=0)
