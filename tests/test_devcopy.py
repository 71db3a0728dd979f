"""The host buffers of CUDA saves and restores (tables/devcopy.py): sized so that they never grow
block by block (each growth would leave the old buffer resident in torch's pinned-memory cache).
Runs on the CPU too, where page-locked memory falls back to pageable buffers."""
from __future__ import annotations

from recsave import knobs
from recsave.tables.devcopy import PinnedPair, buffer_size


def test_large_requests_get_a_whole_block_small_ones_their_size():
    block = 1 << 20
    assert buffer_size(1000, block) == 1000
    assert buffer_size(1 << 18, block) == 1 << 18  # a quarter block: exact
    assert buffer_size((1 << 18) + 1, block) == 1 << 20
    assert buffer_size(1 << 20, block) == 1 << 20
    assert buffer_size(3 << 20, block) == 3 << 20  # one segment larger than a block


def test_pinned_pair_keeps_its_buffers_across_blocks_of_varying_size():
    with knobs.override(write_block_bytes=1 << 20):
        pair = PinnedPair()
        first = [pair.take(700_000), pair.take(800_000)]
        ptrs = [b.data_ptr() for b in first]
        for nbytes in (900_000, 1 << 20, 300_000, 1_000_000):  # blocks of a save, all <= one block
            for k in range(2):
                buf = pair.take(nbytes)
                assert buf.numel() == nbytes and buf.data_ptr() == ptrs[k]


def test_knob_overrides_reach_the_gather_and_fill_threads(tmp_path):
    """Overrides are per thread: the writer's gather thread and a restore's fill thread must see
    the caller's (a CUDA save sizes its pinned buffers there, a CUDA restore its blocks)."""
    import torch

    import recsave.format as fmt
    from recsave import HashTable
    from recsave.format.writer import RowSource

    seen = []
    t = torch.arange(600, dtype=torch.float32).reshape(100, 6)

    def fetch(a, b):
        seen.append(knobs.get("write_block_bytes"))
        return t[a:b].clone()

    (tmp_path / "w").mkdir()
    with knobs.override(write_block_bytes=24 * 10):
        fmt.write_shards(str(tmp_path / "w"), {"x": RowSource(torch.float32, (100, 6), fetch)},
                         segments={"x": list(range(240, 2401, 240))})
    assert seen and set(seen) == {240}

    table = HashTable(4, name="f")
    filled = []
    with knobs.override(write_block_bytes=12345):
        table.prepare_load(torch.arange(10), ["embedding"],
                           lambda views: filled.append(knobs.get("write_block_bytes")))
    assert filled == [12345]
