"""The typed index (recsave/format/records.py): parse -> dumps gives back the exact bytes recsave
wrote, the records carry the index's values, and the meta is validated once at parse time."""
import copy
import dataclasses
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import Reader, make_job

import recsave
from recsave import format as fmt
from recsave.errors import CorruptCheckpointError
from recsave.format import index as index_mod
from recsave.format import seal
from recsave.load import contents

CORPUS_INDEX = Path(__file__).resolve().parent / "corpus" / "valid_basic" / "index"


def _single_table_checkpoint(out: str) -> str:
    model = torch.nn.Module()
    model.emb = recsave.HashTable(6, name="emb")
    model.lin = torch.nn.Linear(3, 2)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(-2**62, 2**62, (50,), generator=g)
    model.emb.add_slot("acc")  # load_rows sets existing slots only
    model.emb.load_rows(ids, torch.randn(50, 6, generator=g), {"acc": torch.rand(50, 6, generator=g)})
    saver = recsave.Saver(model, output_dir=out)
    saver.register_io_state("reader", Reader(3))
    return saver.save("ckpt_2")


def _multi_table_checkpoint(out: str) -> str:
    job = make_job(out)  # tables user and item with Adagrad slots, an extra, io state `reader`
    job.train(3)
    return job.saver.save("ckpt_3")


@pytest.mark.parametrize("make", [_single_table_checkpoint, _multi_table_checkpoint])
def test_saved_index_parses_and_dumps_to_the_same_bytes(tmp_path, make):
    ckpt = make(str(tmp_path / "run"))
    path = os.path.join(ckpt, "index")
    data = Path(path).read_bytes()
    index = index_mod.parse(data, path)
    assert index_mod.dumps(index) == data
    assert index == fmt.read_index(ckpt)

    raw = json.loads(data)
    assert index.meta is not None and index.meta.io_states == ("reader",) and index.meta.io_state_count == 1
    assert index.table_names() == list(raw["meta"]["tables"])
    for name, table in index.meta.tables.items():
        assert table.to_json() == {**raw["meta"]["tables"][name], "slots": tuple(table.slots)}
        assert table.slots == tuple(raw["meta"]["tables"][name]["slots"]) and table.slots
        chunk = index.tensor(f"{name}@id").chunks[0]
        assert chunk.buckets is not None and chunk.buckets.row_starts[-1] == chunk.rows[1] == table.rows
    assert index.partition == fmt.Partition("mix64", raw["partition"]["num_buckets"])
    assert set(index.files) == set(raw["files"]) and index.total_bytes == sum(f["size"] for f in raw["files"].values())
    assert index.file("model.pt").crc32c == raw["files"]["model.pt"]["crc32c"]
    assert index.io_state_count == 1


def test_bucket_ranges_are_listed_once_and_shared_by_the_chunks(tmp_path):
    """format_version 3: equal ranges (a table's tensors, chunk by chunk) are one `bucket_ranges`
    entry, numbered in order of first use; parsing gives every chunk that range back, one object."""
    parts = []
    for rank, starts in enumerate([[0, 2, 5], [0, 0, 4]]):
        n = starts[-1]
        ranges = {"buckets": {"first": 2 * rank, "row_starts": starts}}
        parts.append(fmt.write_shards(str(tmp_path), {"t@id": torch.arange(n), "t@embedding": torch.ones(n, 2),
                                                      "u@id": torch.arange(n) + 9},
                                      rank=rank, chunk_meta={"t@id": ranges, "t@embedding": ranges,
                                                             "u@id": {"buckets": {"first": 0, "row_starts": [0, n]}}}))
    index = fmt.merge_parts(parts, partition=fmt.Partition("mix64", 4), world_size=2)
    assert index.format_version == 3
    data = index_mod.dumps(index)
    raw = json.loads(data)
    assert raw["bucket_ranges"] == [{"first": 0, "row_starts": [0, 2, 5]}, {"first": 2, "row_starts": [0, 0, 4]},
                                    {"first": 0, "row_starts": [0, 5]}, {"first": 0, "row_starts": [0, 4]}]
    assert {n: [c["buckets"] for c in t["chunks"]] for n, t in raw["tensors"].items()} == \
        {"t@id": [0, 1], "t@embedding": [0, 1], "u@id": [2, 3]}
    parsed = index_mod.parse(data, "x")
    assert parsed == index and index_mod.dumps(parsed) == data
    ids, emb = parsed.tensor("t@id").chunks, parsed.tensor("t@embedding").chunks
    assert all(a.buckets is b.buckets for a, b in zip(ids, emb))
    assert [c.buckets for c in ids] == [fmt.BucketRange(0, (0, 2, 5)), fmt.BucketRange(2, (0, 0, 4))]


def test_indexes_without_bucket_ranges_keep_the_versions_older_readers_know(tmp_path):
    """Version 3 only where a chunk has bucket ranges: a checkpoint of dense parameters alone
    stays readable by recsave releases that read versions 1 and 2."""
    from recsave.format.records import version_for

    model = torch.nn.Linear(3, 2)
    saver = recsave.Saver(model, output_dir=str(tmp_path / "dense"))
    ckpt = saver.save("ckpt_1")
    raw = json.loads(Path(ckpt, "index").read_bytes())
    assert raw["format_version"] == 1 and "bucket_ranges" not in raw
    plain = fmt.write_shards(str(tmp_path), {"x": torch.ones(3)}).tensors
    assert (version_for("full", plain), version_for("delta", plain), version_for("serving", plain)) == (1, 2, 2)


def test_a_saved_part_shares_one_bucket_range_per_table(tmp_path, monkeypatch):
    """The index part a rank sends to rank 0 (pickled) holds each table's bucket range once: every
    tensor of the table refers to the same BucketRange, which pickle keeps shared."""
    from recsave.save import pipeline

    parts = []
    write_rank_files = pipeline.CheckpointWriter._write_rank_files

    def kept(self, *args, **kwargs):
        out = write_rank_files(self, *args, **kwargs)
        parts.append(out[0])
        return out

    monkeypatch.setattr(pipeline.CheckpointWriter, "_write_rank_files", kept)
    _multi_table_checkpoint(str(tmp_path / "run"))
    (part,) = parts
    ranges = {}
    for name, entry in part.tensors.items():
        for chunk in entry.chunks:
            ranges.setdefault(name.partition("@")[0], set()).add(id(chunk.buckets))
    assert set(ranges) == {"user", "item"} and all(len(ids) == 1 for ids in ranges.values())
    again = pickle.loads(pickle.dumps(part))
    assert again.tensors["user@id"].chunks[0].buckets is again.tensors["user@embedding"].chunks[0].buckets


def test_merged_parts_round_trip_through_their_bytes(tmp_path):
    parts = []
    for rank, n in enumerate([5, 0, 9]):
        parts.append(fmt.write_shards(str(tmp_path), {"t@id": torch.arange(n), "t@embedding": torch.ones(n, 2)},
                                      rank=rank, segment_bytes=16,
                                      chunk_meta={"t@id": {"buckets": {"first": rank, "row_starts": [0, n]}}}))
    parts = [pickle.loads(pickle.dumps(p)) for p in parts]  # parts travel between ranks pickled
    meta = fmt.Meta({"t": fmt.TableMeta(2, "float32", (), 14)}, {"w": fmt.DenseMeta((2, 3), "float32")}, (), ())
    index = fmt.merge_parts(parts[::-1], step=3, meta=meta, partition=fmt.Partition("mix64", 3), world_size=3)
    index = index.with_files({"model.pt": fmt.FileEntry(10, 0, 12345)})
    data = index_mod.dumps(index)
    assert index_mod.parse(data, "x") == index and index_mod.dumps(index_mod.parse(data, "x")) == data
    assert [c.rows for c in index.tensor("t@id").chunks] == [(0, 5), (5, 5), (5, 14)]
    assert [c.buckets for c in index.tensor("t@id").chunks] == [fmt.BucketRange(r, (0, n)) for r, n in
                                                                 enumerate([5, 0, 9])]
    assert index.io_state_count == 3  # the meta does not say: the world size
    with pytest.raises(dataclasses.FrozenInstanceError):
        index.step = 4  # type: ignore[misc]
    scalars = [fmt.write_shards(str(tmp_path), {"s": torch.tensor(r)}, rank=r, prefix="scalar") for r in range(2)]
    with pytest.raises(recsave.errors.UsageError, match="differs between ranks"):  # a 0-d tensor in two parts
        fmt.merge_parts(scalars)


def unsealed(data: bytes) -> dict:
    """The JSON value of index bytes recsave wrote, which end with their seal, less the seal."""
    raw = json.loads(data)
    assert data.endswith(b',"%s":%d}' % (seal.KEY.encode(), raw.pop(seal.KEY)))
    return raw


def test_corpus_index_parses_to_the_same_json():
    """The corpus index is pretty-printed with sorted keys, so only its JSON value comes back; what
    recsave dumps is a fixed point."""
    data = CORPUS_INDEX.read_bytes()
    index = index_mod.parse(data, str(CORPUS_INDEX))
    dumped = index_mod.dumps(index)
    assert unsealed(dumped) == json.loads(data)  # the corpus predates seals: it has none
    assert index_mod.dumps(index_mod.parse(dumped, "again")) == dumped
    assert index.meta is None and index.io_state_count == 2 and index.table_names() == []
    assert index.partition == fmt.Partition("mix64", 8) and index.step == 7
    (step,) = index.tensor("step").chunks
    assert step.rows is None and step.first_row == 0 and step.segment_bounds() == [(0, 8)]
    assert index.tensor("ids").chunks[0].buckets == fmt.BucketRange(1, (0, 1, 1, 3))
    assert index.tensor("c").chunks[0].segment_bounds() == [(0, 5), (5, 16), (16, 32)]
    with pytest.raises(CorruptCheckpointError, match="meta does not describe"):
        contents.of_index(index, str(CORPUS_INDEX))


def test_corpus_version_3_index_parses_to_the_same_json():
    """The hand-built version 3 index (tests/corpus/valid_v3, written from docs/FORMAT.md with struct
    and base64): recsave reads its shared ranges and packed CRCs and writes them back the same."""
    path = CORPUS_INDEX.parent.parent / "valid_v3" / "index"
    data = path.read_bytes()
    index = index_mod.parse(data, str(path))
    assert index.format_version == 3 and unsealed(index_mod.dumps(index)) == json.loads(data)
    ids, score = index.tensor("ids").chunks[0], index.tensor("ids_score").chunks[0]
    assert ids.buckets == fmt.BucketRange(1, (0, 1, 1, 3)) and score.buckets is ids.buckets
    assert len(index.tensor("emb").chunks[0].crc32c) == 3  # 36 bytes in 16-byte segments


def test_meta_is_validated_at_parse_time():
    raw = json.loads(CORPUS_INDEX.read_bytes())
    raw["meta"] = {"tables": {}, "dense": {"w": {"shape": [2], "dtype": "float32"}}, "extras": ["opt"],
                   "io_states": []}
    assert index_mod.validate(copy.deepcopy(raw), "ok").meta == fmt.Meta({}, {"w": fmt.DenseMeta((2,), "float32")},
                                                                        ("opt",), ())
    damage = {
        "partial": ({"tables": {}, "dense": {}}, r"missing \['extras', 'io_states'\]"),
        "table lacks tensors": ({"tables": {"emb": {"dim": 3, "dtype": "float32", "slots": []}}},
                                "lacks its tensor emb@id"),
        "dim not an int": ({"tables": {"emb": {"dim": "3", "dtype": "float32", "slots": []}}}, "dim of table"),
        "slots not names": ({"tables": {"emb": {"dim": 3, "dtype": "float32", "slots": [1]}}}, "slots of table"),
        "bad dense shape": ({"dense": {"w": {"shape": [-1], "dtype": "float32"}}}, "shape dimension"),
        "bad io_state_count": ({"io_state_count": 0}, "io_state_count"),
    }
    for what, (change, message) in damage.items():
        bad = copy.deepcopy(raw)
        bad["meta"].update(change)
        if what == "partial":
            bad["meta"] = change
        with pytest.raises(CorruptCheckpointError, match=message):
            index_mod.validate(bad, what)


@pytest.mark.parametrize("kind", ["uniform", "uniform_tail", "empty", "explicit", "explicit_empty", "buckets"])
def test_segment_arrays_list_the_checked_segments(kind):
    """A whole-tensor read plans from Chunk.segment_arrays: the same (begin, end, crc32c) triples as
    checked_segments, for every way a chunk describes its segments."""
    from recsave.format.segments import BucketSegments
    base = {"file": "f", "offset": 0}
    chunk = {
        "uniform": fmt.Chunk(**base, length=96, crc32c=(1, 2, 3), segment_bytes=32),
        "uniform_tail": fmt.Chunk(**base, length=70, crc32c=(1, 2, 3), segment_bytes=32),
        "empty": fmt.Chunk(**base, length=0, crc32c=(7,), segment_bytes=32),
        "explicit": fmt.Chunk(**base, length=32, crc32c=(4, 5, 6), segments=(5, 16, 32)),
        "explicit_empty": fmt.Chunk(**base, length=0, crc32c=(9,), segments=(0,)),
        "buckets": fmt.Chunk(**base, length=8 * 40, crc32c=(), rows=(0, 40),
                             buckets=fmt.BucketRange(0, (0, 3, 3, 20, 21, 40)),
                             bucket_segments=BucketSegments(step=64, min_bytes=16)),
    }[kind]
    if kind == "buckets":  # one CRC per segment, as an index holds them
        chunk = dataclasses.replace(chunk, crc32c=tuple(range(10, 10 + len(chunk.segment_bounds()))))
        assert len(chunk.crc32c) > 3
    begins, ends, crcs = chunk.segment_arrays()
    assert (begins.dtype, ends.dtype, crcs.dtype) == (np.uint64, np.uint64, np.uint32)
    expected = list(chunk.checked_segments())
    assert list(zip(begins.tolist(), ends.tolist(), crcs.tolist())) == expected
    assert len(expected) == len(chunk.crc32c) and expected[-1][1] == chunk.length
