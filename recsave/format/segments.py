"""Checksum segments cut at bucket boundaries (docs/FORMAT.md section 3, `bucket_segments`).

A Saver writes a table's rows in bucket order and cuts their checksum segments at bucket
boundaries, so that a reader with another world size reads only the buckets it owns. Those cuts
follow one rule given the chunk's bucket row starts; a format_version 4 index names the rule
instead of listing every segment end (the ends took about 40 % of a 1000-rank index)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple

import numpy as np

from recsave import _C


@dataclass(frozen=True)
class BucketSegments:
    """The rule: a segment ends at a bucket boundary once it holds `min_bytes` (and at the chunk's
    end), and inside a long stretch every `step` bytes."""
    step: int
    min_bytes: int

    def to_json(self) -> Dict[str, Any]:
        return {"step": self.step, "min": self.min_bytes}


@functools.lru_cache(maxsize=64)  # one object per row size: a part pickled to rank 0 holds it once
def rule_for(row_bytes: int, max_bytes: int, min_bytes: int) -> BucketSegments:
    """The rule for rows of `row_bytes` and segments of about `max_bytes`: the step is a whole
    number of rows (at least one), so that every end lies on a row boundary and rows can be
    produced in blocks."""
    step = max_bytes if row_bytes <= 0 else max(row_bytes, max_bytes // row_bytes * row_bytes)
    return BucketSegments(step, min_bytes)


def row_bytes_of(row_starts: Sequence[int], length: int) -> int:
    """The rule's row size R of a chunk of `length` bytes whose buckets end at row
    `row_starts[-1]`: length / rows, 0 for a chunk of no rows (docs/FORMAT.md section 3)."""
    rows = row_starts[-1]
    return length // rows if rows else 0


@functools.lru_cache(maxsize=256)  # a table's tensors of one row size share the ends
def ends(row_starts: Tuple[int, ...], row_bytes: int, rule: BucketSegments) -> Tuple[int, ...]:
    """The segment ends (bytes, relative to the chunk) of a chunk whose bucket `i` holds rows
    `[row_starts[i], row_starts[i + 1])` of `row_bytes` each; a chunk of 0 bytes has one end, 0.

    Walking from the chunk's start: inside a stretch longer than `step`, a cut every `step` bytes;
    at a bucket boundary, a cut once the segment holds `min_bytes` (or the chunk ends there); a
    last cut at the chunk's end. One pass in the engine (csrc/core/segment_rule.cc): a save and an
    index read take it for every table, over thousands of buckets."""
    return tuple(end_array(row_starts, row_bytes, rule).tolist())


@functools.lru_cache(maxsize=256)  # as ends: a table's tensors of one row size share them
def end_array(row_starts: Tuple[int, ...], row_bytes: int, rule: BucketSegments) -> np.ndarray:
    """ends(...) as an int64 array, read-only (it is shared): a read plan takes thousands of them
    without a Python int each."""
    out = _C.bucket_segment_ends(row_starts, row_bytes, rule.step, rule.min_bytes)
    out.flags.writeable = False
    return out


def count(row_starts: Sequence[int], row_bytes: int, rule: BucketSegments) -> int:
    """len(ends(...)) without listing them: the steps inside a stretch are counted, not walked, so
    a hostile index (step 1 over gigabytes) costs a pass over its buckets, nothing more."""
    return int(_C.bucket_segment_count(row_starts, row_bytes, rule.step, rule.min_bytes))
