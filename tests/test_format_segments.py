"""The bucket rule of checksum segments (recsave/format/segments.py, docs/FORMAT.md section 3): the
ends recsave computes, the count its parser checks without listing them, and the oracle's walk of the
spec agree on every shape of bucket ranges."""
import random

import pytest

from recsave.errors import CorruptCheckpointError, UsageError
from recsave.format import oracle, segments
from recsave.format.segments import BucketSegments


def _cases(seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        buckets = rng.choice([1, 2, 5, 64, 300])
        sizes = [rng.choice([0, 0, 1, 2, 7, 100, 5000]) for _ in range(buckets)]
        starts = [0]
        for s in sizes:
            starts.append(starts[-1] + s)
        row_bytes = rng.choice([1, 4, 8, 256, 260])
        step = rng.choice([1, row_bytes, 3 * row_bytes, 1000, 4096, 1 << 20])
        least = rng.choice([0, 1, row_bytes, 4096, 64 << 10])
        if starts[-1] * row_bytes // step > 20000:  # listed ends are the point here: keep them few
            continue
        yield tuple(starts), row_bytes, BucketSegments(step, least)


@pytest.mark.parametrize("seed", range(4))
def test_ends_count_and_the_oracle_agree(seed):
    for starts, row_bytes, rule in _cases(seed, 300):
        ends = segments.ends(starts, row_bytes, rule)
        total = starts[-1] * row_bytes
        assert segments.count(starts, row_bytes, rule) == len(ends)
        assert oracle._rule_ends(rule.to_json(), list(starts), row_bytes, len(ends), "p", "t") == list(ends)
        # ends rise strictly to the chunk's bytes (one end, 0, for an empty chunk)
        assert ends[-1] == total and all(a < b for a, b in zip(ends, ends[1:]))
        # each end is a bucket boundary or one step past the previous end, never more than a step on
        boundaries = {r * row_bytes for r in starts[1:]}
        for a, b in zip((0,) + ends, ends):
            assert b - a <= rule.step or total == 0
            assert b in boundaries or b == a + rule.step

def test_rule_for_steps_whole_rows():
    assert segments.rule_for(256, 4 << 20, 65536) == BucketSegments(4 << 20, 65536)
    assert segments.rule_for(260, 4 << 20, 0) == BucketSegments((4 << 20) // 260 * 260, 0)
    assert segments.rule_for(8 << 20, 4 << 20, 0).step == 8 << 20  # at least one row
    assert segments.rule_for(0, 1000, 0).step == 1000


def test_a_hostile_rule_is_counted_not_listed():
    """Step 1 over a terabyte: the parser's count is arithmetic, the oracle stops at the CRC count."""
    starts, rule = (0, 1 << 36, 1 << 37), BucketSegments(1, 0)
    assert segments.count(starts, 16, rule) == 1 << 41
    with pytest.raises(CorruptCheckpointError, match="more segments than the 3 crc32c values"):
        oracle._rule_ends(rule.to_json(), list(starts), 16, 3, "p", "t")


@pytest.mark.parametrize("starts, row_bytes, rule, what", [
    ((0, 5, 3), 8, BucketSegments(64, 0), "never decrease"),
    ((1, 5), 8, BucketSegments(64, 0), "beginning at 0"),
    ((), 8, BucketSegments(64, 0), "non-empty"),
    ((0, 5), 8, BucketSegments(0, 0), "step >= 1"),
    ((0, 1 << 60), 8, BucketSegments(1 << 20, 0), "2\\^62 bytes"),
])
def test_the_engine_refuses_what_no_chunk_has(starts, row_bytes, rule, what):
    """The walk runs in the engine on int64: inputs no validated index or save produces are refused
    by name, never wrapped around."""
    for fn in (segments.ends, segments.count):
        with pytest.raises(UsageError, match=what):
            fn(starts, row_bytes, rule)


def test_ends_near_the_largest_chunk():
    """A chunk of 2^62 bytes exactly: the step cuts are counted and the last end is the chunk's."""
    starts, rule = (0, 1 << 58, 1 << 59), BucketSegments(1 << 61, 0)
    assert segments.ends(starts, 8, rule) == (1 << 61, 1 << 62)
    assert segments.count(starts, 8, rule) == 2
