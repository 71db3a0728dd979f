"""Validators of values read from an index: long integer lists are checked in bulk, and every kind of
bad entry is still refused with a message naming the value."""
import copy
import json

import pytest
import torch

from recsave import format as fmt
from recsave.errors import CorruptCheckpointError
from recsave.format import checks
from recsave.format import index as index_mod


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


def test_bucket_and_segment_lists_of_a_written_index_are_validated(tmp_path):
    part = fmt.write_shards(str(tmp_path), {"x": torch.arange(40.0).view(10, 4)}, segments={"x": [32, 96, 160]},
                            chunk_meta={"x": {"buckets": {"first": 0, "row_starts": [0, 2, 2, 10]}}})
    index = json.loads(index_mod.dumps(fmt.merge_parts([part])))  # the JSON object a reader decodes
    assert index_mod.validate(copy.deepcopy(index), "ok").tensor("x").chunks[0].segments == (32, 96, 160)
    chunk = lambda ix: ix["tensors"]["x"]["chunks"][0]  # noqa: E731
    damage = {
        "bucket start decreasing": (lambda c: c["buckets"].update(row_starts=[0, 3, 2, 10]), "found 3 then 2"),
        "bucket start not 0": (lambda c: c["buckets"].update(row_starts=[1, 2, 10]), "begin at 0"),
        "bucket start past rows": (lambda c: c["buckets"].update(row_starts=[0, 11]), "found 11"),
        "buckets short": (lambda c: c["buckets"].update(row_starts=[0, 9]), "end at the chunk's 10 rows"),
        "segment end 0": (lambda c: c.update(segments=[0, 96, 160]), "strictly increasing from 0"),
        "segments repeat": (lambda c: c.update(segments=[32, 32, 160]), "found 32 then 32"),
        "segments short": (lambda c: c.update(segments=[32, 96, 150]), "segments end at 150"),
        "crc not a list": (lambda c: c.update(crc32c=7), "must be a list"),
    }
    for what, (change, message) in damage.items():
        bad = copy.deepcopy(index)
        change(chunk(bad))
        with pytest.raises(CorruptCheckpointError, match=message):
            index_mod.validate(bad, what)
