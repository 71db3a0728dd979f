"""CUDA tables: ids, rows, slots and the id map on the GPU; saves gather on the device through
pinned double buffers; async_pinned stages into page-locked memory. Skipped without CUDA (the
id map's logic is covered on the CPU by test_tensor_idmap.py)."""
from __future__ import annotations

import os
import re

import pytest
import torch

from recsave import HashTable, Saver
from recsave.tables.idmap import TensorIdMap
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


def _files(ckpt_dir: str) -> dict:
    files = {n: open(os.path.join(ckpt_dir, n), "rb").read() for n in sorted(os.listdir(ckpt_dir))}
    files["index"] = re.sub(rb'"created_at":"[^"]*"', b'"created_at":""', files["index"])
    return files


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
        torch.testing.assert_close(vb, va, rtol=1e-5, atol=1e-6)  # float summation order may differ
        torch.testing.assert_close(sb["adagrad_acc"], sa["adagrad_acc"], rtol=1e-5, atol=1e-6)


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
    assert _files(sync_dir) == _files(write.result(timeout=120))
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
