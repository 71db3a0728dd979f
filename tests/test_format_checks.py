"""Validators of values read from an index: long integer lists are checked in bulk, and every kind of
bad entry is still refused with a message naming the value."""
import base64
import copy
import json
import struct

import pytest
import torch

from recsave import format as fmt
from recsave.errors import CorruptCheckpointError
from recsave.format import checks
from recsave.format import index as index_mod
from recsave.format.pycrc32c import crc32c
from recsave.format.records import BucketRange, pack_crcs, unpack_crcs
from recsave.format.segments import BucketSegments


def test_valid_long_lists_pass_unchanged():
    values = list(range(0, 300000, 3))
    assert checks.as_ints(values, "v", "p", increasing="strictly") is values
    assert checks.as_ints([0, 0, 5, 5], "v", "p", hi=5, increasing="weakly") == [0, 0, 5, 5]
    assert checks.as_ints([], "v", "p") == []
    assert checks.as_ints([0xFFFFFFFF, 0], "crc", "p", hi=0xFFFFFFFF) == [0xFFFFFFFF, 0]
    short = [0, 1, 1, 7]
    assert checks.as_ints(short, "v", "p", increasing="weakly") is short


@pytest.mark.parametrize("values,kwargs,message", [
    ("1,2", {}, "must be a list"),
    ([1, True, 3], {}, "found True"),
    ([1, 2.0], {}, "found 2.0"),
    ([1, "2"], {}, "found '2'"),
    ([1, -1], {}, "found -1"),
    ([1, 2 ** 32], {"hi": 0xFFFFFFFF}, "found 4294967296"),
    ([1, 2 ** 70], {}, "found 1180591620717411303424"),
    ([1, 3, 3], {"increasing": "strictly"}, "found 3 then 3"),
    ([1, 3, 2], {"increasing": "weakly"}, "found 3 then 2"),
    # long lists take the bulk (numpy) check, short ones a loop: both refuse
    (list(range(100)) + [99], {"increasing": "strictly"}, "found 99 then 99"),
    (list(range(100)) + [50], {"increasing": "weakly"}, "found 99 then 50"),
])
def test_bad_lists_are_corrupt_and_named(values, kwargs, message):
    with pytest.raises(CorruptCheckpointError, match=message) as err:
        checks.as_ints(values, "value", "/ck/index", "t@x", **kwargs)
    assert err.value.path == "/ck/index" and err.value.key == "t@x"


def _written_index(tmp_path):
    """The JSON object a reader decodes for a one-chunk tensor with bucket ranges and explicit
    segments (format_version 3: the ranges listed once in `bucket_ranges`, the CRCs packed)."""
    part = fmt.write_shards(str(tmp_path), {"x": torch.arange(40.0).view(10, 4)}, segments={"x": [32, 96, 160]},
                            chunk_meta={"x": {"buckets": {"first": 0, "row_starts": [0, 2, 2, 10]}}})
    return json.loads(index_mod.dumps(fmt.merge_parts([part])))


def _refused(index, damage):
    for what, (change, message) in damage.items():
        bad = copy.deepcopy(index)
        change(bad)
        with pytest.raises(CorruptCheckpointError, match=message):
            index_mod.validate(bad, what)


def test_bucket_and_segment_lists_of_a_written_index_are_validated(tmp_path):
    index = _written_index(tmp_path)
    assert index["format_version"] == 3 and index["bucket_ranges"] == [{"first": 0, "row_starts": [0, 2, 2, 10]}]
    x = index_mod.validate(copy.deepcopy(index), "ok").tensor("x")
    assert x.chunks[0].segments == (32, 96, 160) and x.chunks[0].buckets == BucketRange(0, (0, 2, 2, 10))
    chunk = lambda ix: ix["tensors"]["x"]["chunks"][0]  # noqa: E731
    ranges = lambda ix: ix["bucket_ranges"][0]  # noqa: E731
    _refused(index, {
        "bucket start decreasing": (lambda ix: ranges(ix).update(row_starts=[0, 3, 2, 10]), "found 3 then 2"),
        "bucket start not 0": (lambda ix: ranges(ix).update(row_starts=[1, 2, 10]), "begin at 0"),
        "bucket start past rows": (lambda ix: ranges(ix).update(row_starts=[0, 11]),
                                   "ends at row 11, the chunk has 10"),
        "buckets short": (lambda ix: ranges(ix).update(row_starts=[0, 9]), "ends at row 9, the chunk has 10"),
        "ranges not a list": (lambda ix: ix.update(bucket_ranges={}), "needs a 'bucket_ranges' list"),
        "ranges absent": (lambda ix: ix.pop("bucket_ranges"), "needs a 'bucket_ranges' list"),
        "range not an object": (lambda ix: ix["bucket_ranges"].__setitem__(0, [0, 10]), r"bucket_ranges\[0\] must be"),
        "reference past the list": (lambda ix: chunk(ix).update(buckets=1), r"position in 'bucket_ranges' \(0 to 0\)"),
        "reference not an int": (lambda ix: chunk(ix).update(buckets=True), "found True"),
        "ranges inline in version 3": (lambda ix: chunk(ix).update(buckets=ranges(ix)), "position in 'bucket_ranges'"),
        "segment end 0": (lambda ix: chunk(ix).update(segments=[0, 96, 160]), "strictly increasing from 0"),
        "segments repeat": (lambda ix: chunk(ix).update(segments=[32, 32, 160]), "found 32 then 32"),
        "segments short": (lambda ix: chunk(ix).update(segments=[32, 96, 150]), "segments end at 150"),
        "crc not text": (lambda ix: chunk(ix).update(crc32c=[1, 2, 3]), "crc32c must be base64"),
        "crc not base64": (lambda ix: chunk(ix).update(crc32c="AAAA*AAA"), "crc32c must be base64"),
        "crc not whole values": (lambda ix: chunk(ix).update(crc32c="AAAAAAA="), "crc32c must be base64"),
        "a crc short": (lambda ix: chunk(ix).update(crc32c=pack_crcs([1, 2])), "2 crc32c values for 3 segments"),
    })
    packed = chunk(index)["crc32c"]
    crcs = index_mod.validate(copy.deepcopy(index), "ok").tensor("x").chunks[0].crc32c
    assert packed == base64.b64encode(struct.pack("<3I", *crcs)).decode() and len(packed) == 16


def test_bucket_lists_of_a_version_1_index_are_validated(tmp_path):
    """Indexes written before format_version 3 hold each chunk's ranges inline; still read and checked."""
    index = _written_index(tmp_path)
    chunk = lambda ix: ix["tensors"]["x"]["chunks"][0]  # noqa: E731
    chunk(index)["buckets"] = index.pop("bucket_ranges")[0]
    chunk(index)["crc32c"] = list(struct.unpack("<3I", base64.b64decode(chunk(index)["crc32c"])))
    index["format_version"] = 1
    assert index_mod.validate(copy.deepcopy(index), "ok").tensor("x").chunks[0].buckets == BucketRange(0, (0, 2, 2, 10))
    _refused(index, {
        "bucket start decreasing": (lambda ix: chunk(ix)["buckets"].update(row_starts=[0, 3, 2, 10]), "found 3 then 2"),
        "bucket start not 0": (lambda ix: chunk(ix)["buckets"].update(row_starts=[1, 2, 10]), "begin at 0"),
        "bucket start past rows": (lambda ix: chunk(ix)["buckets"].update(row_starts=[0, 11]), "found 11"),
        "buckets short": (lambda ix: chunk(ix)["buckets"].update(row_starts=[0, 9]), "end at the chunk's 10 rows"),
        "a reference in version 1": (lambda ix: chunk(ix).update(buckets=0), "chunk buckets must be"),
        "packed crcs in version 1": (lambda ix: chunk(ix).update(crc32c=pack_crcs(chunk(ix)["crc32c"])),
                                     "must be a list"),
        "crc not a list": (lambda ix: chunk(ix).update(crc32c=7), "must be a list"),
    })


def _rule_index(tmp_path):
    """A one-chunk tensor whose segments follow the bucket rule (format_version 4): rows of 16
    bytes in buckets of 2, 0 and 8 rows, a segment step of 3 rows and a minimum of one row."""
    part = fmt.write_shards(str(tmp_path), {"x": torch.arange(40.0).view(10, 4)},
                            segments={"x": BucketSegments(48, 16)},
                            chunk_meta={"x": {"buckets": {"first": 0, "row_starts": [0, 2, 2, 10]}}})
    return json.loads(index_mod.dumps(fmt.merge_parts([part])))


def test_bucket_rule_segments_are_named_not_listed_and_validated(tmp_path):
    index = _rule_index(tmp_path)
    chunk = lambda ix: ix["tensors"]["x"]["chunks"][0]  # noqa: E731
    assert index["format_version"] == 4 and index["bucket_ranges"] == [{"first": 0, "row_starts": [0, 2, 2, 10]}]
    assert chunk(index)["bucket_segments"] == {"step": 48, "min": 16} and "segments" not in chunk(index)
    parsed = index_mod.validate(copy.deepcopy(index), "ok").tensor("x").chunks[0]
    # the bucket at 32 bytes, then steps of 48 inside the 128-byte bucket, and its end
    assert parsed.segment_ends() == (32, 80, 128, 160)
    assert parsed.segment_bounds() == [(0, 32), (32, 80), (80, 128), (128, 160)]
    data = torch.arange(40.0).view(10, 4).numpy().tobytes()
    assert [c for _, _, c in parsed.checked_segments()] == [crc32c(data[b:e]) for b, e in parsed.segment_bounds()]
    assert torch.equal(fmt.read_tensors(str(tmp_path), index=index_mod.validate(index, "ok"))["x"],
                       torch.arange(40.0).view(10, 4))
    _refused(index, {
        "rule in version 3": (lambda ix: ix.update(format_version=3), "bucket_segments needs format_version 4"),
        "rule without buckets": (lambda ix: chunk(ix).pop("buckets"), "bucket_segments needs format_version 4"),
        "rule and ends": (lambda ix: chunk(ix).update(segments=[32, 80, 128, 160]), "exactly one of"),
        "rule and uniform": (lambda ix: chunk(ix).update(segment_bytes=48), "exactly one of"),
        "no form at all": (lambda ix: chunk(ix).pop("bucket_segments"), "exactly one of"),
        "step 0": (lambda ix: chunk(ix)["bucket_segments"].update(step=0), "step must be an integer in"),
        "step not an int": (lambda ix: chunk(ix)["bucket_segments"].update(step=True), "found True"),
        "min negative": (lambda ix: chunk(ix)["bucket_segments"].update(min=-1), "min must be an integer in"),
        "unknown key": (lambda ix: chunk(ix)["bucket_segments"].update(max=1), "must be {'step': int"),
        "not an object": (lambda ix: chunk(ix).update(bucket_segments=[48, 16]), "must be {'step': int"),
        "a crc short": (lambda ix: chunk(ix).update(crc32c=pack_crcs([1, 2, 3])), "3 crc32c values for 4 segments"),
        # step 1 over the chunk would be 160 segments: counted, not listed
        "rule of other ends": (lambda ix: chunk(ix)["bucket_segments"].update(step=1), "4 crc32c values for 160"),
    })


def test_a_rule_checked_once_is_not_taken_for_a_bad_one(tmp_path):
    """The parser checks each distinct `bucket_segments` once; a bad value after a good one (step
    True after step 48, a list) is still refused, not matched to the good one."""
    index = _rule_index(tmp_path)
    for tensor in ("y", "z"):  # two more chunks naming the same rule, in files of their own
        index["tensors"][tensor] = copy.deepcopy(index["tensors"]["x"])
        index["files"][f"{tensor}.safetensors"] = dict(index["files"]["sparse-0-0.safetensors"])
        index["tensors"][tensor]["chunks"][0]["file"] = f"{tensor}.safetensors"
    index_mod.validate(copy.deepcopy(index), "ok")
    for bad, message in ((True, "found True"), ([48], "found \\[48\\]")):
        damaged = copy.deepcopy(index)
        damaged["tensors"]["z"]["chunks"][0]["bucket_segments"]["step"] = bad
        with pytest.raises(CorruptCheckpointError, match=message):
            index_mod.validate(damaged, "bad")


@pytest.mark.parametrize("text", ["AAAA*AAA", "AAAAAAA=", "AAAA AAAA", "AAAA\nAAAA", "AAAAAA==AAAA", "AAA", "é",
                                  "AAAA=AAA"])
def test_packed_crcs_are_decoded_strictly(text):
    """Only padded standard base64 of whole 4-byte values is read: no whitespace, data after the
    padding or other alphabet (FORMAT.md section 3)."""
    assert unpack_crcs(text) is None


def test_packed_crcs_round_trip():
    values = [0, 1, 0x12345678, 0xFFFFFFFF]
    assert pack_crcs(values) == base64.b64encode(struct.pack("<4I", *values)).decode()
    assert unpack_crcs(pack_crcs(values)) == tuple(values) and unpack_crcs("") == ()
