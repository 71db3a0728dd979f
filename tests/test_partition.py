"""recsave.tables.partition and sharded HashTables (single process)."""

import pytest
import torch

import recsave
from recsave import HashTable, Saver, partition
from recsave.errors import UsageError
from recsave.tables import partition as table_partition

MASK = (1 << 64) - 1


def reference_mix64(x: int) -> int:
    z = x & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


IDS = torch.tensor([0, 1, -1, 2**63 - 1, -2**63, 123456789, -987654321], dtype=torch.int64)


def test_mix64_and_bucket_of_match_the_documented_formula():
    got = partition.mix64(IDS).tolist()
    assert [g & MASK for g in got] == [reference_mix64(i) for i in IDS.tolist()]
    assert partition.bucket_of(IDS, 4096).tolist() == [reference_mix64(i) % 4096 for i in IDS.tolist()]
    assert partition.bucket_of(IDS.view(7, 1), 10).shape == (7, 1)


def test_bucket_ranges_tile_the_buckets_and_owner_of_agrees():
    for world in (1, 2, 3, 4, 7):
        ranges = [partition.bucket_range(r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == 4096
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        ids = torch.arange(-5000, 5000)
        owners = partition.owner_of(ids, world)
        buckets = partition.bucket_of(ids)
        for r, (lo, hi) in enumerate(ranges):
            mine = owners == r
            assert bool(((buckets[mine] >= lo) & (buckets[mine] < hi)).all())
    with pytest.raises(UsageError):
        partition.bucket_range(3, 3)
    with pytest.raises(UsageError):
        partition.owner_of(torch.tensor([1.0]), 2)


def test_route_groups_ids_by_owner():
    ids = torch.arange(100) * 31 - 7
    order, counts = partition.route(ids, 3)
    owners = partition.owner_of(ids[order], 3)
    assert counts == [int((owners == r).sum()) for r in range(3)]
    assert owners.tolist() == sorted(owners.tolist())
    assert torch.equal(ids[order][order.argsort()], ids)


def test_sharded_table_refuses_foreign_ids():
    t = HashTable(4, name="t")
    t.set_partition(1, 3)
    ids = torch.arange(200)
    mine = ids[partition.owner_of(ids, 3) == 1]
    t(mine)  # owned ids insert fine
    assert len(t) == mine.numel()
    foreign = ids[partition.owner_of(ids, 3) == 2][:1]
    with pytest.raises(UsageError, match="belongs to rank 2"):
        t(foreign)
    assert len(t) == mine.numel()


class ShardedReader:
    """An io state that knows how to reshard: positions are split evenly."""

    def __init__(self):
        self.position = 0
        self.seen = None

    def dump_io_state(self):
        return {"position": self.position}

    def load_io_state(self, state):
        self.position = state["position"]

    def load_io_states(self, states, rank, world_size):
        self.seen = (len(states), rank, world_size)
        self.position = sum(s["position"] for s in states) // world_size


def test_io_state_reshards_through_load_io_states(tmp_path, monkeypatch):
    model = torch.nn.Module()
    model.t = HashTable(4, name="t")
    model.t(torch.arange(10))
    saver = Saver(model, output_dir=str(tmp_path))
    reader = ShardedReader()
    reader.position = 90
    saver.register_io_state("reader", reader)
    saver.save("ckpt_1")

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    fresh = torch.nn.Module()
    fresh.t = HashTable(4, name="t")
    saver2 = Saver(fresh, output_dir=str(tmp_path))
    reader2 = ShardedReader()
    saver2.register_io_state("reader", reader2)
    saver2.load()
    assert reader2.seen == (1, 1, 3) and reader2.position == 30
    # The table got rank 1's share of the ids, and is now a shard.
    owned = [i for i in range(10) if partition.owner_of(torch.tensor([i]), 3).item() == 1]
    assert sorted(fresh.t.ids().tolist()) == owned
    assert fresh.t.partition == (1, 3, 4096)


@pytest.mark.parametrize("num_keys", [1, 4096, 1 << 15, 70_000])
def test_stable_order_matches_a_stable_argsort(num_keys):
    keys = torch.randint(0, num_keys, (50_000,), generator=torch.Generator().manual_seed(num_keys))
    assert torch.equal(partition.stable_order(keys, num_keys), torch.argsort(keys, stable=True))


@pytest.mark.parametrize("num_buckets,first,stop", [(4096, 0, 4096), (4096, 1024, 2048), (1000, 0, 1000),
                                                     (1000, 333, 666), (1, 0, 1)])
@pytest.mark.parametrize("threads", [1, 4])
def test_owned_bucket_order_is_the_stable_order_of_the_owned_buckets(num_buckets, first, stop, threads):
    """400k ids: several slices of the engine's parallel passes; equal buckets keep id order across
    slice boundaries; a power-of-two and another bucket count; one rank's range of several."""
    g = torch.Generator().manual_seed(num_buckets + first)
    ids = torch.randint(-2**62, 2**62, (400_000,), generator=g)
    owner_buckets = partition.bucket_of(ids, num_buckets)
    ids = ids[(owner_buckets >= first) & (owner_buckets < stop)]
    keys = partition.bucket_of(ids, num_buckets) - first
    with recsave.knobs.override(concurrency=threads):
        order, counts, in_order = table_partition.owned_bucket_order(ids, num_buckets, first, stop)
    assert torch.equal(order, torch.argsort(keys, stable=True))
    assert torch.equal(counts, torch.bincount(keys, minlength=stop - first))
    assert torch.equal(in_order, ids[order])


def test_owned_bucket_order_finds_an_id_of_another_rank_and_takes_no_ids():
    ids = torch.arange(200_000, dtype=torch.int64)
    buckets = partition.bucket_of(ids, 4096)
    for first, stop in ((0, 2048), (2048, 4096)):
        mine = ids[(buckets >= first) & (buckets < stop)]
        assert table_partition.owned_bucket_order(mine, 4096, first, stop) is not None
        foreign = ids[(buckets < first) | (buckets >= stop)][-1:]
        for at in (0, mine.numel() // 2, mine.numel()):  # first slice, a middle one, the last
            mixed = torch.cat([mine[:at], foreign, mine[at:]])
            assert table_partition.owned_bucket_order(mixed, 4096, first, stop) is None
    order, counts, in_order = table_partition.owned_bucket_order(torch.empty(0, dtype=torch.int64), 4096, 0, 4096)
    assert order.numel() == 0 and in_order.numel() == 0 and counts.shape == (4096,) and int(counts.sum()) == 0
    for first, stop in ((0, 0), (5, 4097), (-1, 3)):
        with pytest.raises(UsageError, match="is not a range of 4096 buckets"):
            table_partition.owned_bucket_order(ids, 4096, first, stop)


def test_bucket_order_counts_and_refuses_keys_out_of_range():
    from recsave.tables.partition import bucket_order

    keys = torch.tensor([3, 0, 3, 1, 0, 3])
    order, counts = bucket_order(keys, 5)
    assert order.tolist() == [1, 4, 3, 0, 2, 5]  # equal keys keep their order
    assert counts.tolist() == [2, 1, 0, 3, 0]
    order, counts = bucket_order(torch.empty(0, dtype=torch.int64), 3)
    assert order.numel() == 0 and counts.tolist() == [0, 0, 0]
    for bad in ([0, 5], [-1, 2]):
        with pytest.raises(UsageError, match=r"outside \[0, num_keys\)"):
            bucket_order(torch.tensor(bad), 5)
    with pytest.raises(UsageError, match="num_keys must be >= 1"):
        bucket_order(keys, 0)


def test_a_delta_tombstone_of_another_ranks_id_is_refused_by_owner():
    """Rank 1 of 2 removed ids of rank 0's buckets (it looked them up unrouted, then deleted
    them): its delta is refused naming the routing fix, as its live rows would be, not with the
    counting sort's internal "a key lies outside" message."""
    from recsave.save.layout import bucket_layout
    from recsave.save.snapshot import TableState

    ids = torch.arange(2000, dtype=torch.int64)
    owner = partition.owner_of(ids, 2)
    mine, theirs = ids[owner == 1][:10], ids[owner == 0][:3]
    table = TableState(4, torch.float32, {"embedding": torch.zeros(10, 4)}, ids=mine, tombstones=theirs)
    with pytest.raises(UsageError, match=r"table 'user' removed ids owned by other ranks.*owner_of"):
        bucket_layout("user", table, 1, 2, partition.DEFAULT_NUM_BUCKETS)
    ok = TableState(4, torch.float32, {"embedding": torch.zeros(10, 4)}, ids=mine, tombstones=ids[owner == 1][10:12])
    assert bucket_layout("user", ok, 1, 2, partition.DEFAULT_NUM_BUCKETS).tombstones == 2
