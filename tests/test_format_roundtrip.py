"""Shard files + index: write with the engine, read back bit for bit with the engine, the pure-Python
oracle and safetensors."""
import json
import os

import pytest
import torch
from conftest import all_dtype_tensors, raw_bytes
from safetensors import safe_open

from recsave import format as fmt
from recsave.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, UsageError
from recsave.format import oracle


def save(directory, tensors, **kwargs):
    part = fmt.write_shards(str(directory), tensors, **kwargs)
    fmt.write_index(str(directory), fmt.merge_parts([part], step=5))
    return part


def assert_same(expected: dict, got: dict):
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype, name
        assert tuple(got[name].shape) == tuple(t.shape), name
        assert raw_bytes(got[name]) == raw_bytes(t), name


@pytest.mark.parametrize("max_shard_bytes,segment_bytes", [(None, None), (300, 64), (1, 1)])
def test_all_dtypes_round_trip_with_both_readers(tmp_path, max_shard_bytes, segment_bytes):
    tensors = all_dtype_tensors()
    part = save(tmp_path, tensors, max_shard_bytes=max_shard_bytes, segment_bytes=segment_bytes)
    if max_shard_bytes == 1:  # a file per non-empty tensor (empty ones join their neighbour)
        assert len(part.files) >= sum(1 for t in tensors.values() if t.nbytes)
    assert_same(tensors, fmt.read_tensors(str(tmp_path)))
    assert_same(tensors, oracle.read_tensors(str(tmp_path)))


def test_selected_names_are_read_alone(tmp_path):
    tensors = all_dtype_tensors()
    save(tmp_path, tensors, max_shard_bytes=200)
    names = ["t_bfloat16", "scalar_f32", "empty_rows"]
    assert_same({n: tensors[n] for n in names}, fmt.read_tensors(str(tmp_path), names))
    with pytest.raises(ConfigError, match="no_such"):
        fmt.read_tensors(str(tmp_path), ["no_such"])


def test_shard_files_open_with_safetensors(tmp_path):
    tensors = all_dtype_tensors()
    part = save(tmp_path, tensors, max_shard_bytes=500)
    seen = set()
    for fname in part.files:
        with safe_open(str(tmp_path / fname), framework="pt") as f:
            meta = f.metadata()
            assert meta["format"] == "recsave.shard"
            foreign = json.loads(meta.get("recsave.dtypes", "{}"))
            for key in f.keys():
                got = f.get_tensor(key)
                seen.add(key)
                if key in foreign:  # stored as raw bytes, the index has the real dtype
                    assert got.dtype == torch.uint8
                    assert got.numpy().tobytes() == raw_bytes(tensors[key])
                else:
                    assert got.dtype == tensors[key].dtype and raw_bytes(got) == raw_bytes(tensors[key])
    assert seen == set(tensors)


def test_merged_parts_concatenate_rows_across_ranks(tmp_path):
    parts, full = [], {"emb": [], "emb@id": []}
    for rank in range(3):
        emb = torch.randn(10 + rank, 4)
        ids = torch.arange(rank * 100, rank * 100 + 10 + rank)
        full["emb"].append(emb)
        full["emb@id"].append(ids)
        parts.append(fmt.write_shards(str(tmp_path), {"emb": emb, "emb@id": ids}, rank=rank))
    index = fmt.merge_parts(parts[::-1], world_size=3)  # order of arrival does not matter
    fmt.write_index(str(tmp_path), index)
    assert index.tensor("emb").shape == (33, 4)
    assert [c.rows for c in index.tensor("emb").chunks] == [(0, 10), (10, 21), (21, 33)]
    expected = {k: torch.cat(v) for k, v in full.items()}
    assert_same(expected, fmt.read_tensors(str(tmp_path)))
    assert_same(expected, oracle.read_tensors(str(tmp_path)))


def test_index_header_fields(tmp_path):
    save(tmp_path, {"a": torch.ones(3)})
    index = fmt.read_index(str(tmp_path))
    assert index.magic == "recsave.index" and index.format_version == 1
    assert index.step == 5 and index.world_size == 1 and index.partition is None and index.meta is None
    assert index.created_at.endswith("Z")


def _first_chunk(tmp_path, name):
    index = fmt.read_index(str(tmp_path))
    return index.tensor(name).chunks[0]


def test_flipped_byte_is_detected_and_names_the_file(tmp_path):
    save(tmp_path, {"w": torch.randn(1000)}, segment_bytes=512)
    chunk = _first_chunk(tmp_path, "w")
    path = tmp_path / chunk.file
    with open(path, "r+b") as f:
        f.seek(chunk.offset + 1234)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match=chunk.file) as info:
        fmt.read_tensors(str(tmp_path))
    assert "CRC32C mismatch" in str(info.value)
    assert fmt.read_tensors(str(tmp_path), verify=False)["w"].numel() == 1000  # verify off reads


def test_truncated_file_is_detected(tmp_path):
    save(tmp_path, {"w": torch.randn(1000)})
    chunk = _first_chunk(tmp_path, "w")
    os.truncate(tmp_path / chunk.file, chunk.offset + 100)
    with pytest.raises(CorruptCheckpointError, match="bytes, the index records"):
        fmt.read_tensors(str(tmp_path))


def test_missing_index_and_missing_shard(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no index"):
        fmt.read_tensors(str(tmp_path))
    save(tmp_path, {"w": torch.randn(10)})
    os.remove(tmp_path / _first_chunk(tmp_path, "w").file)
    with pytest.raises(CheckpointNotFoundError, match="missing"):
        fmt.read_tensors(str(tmp_path))


def test_writer_refuses_unstorable_input_and_leaves_nothing(tmp_path):
    with pytest.raises(UsageError, match="quantized"):
        fmt.write_shards(str(tmp_path), {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)})
    with pytest.raises(UsageError, match="not a torch.Tensor"):
        fmt.write_shards(str(tmp_path), {"x": [1, 2]})
    with pytest.raises(UsageError, match="__metadata__"):
        fmt.write_shards(str(tmp_path), {"__metadata__": torch.ones(1)})
    assert os.listdir(tmp_path) == []


def test_write_into_missing_directory_is_a_storage_error(tmp_path):
    from recsave.errors import StorageError

    with pytest.raises(StorageError) as info:
        fmt.write_shards(str(tmp_path / "nope"), {"a": torch.ones(2)})
    assert info.value.errno == 2 and "nope" in str(info.value)


def test_non_contiguous_and_views_are_written_by_value(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    tensors = {"t": base.t(), "slice": base[2:4, 3:7], "expanded": torch.ones(1, 3).expand(4, 3)}
    save(tmp_path, tensors)
    got = fmt.read_tensors(str(tmp_path))
    for k, v in tensors.items():
        assert torch.equal(got[k], v)


def test_merge_rejects_conflicting_parts():
    a = fmt.IndexPart(0, {}, {"x": fmt.TensorEntry("float32", (2, 3), ())})
    b = fmt.IndexPart(1, {}, {"x": fmt.TensorEntry("float32", (2, 4), ())})
    with pytest.raises(UsageError, match="differs between ranks"):  # also a ValueError
        fmt.merge_parts([a, b])
    a = a.with_files({"sparse-0-0.safetensors": fmt.FileEntry(8, 0)})
    c = fmt.new_part(1).with_files({"sparse-0-0.safetensors": fmt.FileEntry(8, 1)})
    with pytest.raises(UsageError, match="described by two index parts"):
        fmt.merge_parts([a, c])
    with pytest.raises(UsageError, match="described twice"):
        a.joined(fmt.IndexPart(0, {"sparse-0-0.safetensors": fmt.FileEntry(8, 0)}, {}))


@pytest.mark.slow
def test_more_than_2_gib_across_files(tmp_path):
    # 2.25 GiB in 9 tensors of 256 MiB over several shard files, checked bit for bit.
    g = torch.Generator().manual_seed(1)
    tensors = {f"big{i}": torch.randint(-2**31, 2**31 - 1, (64 << 20,), dtype=torch.int32, generator=g)
               for i in range(9)}
    part = save(tmp_path, tensors, max_shard_bytes=1 << 30, concurrency=2)
    assert len(part.files) >= 3
    assert sum(e.size for e in part.files.values()) > (2 << 30)
    got = fmt.read_tensors(str(tmp_path), concurrency=2)
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k
    del got
    # The oracle agrees on one tensor from each file.
    index = fmt.read_index(str(tmp_path))
    picks = {}
    for name, entry in index.tensors.items():
        picks.setdefault(entry.chunks[0].file, name)
    got = oracle.read_tensors(str(tmp_path), list(picks.values()))
    for name in picks.values():
        assert torch.equal(got[name], tensors[name])


def test_checked_files_are_checked_once_and_still_against_every_tensor(tmp_path, monkeypatch):
    """read_tensors(checked=...): a file's size and header are read by the first call only; a later
    call still checks the chunks it reads against the kept header."""
    from recsave.format import index as index_mod
    from recsave.format import reader

    tensors = {"a": torch.arange(12.0).view(3, 4), "b": torch.arange(6, dtype=torch.int64)}
    save(tmp_path, tensors)
    calls = []
    real = reader.check_listed_file
    monkeypatch.setattr(reader, "check_listed_file", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    checked = {}
    assert_same({"a": tensors["a"]}, fmt.read_tensors(str(tmp_path), ["a"], checked=checked))
    assert_same({"b": tensors["b"]}, fmt.read_tensors(str(tmp_path), ["b"], checked=checked))
    assert calls == list(checked) == ["sparse-0-0.safetensors"]
    # An index whose entry for "b" disagrees with the (kept) header is refused on the second read.
    index = index_mod.read(str(tmp_path))
    entry = index.tensors["b"]
    moved = type(entry)(entry.dtype, entry.shape, (type(entry.chunks[0])(
        **{**vars(entry.chunks[0]), "offset": entry.chunks[0].offset - 8}),))
    bad = type(index)(**{**vars(index), "tensors": {**index.tensors, "b": moved}})
    checked = {}
    fmt.read_tensors(str(tmp_path), ["a"], index=bad, checked=checked)
    with pytest.raises(CorruptCheckpointError, match="disagrees with the file header"):
        fmt.read_tensors(str(tmp_path), ["b"], index=bad, checked=checked)


def test_the_largest_tensors_start_cache_line_aligned(tmp_path):
    """The writer pads the header (spaces, a multiple of 8 in all) so that most of the data starts on
    a 64-byte boundary of the file: the kernel copies buffered I/O slower when the user buffer and
    the file offset are aligned differently. Readers take any padding."""
    from recsave.format import header

    g = torch.Generator().manual_seed(3)
    rows = 1001  # 8 * 1001 bytes of ids: the embedding would start 8 bytes off a boundary unpadded
    tensors = {"t@id": torch.arange(rows), "t@embedding": torch.randn(rows, 64, generator=g),
               "t@slot": torch.randn(rows, 64, generator=g), "t@count": torch.arange(rows).view(rows, 1)}
    part = save(tmp_path, tensors)
    (fname,) = part.files
    raw = (tmp_path / fname).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and raw[8:8 + n].rstrip(b" ").endswith(b"}")
    _, entries = header.parse(raw[8:8 + n], len(raw), fname)
    starts = {name: 8 + n + e.begin for name, e in entries.items()}
    assert starts["t@embedding"] % header.DATA_ALIGN == 0 and starts["t@slot"] % header.DATA_ALIGN == 0
    assert starts["t@id"] % header.DATA_ALIGN != 0  # the 8 KB of ids give way to the 512 KB after them
    assert_same(tensors, fmt.read_tensors(str(tmp_path)))
    assert_same(tensors, oracle.read_tensors(str(tmp_path)))


@pytest.mark.parametrize("odd", [1, 3, 24, 40])
def test_large_tensors_at_any_file_offset_read_back_exactly(tmp_path, odd):
    """Two tensors above the reader's direct-read size, `odd` bytes apart from a boundary: only one
    can start aligned, and the other goes through the staging buffer at the file offset's alignment."""
    g = torch.Generator().manual_seed(odd)
    tensors = {"a": torch.randint(-128, 127, (100_000 + odd,), dtype=torch.int8, generator=g),
               "b": torch.randn(70_001, generator=g), "c": torch.randint(0, 255, (odd,), dtype=torch.uint8)}
    save(tmp_path, tensors, segment_bytes=4096 + odd)
    assert_same(tensors, fmt.read_tensors(str(tmp_path)))
    assert_same(tensors, oracle.read_tensors(str(tmp_path)))


def test_a_header_entry_with_an_extra_key_is_corrupt_for_both_readers(tmp_path):
    """The alignment padding leaves room to edit a header in place without moving the data: an entry
    key recsave does not write is corruption, not something to ignore."""
    from recsave.format import header
    from recsave.format.dtypes import BY_NAME

    def room(r):  # spaces after the JSON of a layout of r rows
        head = header.build([("t@id", BY_NAME["int64"], (r,)), ("t@embedding", BY_NAME["float32"], (r, 4))], 4)[0]
        return len(head) - len(head.rstrip(b" "))

    rows = next(r for r in range(1, 200) if room(r) >= 8)  # room for `,"zz":1` in place
    tensors = {"t@id": torch.arange(rows), "t@embedding": torch.ones(rows, 4)}
    part = save(tmp_path, tensors)
    (fname,) = part.files
    path = tmp_path / fname
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    obj = json.loads(raw[8:8 + n])
    obj["t@embedding"]["zz"] = 1
    text = json.dumps(obj, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])
    with pytest.raises(CorruptCheckpointError, match="unknown key"):
        fmt.read_tensors(str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="keys other than"):
        oracle.read_tensors(str(tmp_path))
