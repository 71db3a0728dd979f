"""CheckpointSource.read_table(part=(a, b)): a table read in row blocks (how a CUDA table's restore
bounds its pinned buffers) gives exactly the rows of a whole read, for any world size, in full
checkpoints and delta chains."""
from __future__ import annotations

import torch

from recsave import HashTable, Saver, knobs
from recsave.load.sources import open_source, sub_ranges
from recsave.tables.optim import SparseAdagrad


def _model(rows: int) -> torch.nn.Module:
    m = torch.nn.Module()
    m.t = HashTable(8, name="t", seed=3)
    SparseAdagrad(m, lr=0.1)
    ids = torch.randperm(rows * 3)[:rows] * 7919 - 10**6
    m.t.load_rows(ids, torch.randn(rows, 8), {"adagrad_acc": torch.rand(rows, 8)})
    return m


def _check_blocks(src, world: int) -> None:
    cols = ["embedding", "adagrad_acc", "last_step"]
    for rank in range(world):
        ids, whole = src.read_table("t", cols, rank, world, 2)
        n = ids.numel()
        assert n > 0
        for step in (97, 333, n):
            got_ids, got = [], {c: [] for c in cols}
            for a in range(0, n, step):
                b = min(n, a + step)
                out = {"embedding": torch.empty(b - a, 8)}  # read into a given buffer, as the restore does
                i, d = src.read_table("t", cols, rank, world, 2, out=out, part=(a, b))
                assert d["embedding"].data_ptr() == out["embedding"].data_ptr() or src.kind == "chain"
                got_ids.append(i)
                for c in cols:
                    got[c].append(d[c])
            assert torch.equal(torch.cat(got_ids), ids)
            for c in cols:
                assert torch.equal(torch.cat(got[c]), whole[c]), (rank, world, step, c)


def test_sub_ranges_picks_rows_of_the_concatenation():
    ranges = [(10, 20), (50, 55), (100, 130)]
    assert sub_ranges(ranges, 0, 45) == ranges
    assert sub_ranges(ranges, 5, 12) == [(15, 20), (50, 52)]
    assert sub_ranges(ranges, 15, 16) == [(100, 101)]
    assert sub_ranges(ranges, 44, 99) == [(129, 130)]
    assert sub_ranges(ranges, 3, 3) == []


def test_table_read_in_blocks_equals_the_whole_read(tmp_path):
    m = _model(5000)
    with knobs.override(segment_bytes=4096):  # many checksum segments: blocks cut through them
        Saver(m, output_dir=str(tmp_path)).save("ckpt_1")
    src = open_source(str(tmp_path))
    for world in (1, 2, 3):
        _check_blocks(src, world)


def test_delta_chain_read_in_blocks_equals_the_whole_read(tmp_path):
    m = _model(3000)
    saver = Saver(m, output_dir=str(tmp_path))
    saver.save("ckpt_1")
    ids = m.t.ids()
    m.t.load_rows(ids[:100], torch.randn(100, 8), clear=False)
    m.t.delete(ids[200:250])
    saver.save("ckpt_2", incremental=True)
    src = open_source(str(tmp_path))
    assert src.kind == "chain"
    _check_blocks(src, 1)
    _check_blocks(src, 2)
