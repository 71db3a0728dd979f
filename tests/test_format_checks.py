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
from recsave.format.records import BucketRange, pack_crcs


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
