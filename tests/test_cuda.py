"""CUDA tables: ids, rows, slots and the id map on the GPU; saves gather on the device through
pinned double buffers; async_pinned stages into page-locked memory. Skipped without CUDA (the
id map's logic is covered on the CPU by test_tensor_idmap.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_states_equal, checkpoint_bytes, row_meta_state, table_state, tables_of

from recsave import HashTable, Saver, knobs
from recsave.tables import cudakernels
from recsave.tables.idmap import CpuIdMap, TensorIdMap
from recsave.tables.optim import SparseAdagrad

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class Model(torch.nn.Module):
    def __init__(self, device: str):
        super().__init__()
        self.user = HashTable(16, name="user", device=device, seed=1)
        self.item = HashTable(8, name="item", device=device, seed=2)
        self.head = torch.nn.Linear(24, 1).to(device)

    def forward(self, u, i):
        return self.head(torch.cat([self.user(u), self.item(i)], -1)).squeeze(-1)


def _train(model: Model, opts, steps: int, device: str, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        u = torch.randint(-2000, 2000, (256,), generator=gen).to(device)
        i = torch.randint(0, 5000, (256,), generator=gen).to(device)
        model(u, i).pow(2).mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


def _job(device: str, out: str):
    torch.manual_seed(0)
    model = Model(device)
    sparse = SparseAdagrad(model, lr=0.05)
    dense = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    saver = Saver(model, sparse, output_dir=out, max_keep=None)
    saver.register_for_checkpointing("dense_opt", dense)
    return model, [sparse, dense], saver


def test_cuda_tables_keep_everything_on_the_device(tmp_path):
    model, opts, _ = _job("cuda", str(tmp_path))
    _train(model, opts, 3, "cuda")
    assert isinstance(model.user._map, TensorIdMap) and model.user._map.device.type == "cuda"
    assert model.user.weight.is_cuda and model.user.slot("adagrad_acc").is_cuda
    assert model.user.lookup(torch.arange(5, device="cuda"), insert=False).is_cuda


def test_cuda_training_matches_the_cpu_table(tmp_path):
    cpu_model, cpu_opts, _ = _job("cpu", str(tmp_path / "c"))
    gpu_model, gpu_opts, _ = _job("cuda", str(tmp_path / "g"))
    _train(cpu_model, cpu_opts, 5, "cpu")
    _train(gpu_model, gpu_opts, 5, "cuda")
    for name in ("user", "item"):
        a, b = getattr(cpu_model, name), getattr(gpu_model, name)
        ids_a, rows_a = a.id_rows()
        ids_b, rows_b = b.id_rows()
        assert torch.equal(ids_a, ids_b) and torch.equal(rows_a, rows_b)  # same rows for same ids
        _, va, sa = a.export(ids_a)
        _, vb, sb = b.export(ids_a)
        # Same ids, same rows; the values agree to float32 rounding only: the GPU sums gradients
        # in another order, and Adam on the head turns tiny gradient differences into update
        # differences of up to ~1e-5 after 5 steps (seen on an H200). A wrong or missing update
        # is lr-sized (0.05), far outside these bounds.
        torch.testing.assert_close(vb, va, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(sb["adagrad_acc"], sa["adagrad_acc"], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("pinned", [False, True])
def test_cuda_save_load_round_trip_and_async_matches_sync(tmp_path, pinned):
    model, opts, saver = _job("cuda", str(tmp_path / "sync"))
    _train(model, opts, 4, "cuda")
    sync_dir = saver.save("ckpt_4")
    saver2 = Saver(model, opts[0], output_dir=str(tmp_path / "async"))
    saver2.register_for_checkpointing("dense_opt", opts[1])
    _, write = saver2.async_save("ckpt_4", pinned=pinned)
    if pinned:
        assert all(b.is_pinned() for b in saver2._stager._buffers.values())
    _train(model, opts, 2, "cuda")  # changes after the snapshot stay out of it
    assert checkpoint_bytes(sync_dir) == checkpoint_bytes(write.result(timeout=120))
    saver2.close()

    fresh, fresh_opts, fresh_saver = _job("cuda", str(tmp_path / "sync"))
    fresh_saver.load()
    original, _, original_saver = _job("cuda", str(tmp_path / "unused"))
    original_saver.load(str(tmp_path / "async"))
    for name in ("user", "item"):
        ids = getattr(fresh, name).ids()
        _, va, sa = getattr(fresh, name).export(ids)
        _, vb, sb = getattr(original, name).export(ids)
        assert torch.equal(va, vb) and torch.equal(sa["adagrad_acc"], sb["adagrad_acc"])
        assert getattr(fresh, name).weight.is_cuda


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_async_pinned_save_of_tables_on_another_device_than_the_current_one(tmp_path):
    """Tables on cuda:1 with cuda:0 current: the pinned staging must wait for cuda:1's copies
    (torch.cuda.synchronize() alone waits for the current device only)."""
    assert torch.cuda.current_device() == 0
    model, opts, saver = _job("cuda:1", str(tmp_path / "sync"))
    _train(model, opts, 4, "cuda:1")
    sync_dir = saver.save("ckpt_4")
    saver2 = Saver(model, opts[0], output_dir=str(tmp_path / "async"))
    saver2.register_for_checkpointing("dense_opt", opts[1])
    _, write = saver2.async_save("ckpt_4", pinned=True)  # fresh buffers: a missed wait writes garbage
    _train(model, opts, 2, "cuda:1")
    assert checkpoint_bytes(sync_dir) == checkpoint_bytes(write.result(timeout=120))
    saver2.close()


def test_large_cuda_table_is_gathered_in_blocks(tmp_path):
    from recsave import knobs
    table = HashTable(32, name="t", device="cuda")
    m = torch.nn.Module()
    m.t = table
    ids = torch.arange(200_000, device="cuda") * 7919
    table.load_rows(ids, torch.randn(ids.numel(), 32, device="cuda"))
    with knobs.override(write_block_bytes=1 << 20):  # ~25 blocks through the two pinned buffers
        Saver(m, output_dir=str(tmp_path)).save("ckpt_1")
    back = torch.nn.Module()
    back.t = HashTable(32, name="t", device="cuda")
    Saver(back, output_dir=str(tmp_path)).load()
    assert torch.equal(back.t.export(ids.cpu())[1], table.export(ids.cpu())[1])


# ------------------------------------------------------------------------------------------------
# The rest of the CUDA paths: delta chains, tables moving between devices, the manager's
# async_pinned autosave, model-bank warm starts, PyTorch interop and eviction on the device.
# The helpers take the device so their logic can also be exercised on a CPU; the tests themselves
# always use "cuda".

def _tables_state(model: torch.nn.Module) -> dict:
    """Every table's ids, rows and slots by sorted id, its row metadata and its step (CPU)."""
    out = {name + k: v for name, t in tables_of(model).items() for k, v in table_state(t).items()}
    out.update(row_meta_state(model))
    return out


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert_states_equal(_tables_state(a), _tables_state(b), "tables")


def _delta_chain(device: str, out: str):
    """A full checkpoint and two deltas of a model on `device` (deletes and evictions between);
    returns the live model and the saver."""
    model, opts, saver = _job(device, out)
    _train(model, opts, 3, device, seed=1)
    saver.save("ckpt_3")
    assert saver.last_save.kind == "full"
    _train(model, opts, 2, device, seed=2)
    gone = model.user.ids()[:50]
    assert model.user.delete(gone.to(device)) == 50
    saver.save("ckpt_5", incremental=True)
    assert saver.last_save.kind == "delta"
    _train(model, opts, 2, device, seed=3)
    evicted = model.item.evict(min_count=2)
    assert evicted > 0
    saver.save("ckpt_7", incremental=True)
    assert saver.last_save.kind == "delta"
    return model, saver


def _check_delta_chain(device: str, tmp) -> None:
    model, _ = _delta_chain(device, str(tmp / "chain"))
    for target in (device, "cpu"):  # restored on the same device and moved to the CPU
        fresh, _, fresh_saver = _job(target, str(tmp / "chain"))
        fresh_saver.load()
        _assert_same(model, fresh)


def _check_tables_move_between_devices(device: str, tmp) -> None:
    for k, (src, dst) in enumerate((("cpu", device), (device, "cpu"))):
        model, opts, saver = _job(src, str(tmp / f"{k}"))
        _train(model, opts, 3, src)
        saver.save("ckpt_3")
        other, _, other_saver = _job(dst, str(tmp / f"{k}"))
        other_saver.load()
        _assert_same(model, other)
        assert other.user.weight.device.type == torch.device(dst).type
        torch.testing.assert_close(other.head.weight.cpu(), model.head.weight.cpu(), rtol=0, atol=0)


def _check_manager_async_pinned(device: str, tmp) -> None:
    from recsave import CheckpointManager

    model, opts, saver = _job(device, str(tmp / "mgr"))
    saver.max_keep = 10
    # rebase_ratio: these small tables change almost wholly between saves; keep the chain anyway
    mgr = CheckpointManager(saver, save_interval=2, async_mode="async_pinned", full_every=3,
                            rebase_ratio=100.0, save_on_preemption=False)
    kinds = []
    for k in range(7):
        _train(model, opts, 1, device, seed=10 + k)
        if mgr.step() is not None:
            mgr.wait()
            kinds.append(mgr.last_save.kind)
    mgr.save()
    kinds.append(mgr.last_save.kind)
    mgr.close()
    assert kinds == ["full", "delta", "delta", "full"]  # ckpt_2, 4, 6, then 7 starts a new chain
    fresh, _, fresh_saver = _job(device, str(tmp / "mgr"))
    fresh_mgr = CheckpointManager(fresh_saver, save_interval=2, async_mode="async_pinned",
                                  save_on_preemption=False)
    assert fresh_mgr.restore() == 7
    _assert_same(model, fresh)
    assert fresh_mgr.restore(6) == 6  # the end of a delta chain (base ckpt_2)
    fresh_mgr.close()


def _check_model_bank_warm_start(device: str, tmp) -> None:
    src, src_opts, src_saver = _job("cpu", str(tmp / "bank"))
    _train(src, src_opts, 3, "cpu", seed=5)
    src_saver.save("ckpt_3")
    model, opts, saver = _job(device, str(tmp / "own"))
    _train(model, opts, 1, device, seed=6)
    head_before = model.head.weight.detach().cpu().clone()
    report = saver.load_model_bank([{"path": str(tmp / "bank"), "load": ["sparse", "sparse_opt"]}])
    assert {"user", "item"} <= set(report.loaded)
    _assert_same(src, model)
    assert torch.equal(model.head.weight.detach().cpu(), head_before)  # dense not selected
    _train(model, opts, 1, device, seed=7)  # training goes on from the warm start on the device
    assert model.user.weight.is_cuda == (torch.device(device).type == "cuda")


def _check_interop_and_evict(device: str, tmp) -> None:
    model, opts, _ = _job(device, str(tmp / "a"))
    _train(model, opts, 4, device, seed=8)
    other, _, _ = _job(device, str(tmp / "b"))
    other.load_state_dict(model.state_dict())
    _assert_same(model, other)
    before = len(model.item)
    # Evicting by count on the device and on a CPU copy of the same rows removes the same ids.
    ids, count = table_state(model.item)["@id"], row_meta_state(model)["item@count"]
    n_dev = model.item.evict(min_count=3)
    mask = count.reshape(-1) < 3
    assert n_dev == int(mask.sum()) and len(model.item) == before - n_dev
    assert torch.equal(torch.sort(model.item.ids()).values, ids[~mask])


def test_cuda_delta_chain_restores_bit_exact(tmp_path):
    _check_delta_chain("cuda", tmp_path)


def test_checkpoints_move_between_cpu_and_cuda_tables(tmp_path):
    _check_tables_move_between_devices("cuda", tmp_path)


def test_manager_async_pinned_autosaves_deltas_and_restores_on_cuda(tmp_path):
    _check_manager_async_pinned("cuda", tmp_path)


def test_model_bank_warm_starts_cuda_tables(tmp_path):
    _check_model_bank_warm_start("cuda", tmp_path)


def test_cuda_state_dict_round_trip_and_eviction(tmp_path):
    _check_interop_and_evict("cuda", tmp_path)


# ------------------------------------------------------------------------------------------------
# The id-map kernels of csrc/cuda/ against the torch-ops probe loops and the C++ map

def _require_kernels() -> None:
    """Skips where the kernels are not built; where they are, they must run on this GPU."""
    if not cudakernels.built():
        pytest.skip(f"CUDA kernels not built: {cudakernels.unavailable_reason()}")
    assert cudakernels.available(torch.device("cuda")), cudakernels.unavailable_reason(torch.device("cuda"))


def test_id_map_kernels_match_the_torch_ops_and_the_cpp_map():
    _require_kernels()
    rng = np.random.default_rng(0)
    fast, slow, mixed = (TensorIdMap("cuda", capacity=4) for _ in range(3))
    ref = CpuIdMap()

    def run(op: str, ids: torch.Tensor, rnd: int) -> list:
        with knobs.override(cuda_kernels=False):
            b = getattr(slow, op)(ids.cuda())
            c = getattr(mixed, op)(ids.cuda()) if rnd % 2 else None
        if c is None:  # the mixed map alternates between the kernels and the torch ops
            c = getattr(mixed, op)(ids.cuda())
        a = getattr(fast, op)(ids.cuda())
        return [a, b, c, getattr(ref, op)(ids)]

    def same(results: list) -> None:
        want = results[-1]
        for got in results[:-1]:
            if isinstance(want, tuple):
                assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
                assert got[2] == want[2]
            else:
                assert torch.equal(got.cpu(), want)

    for rnd in range(60):
        pool = 3000 if (rnd // 15) % 2 == 0 else 1 << 62  # churn, then growth
        n = 200_000 if rnd % 20 == 19 else int(rng.integers(0, 5000))
        ids = torch.from_numpy(rng.integers(-pool, pool, size=n, dtype=np.int64))
        same(run("lookup_or_insert", ids, rnd))
        gone = ids[torch.from_numpy(rng.integers(0, max(n, 1), size=min(n, 1500)))] if n else ids
        gone = torch.cat([gone, torch.from_numpy(rng.integers(-pool, pool, size=50, dtype=np.int64))])
        same(run("erase", gone, rnd))
        same(run("lookup", torch.cat([ids, gone]), rnd))
    for m in (fast, slow, mixed):
        ids, rows = m.export()
        want_ids, want_rows = ref.export()
        assert torch.equal(ids.cpu(), want_ids) and torch.equal(rows.cpu(), want_rows)
        assert len(m) == len(ref) and m.row_capacity == ref.row_capacity
    assert fast.slot_capacity == slow.slot_capacity  # the same growth: deleted slots counted alike


def test_cuda_tables_train_identically_with_and_without_the_kernels(tmp_path):
    _require_kernels()
    with_k, opts_k, _ = _job("cuda", str(tmp_path / "k"))
    _train(with_k, opts_k, 4, "cuda", seed=4)
    with knobs.override(cuda_kernels=False):
        without, opts_t, _ = _job("cuda", str(tmp_path / "t"))
        _train(without, opts_t, 4, "cuda", seed=4)
    for name in ("user", "item"):
        ia, ra = getattr(with_k, name).id_rows()
        ib, rb = getattr(without, name).id_rows()
        assert torch.equal(ia, ib) and torch.equal(ra, rb)
