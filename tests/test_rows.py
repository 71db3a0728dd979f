"""recsave/tables/rows.py: put_rows, the indexed assignment every load and training write goes
through (the engine's scatter for whole rows, numpy or torch otherwise)."""
import copy

import pytest
import torch

from recsave.errors import UsageError
from recsave.tables.hashtable import HashTable
from recsave.tables.rows import put_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("shape", [(3,), (4, 2), ()])
def test_put_rows_equals_an_indexed_assignment(dtype, shape):
    """Runs, singles, both ends and a row given twice (its last value wins, as with dst[rows] = v)."""
    gen = torch.Generator().manual_seed(0)
    dst = torch.randn((5000,) + shape, generator=gen).to(dtype)
    rows = torch.tensor([0, 1, 2, 7, 4096, 4097, 4999, 7, 3])
    values = torch.randn((rows.numel(),) + shape, generator=gen).to(dtype)
    expect = dst.clone()
    for i, r in enumerate(rows.tolist()):  # in order: the repeated row 7 ends with values[7]
        expect[r] = values[i]
    put_rows(dst, rows, values)
    assert torch.equal(dst, expect)


def test_put_rows_broadcasts_and_converts_as_before():
    dst = torch.zeros(10, 4)
    put_rows(dst, torch.tensor([1, 3]), 2.5)  # a scalar
    put_rows(dst, torch.tensor([5]), torch.ones(4, dtype=torch.float64))  # another dtype, broadcast
    expect = torch.zeros(10, 4)
    expect[[1, 3]] = 2.5
    expect[5] = 1.0
    assert torch.equal(dst, expect)
    flags = torch.zeros(6, dtype=torch.bool)
    put_rows(flags, torch.tensor([0, 4]), True)
    assert flags.tolist() == [True, False, False, False, True, False]


@pytest.mark.parametrize("bad", [[3, 10], [-1]])
def test_put_rows_refuses_a_row_outside_and_writes_nothing(bad):
    dst = torch.zeros(10, 4)
    with pytest.raises(UsageError, match="outside"):
        put_rows(dst, torch.tensor([0] + bad), torch.ones(len(bad) + 1, 4))
    assert torch.equal(dst, torch.zeros(10, 4))


def test_put_rows_of_values_read_from_the_same_tensor():
    """Values that are rows of dst itself are taken as they were before the assignment."""
    dst = torch.arange(12, dtype=torch.float32).view(6, 2)
    expect = dst.clone()
    expect[[1, 3]] = expect[0:2].clone()
    put_rows(dst, torch.tensor([1, 3]), dst[0:2])
    assert torch.equal(dst, expect)


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
