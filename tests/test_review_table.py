"""Review findings: HashTable and the sparse optimizers as torch modules (values, autograd)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from recsave.tables.hashtable import HashTable
from recsave.tables.optim import SparseAdagrad, SparseAdam, SparseSGD


def test_rows_loaded_from_a_tensor_that_requires_grad_stay_out_of_autograd():
    """Warm-starting a float32 table from a float64 nn.Embedding's weight (a tensor that requires
    grad, in another dtype) made the table's storage a node of that graph: a frozen table's
    lookups sent gradients into the embedding, the table no longer deep-copied, and the next
    training lookup of a new id raised."""
    source = torch.nn.Embedding(4, 3).double()
    table = HashTable(3, name="t")
    table.add_slot("s")
    table.load_rows(torch.arange(4), source.weight)
    table.set_slot_rows(torch.arange(4), {"s": source.weight})
    assert not table.weight.requires_grad
    assert not table.slot("s").requires_grad
    torch.testing.assert_close(table.weight[table.lookup(torch.arange(4), insert=False)],
                               source.weight.detach().float(), atol=0, rtol=0)

    table.requires_grad_(False)
    out = table(torch.tensor([0, 1]))
    assert not out.requires_grad
    table.requires_grad_(True)

    table(torch.arange(10, 14)).sum().backward()  # inserts new ids
    assert source.weight.grad is None
    copied = copy.deepcopy(table)
    assert torch.equal(copied.export()[1], table.export()[1])


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
