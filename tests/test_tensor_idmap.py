"""recsave.tables.idmap.TensorIdMap (the torch-ops map CUDA tables use) against the dict reference and the
C++ map, run here on the CPU; and HashTable training with either map giving identical tables."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_idmap import EXTREMES, Oracle

from recsave import HashTable, knobs
from recsave.errors import UsageError
from recsave.tables.idmap import CpuIdMap, TensorIdMap, make_id_map
from recsave.tables.optim import SparseAdagrad


def _check_export(m, oracle):
    ids, rows = m.export()
    want_ids, want_rows = oracle.export()
    assert ids.tolist() == want_ids.tolist() and rows.tolist() == want_rows.tolist()
    assert len(m) == len(oracle.map) and m.row_capacity == oracle.row_capacity


@pytest.mark.parametrize("seed", [0, 1])
def test_random_rounds_against_dict(seed):
    rng = np.random.default_rng(seed)
    m, oracle = TensorIdMap("cpu", capacity=4), Oracle()
    for rnd in range(80):
        pool = 3000 if (rnd // 20) % 2 == 0 else 1 << 62  # churn, then growth
        n = 20_000 if rnd % 25 == 24 else int(rng.integers(0, 2000))
        ids = rng.integers(-pool, pool, size=n, dtype=np.int64)
        extremes = rng.random(n) < 0.02
        ids[extremes] = rng.choice(np.array(EXTREMES, dtype=np.int64), size=int(extremes.sum()))

        rows, is_new, num_new = m.lookup_or_insert(torch.from_numpy(ids))
        want_rows, want_new, want_num = oracle.lookup_or_insert(ids)
        assert rows.tolist() == want_rows.tolist()
        assert is_new.tolist() == want_new.tolist() and num_new == want_num

        er = np.concatenate([rng.choice(ids, size=min(n, int(rng.integers(0, 700)))) if n else
                             np.empty(0, np.int64), rng.integers(-pool, pool, size=50, dtype=np.int64)])
        assert m.erase(torch.from_numpy(er)).tolist() == oracle.erase(er).tolist()
        probe = np.concatenate([ids, er])
        assert m.lookup(torch.from_numpy(probe)).tolist() == oracle.lookup(probe).tolist()
        if rnd % 10 == 0:
            _check_export(m, oracle)
        if rnd == 60:
            m.clear()
            oracle.__init__()
    _check_export(m, oracle)


def test_deleted_slots_are_reused_and_the_table_stays_bounded():
    m = TensorIdMap("cpu", capacity=64)
    for k in range(200):  # insert and erase 50 ids per round: deleted markers must not pile up
        ids = torch.arange(k * 50, k * 50 + 50)
        rows, _, num_new = m.lookup_or_insert(ids)
        assert num_new == 50 and sorted(rows.tolist()) == list(range(50))
        assert m.erase(ids).tolist() == rows.tolist()
    assert len(m) == 0 and m.row_capacity == 50
    assert m.slot_capacity <= 512


def test_matches_the_cpp_map_on_one_sequence():
    rng = np.random.default_rng(3)
    a, b = CpuIdMap(), TensorIdMap("cpu")
    for _ in range(30):
        ids = torch.from_numpy(rng.integers(-5000, 5000, size=3000, dtype=np.int64))
        for x, y in zip(a.lookup_or_insert(ids), b.lookup_or_insert(ids)):
            assert (x == y).all() if isinstance(x, torch.Tensor) else x == y
        gone = ids[:500]
        assert torch.equal(a.erase(gone), b.erase(gone))
    for x, y in zip(a.export(), b.export()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("make", [CpuIdMap, lambda: TensorIdMap("cpu")], ids=["cpp", "tensor"])
def test_load_distinct_restores_rows_in_order_or_refuses_repeats(make):
    rng = np.random.default_rng(4)
    ids = torch.from_numpy(rng.permutation(np.arange(-150_000, 150_000, dtype=np.int64) * 7919))
    m = make()
    with knobs.override(concurrency=4):  # 300k ids: the C++ map inserts on several threads
        assert m.load_distinct(ids) is True
    assert torch.equal(m.lookup(ids), torch.arange(ids.numel()))
    assert len(m) == m.row_capacity == ids.numel()
    new = torch.tensor([123456789], dtype=torch.int64)
    assert m.lookup_or_insert(new)[0].tolist() == [ids.numel()]
    with pytest.raises(UsageError, match="empty"):
        m.load_distinct(ids[:3])

    repeated = ids.clone()
    repeated[-1] = repeated[10]
    r = make()
    with knobs.override(concurrency=4):
        assert r.load_distinct(repeated) is False
    assert len(r) == 0 and r.row_capacity == 0
    assert (r.lookup(ids[:100]) == -1).all()
    assert r.load_distinct(ids[:1000]) is True and r.lookup(ids[:3]).tolist() == [0, 1, 2]


def test_make_id_map_choices():
    assert isinstance(make_id_map(torch.device("cpu")), CpuIdMap)
    assert isinstance(make_id_map(torch.device("cpu"), "tensor"), TensorIdMap)
    with pytest.raises(UsageError, match="id_map must be"):
        make_id_map(torch.device("cpu"), "gpu")
    with pytest.raises(UsageError, match="int64"):
        TensorIdMap().lookup(torch.zeros(3, dtype=torch.int32))


def _train(id_map: str) -> HashTable:
    torch.manual_seed(0)
    table = HashTable(8, name="t", id_map=id_map, seed=5)
    opt = SparseAdagrad([table], lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(20):
        ids = torch.randint(-300, 300, (64, 3), generator=gen)
        table(ids).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        if step % 7 == 6:
            table.delete(torch.arange(-50, 0))
    return table


def test_hashtable_trains_identically_with_either_map():
    a, b = _train("cpu"), _train("tensor")
    ids_a, va, sa = a.export()
    ids_b, vb, sb = b.export()
    assert torch.equal(ids_a, ids_b) and torch.equal(va, vb)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a.id_rows()[1], b.id_rows()[1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine test_cuda.py checks the kernels")
def test_cuda_kernels_are_optional_without_a_gpu():
    from recsave.tables import cudakernels

    assert not cudakernels.available()
    assert cudakernels.unavailable_reason() == "torch sees no CUDA device"
    with knobs.override(cuda_kernels=False):
        assert cudakernels.unavailable_reason() == "the knob cuda_kernels is off"
    m = TensorIdMap("cpu")  # the torch-ops loops, as ever
    assert m.lookup_or_insert(torch.tensor([5, 7, 5]))[0].tolist() == [0, 1, 0]


def test_memory_bytes_counts_what_a_table_holds():
    for kind in ("cpu", "tensor"):
        t = HashTable(8, name="m", id_map=kind)
        SparseAdagrad(t, lr=0.1)
        t.load_rows(torch.arange(3000) * 11, torch.randn(3000, 8))
        mem = t.memory_bytes()
        cap = t._store.capacity
        assert mem["embedding"] == cap * 8 * 4 and mem["slots"] == cap * 8 * 4
        assert mem["row_ids"] == cap * 8 and mem["meta"] == cap * 16
        per_slot = 16 if kind == "cpu" else 24
        slots = t._map.slot_capacity
        assert slots >= 2 * 3000 * 0.5 and mem["id_map"] >= per_slot * slots
        assert mem["id_map"] <= per_slot * slots + 3000


def test_cuda_kernel_probe_outcomes_are_cached_only_when_final(monkeypatch, caplog):
    """The per-GPU probe's bookkeeping (the probe itself runs in test_cuda.py on a GPU): a kernel
    failure is remembered and warned about once; a failure to allocate the probe is not."""
    from recsave.tables import cudakernels

    answers = iter([("no memory for the probe", False), ("does not run", True)])
    calls = []

    def probe(index):
        calls.append(index)
        return next(answers)

    monkeypatch.setattr(cudakernels.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cudakernels, "_load", lambda: object())
    monkeypatch.setattr(cudakernels, "_probe", probe)
    monkeypatch.setattr(cudakernels, "_device_why_not", {})
    gpu = torch.device("cuda", 3)
    with caplog.at_level("WARNING", logger="recsave"):
        assert cudakernels.unavailable_reason(gpu) == "no memory for the probe"  # not final: asked again
        assert cudakernels.unavailable_reason(gpu) == "does not run"
        assert cudakernels.unavailable_reason(gpu) == "does not run" and not cudakernels.available(gpu)
    assert calls == [3, 3]
    assert [r.getMessage() for r in caplog.records].count("recsave: does not run; CUDA tables there use torch ops") == 1
