"""The format through fsspec (memory://, file://) and partial row reads."""
import uuid
from typing import List

import pytest
import torch
from conftest import all_dtype_tensors, raw_bytes

import recsave.knobs
from recsave import format as fmt
from recsave.errors import CorruptCheckpointError
from recsave.storage import get_storage


def _url(tmp_path, scheme):
    return f"memory://t-{uuid.uuid4().hex}" if scheme == "memory" else f"file://{tmp_path}/ck"


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_round_trip_through_fsspec_matches_local_bytes(tmp_path, scheme):
    tensors = all_dtype_tensors(seed=4)
    url = _url(tmp_path, scheme)
    storage = get_storage(url)
    storage.makedirs(url)
    with recsave.knobs.override(io_chunk_bytes=256):  # many small ranged requests
        part = fmt.write_shards(url, tensors, storage=storage, max_shard_bytes=400, segment_bytes=100)
        fmt.write_index(url, fmt.merge_parts([part]), storage=storage)
        got = fmt.read_tensors(url, storage=storage)
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and raw_bytes(got[k]) == raw_bytes(t)

    # The same tensors written locally give byte-identical shard files.
    local = tmp_path / "local"
    local.mkdir()
    local_part = fmt.write_shards(str(local), tensors, max_shard_bytes=400, segment_bytes=100)
    assert local_part.tensors == part.tensors
    for fname in part.files:
        assert (local / fname).read_bytes() == storage.read_range(storage.join(url, fname), 0,
                                                                  part.files[fname].size)


def test_remote_corruption_is_detected(tmp_path):
    url = _url(tmp_path, "memory")
    storage = get_storage(url)
    part = fmt.write_shards(url, {"w": torch.arange(1000.0)}, storage=storage, segment_bytes=256)
    fmt.write_index(url, fmt.merge_parts([part]), storage=storage)
    fname = next(iter(part.files))
    path = storage.join(url, fname)
    data = bytearray(storage.read_range(path, 0, part.files[fname].size))
    data[-5] ^= 1
    storage.write_atomic(path, bytes(data))
    with pytest.raises(CorruptCheckpointError, match="CRC32C mismatch"):
        fmt.read_tensors(url, storage=storage)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_row_ranges_read_only_covering_segments(tmp_path, where):
    emb = torch.randn(1000, 8)
    ids = torch.arange(1000) * 3
    url = str(tmp_path) if where == "local" else _url(tmp_path, "memory")
    storage = get_storage(url)
    parts = [fmt.write_shards(url, {"e": emb[:600], "i": ids[:600]}, rank=0, segment_bytes=32 * 10, storage=storage),
             fmt.write_shards(url, {"e": emb[600:], "i": ids[600:]}, rank=1, segment_bytes=32 * 10, storage=storage)]
    fmt.write_index(url, fmt.merge_parts(parts), storage=storage)
    ranges = [(590, 615), (0, 3), (999, 1000), (200, 200)]
    stats = {}
    got = fmt.read_tensors(url, ["e"], rows={"e": ranges}, storage=storage, stats=stats)
    assert torch.equal(got["e"], torch.cat([emb[a:b] for a, b in ranges]))
    # Only segments of 10 rows covering the ranges: far less than the 32000 bytes of the tensor.
    assert stats["bytes_read"] <= 6 * 320
    with pytest.raises(recsave.errors.ConfigError, match="outside"):
        fmt.read_tensors(url, ["e"], rows={"e": [(990, 1001)]}, storage=storage)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_row_source_is_written_in_bounded_blocks(tmp_path, where):
    from recsave.format import RowSource

    t = torch.randn(1000, 6)
    calls = []

    def fetch(a, b):
        calls.append((a, b))
        return t[a:b].clone()

    url = str(tmp_path) if where == "local" else _url(tmp_path, "memory")
    storage = get_storage(url)
    ends = list(range(24 * 7, 24 * 1000, 24 * 7)) + [24 * 1000]  # 7-row segments
    with recsave.knobs.override(write_block_bytes=24 * 100):
        part = fmt.write_shards(url, {"x": RowSource(torch.float32, (1000, 6), fetch), "y": torch.arange(5)},
                                segments={"x": ends}, storage=storage)
        fmt.write_index(url, fmt.merge_parts([part]), storage=storage)
    got = fmt.read_tensors(url, storage=storage)
    assert torch.equal(got["x"], t) and torch.equal(got["y"], torch.arange(5))
    # Every block holds whole segments and at most write_block_bytes (100 rows), covering all rows once.
    assert all(b - a <= 100 and a % 7 == 0 for a, b in calls)
    assert sorted(calls) == calls and calls[0][0] == 0 and calls[-1][1] == 1000
    assert all(x[1] == y[0] for x, y in zip(calls, calls[1:]))
    with pytest.raises(recsave.errors.UsageError, match="row boundaries"):
        fmt.write_shards(url, {"z": RowSource(torch.float32, (10, 6), fetch)}, segments={"z": [100, 240]},
                         storage=storage)


def _runs_of_rows(g: torch.Generator, num_rows: int, total: int) -> torch.Tensor:
    """Row indexes in runs of consecutive rows, short and long (as a table restored in bucket order
    and then grown has them), `total` of them."""
    out: List[torch.Tensor] = []
    while sum(t.numel() for t in out) < total:
        length = [1, 3, 40, 170, 171, 200, 400][int(torch.randint(0, 7, (1,), generator=g))]
        start = int(torch.randint(0, num_rows - length + 1, (1,), generator=g))
        out.append(torch.arange(start, start + length))
    return torch.cat(out)[:total]


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("dtype,width", [(torch.float32, 6), (torch.int8, 3), (torch.int64, 1), (torch.int64, 2),
                                         (torch.bfloat16, 64), (torch.float32, 1024)])
@pytest.mark.parametrize("order", ["random", "runs"])
def test_taken_rows_are_the_bytes_of_the_permuted_tensor(tmp_path, where, dtype, width, order):
    """RowSource.take(storage, rows): the engine gathers the rows on its threads (locally; runs of
    consecutive rows of 4 KiB and more are written from the storage where they lie, the rest copied)
    or they are fetched in blocks (streams); either way the file is that of storage[rows], CRCs
    included."""
    from recsave.format import RowSource

    g = torch.Generator().manual_seed(width)
    storage = (torch.randn(500, width, generator=g) * 50).to(dtype)
    if order == "random":
        rows = torch.randint(0, 400, (1200,), generator=g)  # repeats, and storage rows never taken
    else:
        rows = _runs_of_rows(g, 500, 1200)
    ends = [r * storage[0].nbytes for r in (1, 2, 300, 301, 1200)]
    root = tmp_path if where == "local" else None
    parts = {}
    for kind, src in (("taken", RowSource.take(storage, rows)), ("plain", storage[rows])):
        url = str(root / kind) if root else _url(tmp_path, "memory")
        st = get_storage(url)
        st.makedirs(url)
        with recsave.knobs.override(write_block_bytes=storage[0].nbytes * 50):
            parts[kind] = fmt.write_shards(url, {"x": src, "y": torch.arange(7)}, segments={"x": ends}, storage=st)
        fname = fmt.shard_file_name("sparse", 0, 0)
        parts[kind + "-bytes"] = st.read_bytes(st.join(url, fname), 16 << 20)
    assert parts["taken"] == parts["plain"]
    assert parts["taken-bytes"] == parts["plain-bytes"]
    assert len(parts["taken"].tensors["x"].chunks[0].crc32c) == 5


def test_taken_rows_refuse_bad_sources_and_leave_nothing(tmp_path):
    from recsave.format import RowSource

    storage = torch.randn(10, 4)
    with pytest.raises(recsave.errors.UsageError, match="contiguous CPU"):
        RowSource.take(storage.t(), torch.arange(3))
    with pytest.raises(recsave.errors.UsageError, match="1-D"):
        RowSource.take(storage, torch.zeros(2, 2, dtype=torch.int64))
    for bad in (-1, 10):
        with pytest.raises(recsave.errors.UsageError, match="outside the 10 rows"):
            fmt.write_shards(str(tmp_path), {"x": RowSource.take(storage, torch.tensor([0, bad, 2]))})
        assert list(tmp_path.iterdir()) == []
    # Segments are gathered and checksummed row by row: an end inside a row is refused.
    with pytest.raises(recsave.errors.UsageError, match="must end on row boundaries \\(16 bytes\\)"):
        fmt.write_shards(str(tmp_path), {"x": RowSource.take(storage, torch.arange(3))}, segments={"x": [8, 48]})
    assert list(tmp_path.iterdir()) == []


def test_file_url_shards_are_committed_by_the_engine_like_plain_paths(tmp_path):
    """file:// is local disk: a durable shard goes through the engine's temp file, fsync and rename,
    committed with the save's other files, never streamed into its final name."""
    import os

    from recsave.format.commits import DeferredCommits

    url = f"file://{tmp_path}/ck"
    storage = get_storage(url)
    storage.makedirs(url)
    commits = DeferredCommits()
    part = fmt.write_shards(url, {"x": torch.arange(1000.0)}, storage=storage, durable=True, commits=commits)
    names = os.listdir(tmp_path / "ck")
    assert names and not set(names) & set(part.files) and all(".tmp-" in n for n in names)
    commits.wait()
    assert sorted(os.listdir(tmp_path / "ck")) == sorted(part.files)
    fmt.write_index(url, fmt.merge_parts([part]), storage=storage)
    assert torch.equal(fmt.read_tensors(url, storage=storage)["x"], torch.arange(1000.0))


@pytest.mark.parametrize("order", ["random", "in_order_then_random"])
def test_many_small_taken_rows_span_write_pieces_and_segments(tmp_path, order):
    """8-byte rows (ids, row metadata), many write pieces' worth, in random order or first in
    storage order (a restored table: whole pieces copied as one block) then random: the batched
    copy of small rows gives the bytes and CRCs of storage[rows]."""
    from recsave.format import RowSource

    g = torch.Generator().manual_seed(3)
    storage = torch.randint(-(2 ** 62), 2 ** 62, (1_000_000, 1), generator=g)
    rows = torch.randperm(1_000_000, generator=g)[:400_000]
    if order == "in_order_then_random":
        rows[:300_001] = torch.arange(5, 300_006)
    ends = [8 * r for r in (1, 131_071, 131_072, 250_001, 400_000)]
    written = {}
    for kind, src in (("taken", RowSource.take(storage, rows)), ("plain", storage[rows])):
        (tmp_path / kind).mkdir()
        part = fmt.write_shards(str(tmp_path / kind), {"x": src}, segments={"x": ends}, concurrency=3)
        written[kind] = (part, (tmp_path / kind / fmt.shard_file_name("sparse", 0, 0)).read_bytes())
    assert written["taken"] == written["plain"]
