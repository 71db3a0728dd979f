"""Review findings: HashTable and the sparse optimizers as torch modules (values, autograd)."""
from __future__ import annotations

import copy

import torch

from recsave.tables.hashtable import HashTable


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
