"""recsave._C.IdMap (the CPU id -> row map behind HashTable) against a plain-dict reference."""
from __future__ import annotations

import heapq
import os
import threading

import numpy as np
import pytest
import torch

from recsave import _C
from recsave.errors import UsageError

I64_MIN = np.iinfo(np.int64).min
I64_MAX = np.iinfo(np.int64).max
EXTREMES = [0, -1, 1, I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1]


class Oracle:
    """The documented semantics written the obvious way: a dict plus a min-heap of freed rows."""

    def __init__(self):
        self.map: dict[int, int] = {}
        self.free: list[int] = []
        self.row_capacity = 0

    def lookup_or_insert(self, ids):
        rows, is_new = [], []
        for i in ids.tolist():
            if i in self.map:
                rows.append(self.map[i])
                is_new.append(False)
                continue
            if self.free:
                row = heapq.heappop(self.free)
            else:
                row = self.row_capacity
                self.row_capacity += 1
            self.map[i] = row
            rows.append(row)
            is_new.append(True)
        return np.array(rows, dtype=np.int64), np.array(is_new, dtype=bool), sum(is_new)

    def erase(self, ids):
        out = []
        for i in ids.tolist():
            row = self.map.pop(i, -1)
            if row >= 0:
                heapq.heappush(self.free, row)
            out.append(row)
        return np.array(out, dtype=np.int64)

    def lookup(self, ids):
        return np.array([self.map.get(i, -1) for i in ids.tolist()], dtype=np.int64)

    def export(self):
        pairs = sorted((r, i) for i, r in self.map.items())
        return (np.array([i for _, i in pairs], dtype=np.int64).reshape(-1),
                np.array([r for r, _ in pairs], dtype=np.int64).reshape(-1))


def snapshot(m):
    ids, rows = m.export()
    return ids.tolist(), rows.tolist(), len(m), m.row_capacity, m.free_rows


def assert_matches(m, oracle):
    ids, rows = m.export()
    want_ids, want_rows = oracle.export()
    assert ids.dtype == np.int64 and rows.dtype == np.int64
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(ids, want_ids)
    assert len(m) == m.size() == len(oracle.map)
    assert m.row_capacity == oracle.row_capacity
    assert m.free_rows == len(oracle.free) == m.row_capacity - len(m)


def test_extreme_ids_and_duplicates_in_a_batch():
    m = _C.IdMap()
    ids = np.array(EXTREMES + [0, -1, I64_MIN], dtype=np.int64)
    rows, is_new, num_new = m.lookup_or_insert(ids)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 3]
    assert is_new.dtype == np.bool_
    assert is_new.tolist() == [True] * 7 + [False] * 3
    assert num_new == 7 and len(m) == 7 and m.row_capacity == 7
    assert m.lookup(np.array([I64_MAX, I64_MIN, 2, -1, -2])).tolist() == [4, 3, -1, 1, -1]

    freed = m.erase(np.array([-1, 12345, -1, I64_MIN]))
    assert freed.tolist() == [1, -1, -1, 3]  # a repeated id is removed once
    assert len(m) == 5 and m.row_capacity == 7 and m.free_rows == 2
    assert m.lookup(np.array(EXTREMES)).tolist() == [0, -1, 2, -1, 4, 5, 6]


def test_free_list_reuses_lowest_row_first():
    m = _C.IdMap()
    m.lookup_or_insert(np.arange(100, 110))
    m.erase(np.array([107, 102, 105]))
    rows, is_new, num_new = m.lookup_or_insert(np.array([1, 2, 1, 3, 4, 105]))
    assert rows.tolist() == [2, 5, 2, 7, 10, 11]
    assert is_new.tolist() == [True, True, False, True, True, True]
    assert num_new == 5
    assert m.row_capacity == 12 and m.free_rows == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_random_rounds_against_dict(seed):
    rng = np.random.default_rng(seed)
    m, oracle = _C.IdMap(), Oracle()
    for rnd in range(120):
        # A narrow pool gives hits, duplicates and erase/re-insert churn; a wide one growth.
        pool = 3000 if (rnd // 30) % 2 == 0 else 1 << 62
        n = 80_000 if rnd % 40 == 39 else int(rng.integers(0, 2000))  # big: multi-threaded path
        ids = rng.integers(-pool, pool, size=n, dtype=np.int64)
        extremes = rng.random(n) < 0.02
        ids[extremes] = rng.choice(np.array(EXTREMES, dtype=np.int64), size=int(extremes.sum()))
        threads = [1, 2, 4][rnd % 3]

        rows, is_new, num_new = m.lookup_or_insert(ids, threads=threads)
        want_rows, want_new, want_num = oracle.lookup_or_insert(ids)
        np.testing.assert_array_equal(rows, want_rows)
        np.testing.assert_array_equal(is_new, want_new)
        assert num_new == want_num

        er = np.concatenate([rng.choice(ids, size=min(n, int(rng.integers(0, 700)))) if n else
                             np.empty(0, np.int64), rng.integers(-pool, pool, size=50, dtype=np.int64)])
        np.testing.assert_array_equal(m.erase(er), oracle.erase(er))

        probe = np.concatenate([ids, er])
        np.testing.assert_array_equal(m.lookup(probe, threads=threads), oracle.lookup(probe))
        if rnd % 10 == 0:
            assert_matches(m, oracle)
    assert_matches(m, oracle)


def test_results_identical_for_any_thread_count():
    rng = np.random.default_rng(7)
    maps = {t: _C.IdMap() for t in (1, 2, 4)}
    for _ in range(4):
        ids = rng.integers(0, 300_000, size=250_000, dtype=np.int64) * 7919 - 10**6
        er = rng.choice(ids, size=40_000)
        results = {}
        for t, m in maps.items():
            rows, is_new, num_new = m.lookup_or_insert(ids, threads=t)
            results[t] = (rows, is_new, num_new, m.erase(er), m.lookup(ids, threads=t))
        for t in (2, 4):
            for a, b in zip(results[1], results[t]):
                np.testing.assert_array_equal(a, b)
    exports = {t: m.export() for t, m in maps.items()}
    for t in (2, 4):
        np.testing.assert_array_equal(exports[1][0], exports[t][0])
        np.testing.assert_array_equal(exports[1][1], exports[t][1])


def test_grows_from_zero_past_a_million_ids():
    m = _C.IdMap(0)
    n = 1_200_000
    ids = (np.arange(n, dtype=np.int64) * 1_000_003) ^ 0x5DEECE66D  # structured, all distinct
    caps = set()
    for b in range(0, n, 100_000):
        rows, is_new, num_new = m.lookup_or_insert(ids[b:b + 100_000])
        np.testing.assert_array_equal(rows, np.arange(b, b + 100_000))
        assert num_new == 100_000 and is_new.all()
        caps.add(m.slot_capacity)
    assert len(caps) > 1  # it did grow
    assert len(m) == n and m.row_capacity == n
    cap = m.slot_capacity
    assert cap & (cap - 1) == 0 and n <= cap * 0.7
    np.testing.assert_array_equal(m.lookup(ids, threads=2), np.arange(n))
    for threads in (1, 3):
        out_ids, out_rows = m.export(threads=threads)
        np.testing.assert_array_equal(out_rows, np.arange(n))
        np.testing.assert_array_equal(out_ids, ids)
    m.erase(ids[::3])  # holes in the rows: the export stays sorted and complete
    out_ids, out_rows = m.export(threads=2)
    keep = np.arange(n) % 3 != 0
    np.testing.assert_array_equal(out_rows, np.arange(n)[keep])
    np.testing.assert_array_equal(out_ids, ids[keep])


def test_reserve_avoids_rehash_and_clear_resets_rows():
    m = _C.IdMap()
    m.reserve(100_000)
    cap = m.slot_capacity
    m.lookup_or_insert(np.arange(100_000, dtype=np.int64) - 50_000)
    assert m.slot_capacity == cap
    m.reserve(10)  # never shrinks
    assert m.slot_capacity == cap
    pre = _C.IdMap(5000)  # the constructor's capacity is honoured like reserve()
    cap = pre.slot_capacity
    pre.lookup_or_insert(np.arange(5000, dtype=np.int64))
    assert pre.slot_capacity == cap

    m.erase(np.array([-50_000, 3]))
    m.clear()
    assert len(m) == 0 and m.row_capacity == 0 and m.free_rows == 0
    assert m.lookup(np.array([0, 1, -50_000])).tolist() == [-1, -1, -1]
    rows, _, _ = m.lookup_or_insert(np.array([42, 43]))
    assert rows.tolist() == [0, 1]
    with pytest.raises(UsageError, match="reserve"):  # a RecsaveError and a ValueError
        m.reserve(-1)
    with pytest.raises(UsageError, match="initial_capacity"):
        _C.IdMap(-1)


def _huge_advised_bytes() -> int:
    """Bytes of this process's mappings that carry the kernel's `hg` flag (MADV_HUGEPAGE), from
    /proc/self/smaps (a total: mappings split and merge as flags change)."""
    total, size = 0, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            if line.startswith("Size:"):
                size = int(line.split()[1]) * 1024
            elif line.startswith("VmFlags:") and " hg" in f" {line.split(':', 1)[1]}":
                total += size
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_a_restore_reserves_on_small_pages_then_advises_huge_ones():
    """reserve(n, huge_pages=False) (a restore's: faulting 2 MB pages may wait on memory
    compaction) gives the same map, its slot array not advised for huge pages until
    advise_huge_pages(), once it is filled."""
    n = 1 << 20  # 2M slots of 16 bytes: a 32 MB array
    before = _huge_advised_bytes()
    m = _C.IdMap()
    m.reserve(n, huge_pages=False)
    ids = np.arange(n, dtype=np.int64) * 7919 - 12345
    assert m.load_distinct(ids, 2)
    assert _huge_advised_bytes() - before < 30 << 20
    m.advise_huge_pages()
    assert _huge_advised_bytes() - before >= 30 << 20
    np.testing.assert_array_equal(m.lookup(ids[::-1]), np.arange(n)[::-1])
    advised = _C.IdMap()
    advised.reserve(n)  # the default: advised at once
    assert _huge_advised_bytes() - before >= 60 << 20


def test_export_is_sorted_by_row_with_holes():
    m = _C.IdMap()
    ids = np.array([50, 40, 30, 20, 10, I64_MIN, I64_MAX], dtype=np.int64)
    m.lookup_or_insert(ids)
    m.erase(np.array([40, 20]))
    m.insert_with_rows(np.array([7, 8]), np.array([9, 1]))
    out_ids, out_rows = m.export()
    assert out_rows.tolist() == [0, 1, 2, 4, 5, 6, 9]
    assert out_ids.tolist() == [50, 8, 30, 10, I64_MIN, I64_MAX, 7]
    assert m.row_capacity == 10 and m.free_rows == 3  # rows 3, 7, 8
    rows, _, _ = m.lookup_or_insert(np.array([1, 2, 3, 4]))
    assert rows.tolist() == [3, 7, 8, 10]


def test_empty_map_export():
    ids, rows = _C.IdMap().export()
    assert ids.dtype == np.int64 and rows.dtype == np.int64
    assert ids.shape == (0,) and rows.shape == (0,)


def test_insert_with_rows_restores_a_checkpoint():
    src = _C.IdMap()
    rng = np.random.default_rng(3)
    src.lookup_or_insert(rng.integers(I64_MIN, I64_MAX, size=150_000, dtype=np.int64))
    src.erase(rng.choice(src.export()[0], size=20_000, replace=False))
    ids, rows = src.export()
    perm = rng.permutation(len(ids))  # order in the file does not matter

    dst = _C.IdMap()
    dst.insert_with_rows(ids[perm], rows[perm], threads=4)
    assert snapshot(dst) == snapshot(src)
    probe = np.concatenate([ids, rng.integers(I64_MIN, I64_MAX, size=1000, dtype=np.int64)])
    np.testing.assert_array_equal(dst.lookup(probe), src.lookup(probe))
    new = np.array([1, 2, 3], dtype=np.int64)
    np.testing.assert_array_equal(dst.lookup_or_insert(new)[0], src.lookup_or_insert(new)[0])


@pytest.mark.parametrize("ids, rows, message", [
    ([100, 101, 100], [1, 2, 4], r"id 100 \(index 2\) appears more than once"),
    ([100, 20], [1, 2], r"id 20 \(index 1\) is already in the map"),
    ([100, 101], [1, -7], r"row -7 of id 101 \(index 1\) is negative"),
    ([100, 101], [9, 9], r"row 9 of id 101 \(index 1\) appears more than once"),
    ([100, 101], [1, 3], r"row 3 of id 101 \(index 1\) is already used by another id"),
    ([100, 101], [1, 1 << 50], r"exceeds the maximum row"),
    ([100, 101], [1], r"differ in length"),
])
def test_insert_with_rows_rejects_bad_input_and_leaves_map_unchanged(ids, rows, message):
    m = _C.IdMap()
    m.insert_with_rows(np.array([10, 20, 30]), np.array([0, 3, 5]))
    before = snapshot(m)
    assert before == ([10, 20, 30], [0, 3, 5], 3, 6, 3)
    with pytest.raises(ValueError, match=message):
        m.insert_with_rows(np.array(ids, dtype=np.int64), np.array(rows, dtype=np.int64))
    assert snapshot(m) == before
    assert m.lookup(np.array([100, 101])).tolist() == [-1, -1]
    # The free list is intact: the next new ids still take rows 1, 2, 4, then 6.
    assert m.lookup_or_insert(np.array([1, 2, 3, 4]))[0].tolist() == [1, 2, 4, 6]


def test_late_duplicate_in_a_large_restore_is_rolled_back():
    m = _C.IdMap()
    m.lookup_or_insert(np.array([-5, -6]))
    ids = np.arange(100_000, dtype=np.int64) + 10
    ids[-1] = ids[0]
    rows = np.arange(100_000, dtype=np.int64) + 2
    with pytest.raises(ValueError, match=r"id 10 \(index 99999\) appears more than once"):
        m.insert_with_rows(ids, rows, threads=4)
    assert snapshot(m) == ([-5, -6], [0, 1], 2, 2, 0)
    assert (m.lookup(ids[:-1]) == -1).all()


@pytest.mark.parametrize("bad", [np.zeros((2, 3), dtype=np.int64), np.int64(5), [[1, 2]]])
def test_non_1d_input_is_a_value_error(bad):
    m = _C.IdMap()
    m.lookup_or_insert(np.array([1, 2, 3]))
    before = snapshot(m)
    ok = np.array([9], dtype=np.int64)
    calls = [lambda: m.lookup(bad), lambda: m.lookup_or_insert(bad), lambda: m.erase(bad),
             lambda: m.insert_with_rows(bad, ok), lambda: m.insert_with_rows(ok, bad)]
    for call in calls:
        with pytest.raises(ValueError, match="must be a 1-D int64 array"):
            call()
    assert snapshot(m) == before


def test_empty_batches():
    m = _C.IdMap()
    empty = np.empty(0, dtype=np.int64)
    for t in (1, 4):
        assert m.lookup(empty, threads=t).shape == (0,)
        rows, is_new, num_new = m.lookup_or_insert(empty, threads=t)
        assert rows.shape == (0,) and is_new.shape == (0,) and num_new == 0
    assert m.erase(empty).shape == (0,)
    m.insert_with_rows(empty, empty)
    m.lookup_ptr(0, 0, 0)
    assert m.lookup_or_insert_ptr(0, 0, 0, 0) == 0
    assert snapshot(m) == ([], [], 0, 0, 0)


def test_input_conversion():
    m = _C.IdMap()
    base = np.arange(20, dtype=np.int64) * 3
    m.lookup_or_insert(base)
    np.testing.assert_array_equal(m.lookup(base[::2]), np.arange(0, 20, 2))  # strided view
    np.testing.assert_array_equal(m.lookup(base.astype(np.int32)), np.arange(20))
    assert m.lookup([0, 3, 4]).tolist() == [0, 1, -1]  # plain lists
    # uint64 feature hashes land on the int64 with the same bits.
    m.lookup_or_insert(np.array([-1], dtype=np.int64))
    assert m.lookup(np.array([2**64 - 1], dtype=np.uint64)).tolist() == [20]


def test_invalid_threads():
    m = _C.IdMap()
    with pytest.raises(ValueError, match="threads must be >= 1"):
        m.lookup(np.array([1]), threads=0)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        m.lookup_or_insert(np.array([1]), threads=-2)
    assert len(m) == 0


def test_pointer_variants_with_torch_tensors():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-(2**62), 2**62, (70_000,), generator=g, dtype=torch.int64)
    ids[100:200] = ids[:100]  # duplicates
    via_ptr, via_numpy = _C.IdMap(), _C.IdMap()

    rows = torch.empty_like(ids)
    is_new = torch.empty(ids.numel(), dtype=torch.bool)
    num_new = via_ptr.lookup_or_insert_ptr(ids.data_ptr(), ids.numel(), rows.data_ptr(),
                                           is_new.data_ptr(), 2)
    want_rows, want_new, want_num = via_numpy.lookup_or_insert(ids.numpy(), threads=2)
    assert num_new == want_num == 69_900
    np.testing.assert_array_equal(rows.numpy(), want_rows)
    np.testing.assert_array_equal(is_new.numpy(), want_new)

    # No is_new buffer; all hits now.
    rows2 = torch.full_like(ids, -7)
    assert via_ptr.lookup_or_insert_ptr(ids.data_ptr(), ids.numel(), rows2.data_ptr()) == 0
    assert torch.equal(rows2, rows)

    probe = torch.cat([ids[:500], torch.tensor([12345, I64_MIN])])
    out = torch.empty_like(probe)
    via_ptr.lookup_ptr(probe.data_ptr(), probe.numel(), out.data_ptr(), threads=4)
    np.testing.assert_array_equal(out.numpy(), via_numpy.lookup(probe.numpy()))


def test_pointer_variants_reject_bad_addresses():
    m = _C.IdMap()
    ids = torch.arange(8, dtype=torch.int64)
    out = torch.empty(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="null"):
        m.lookup_ptr(0, 8, out.data_ptr())
    with pytest.raises(ValueError, match="null"):
        m.lookup_or_insert_ptr(ids.data_ptr(), 8, 0)
    with pytest.raises(ValueError, match="not aligned"):
        m.lookup_ptr(ids.data_ptr() + 4, 4, out.data_ptr())
    with pytest.raises(ValueError, match="n must be >= 0"):
        m.lookup_ptr(ids.data_ptr(), -1, out.data_ptr())
    assert len(m) == 0


def test_threads_may_share_a_map():
    """Lookups and exports from other Python threads while one thread keeps inserting (and so
    rehashing) must see consistent data: the binding releases the GIL and locks the map."""
    m = _C.IdMap()
    first = np.arange(50_000, dtype=np.int64) * 11
    m.lookup_or_insert(first)
    stop = threading.Event()
    errors = []

    def reader():
        try:
            while not stop.is_set():
                np.testing.assert_array_equal(m.lookup(first, threads=2), np.arange(50_000))
                ids, rows = m.export()
                assert len(ids) == len(rows) and (np.diff(rows) > 0).all()
        except Exception as e:
            errors.append(e)

    workers = [threading.Thread(target=reader) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        for b in range(20):
            m.lookup_or_insert(np.arange(50_000, dtype=np.int64) * 11 + 1 + b * 10**7, threads=2)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert not errors, errors
    assert len(m) == 21 * 50_000
