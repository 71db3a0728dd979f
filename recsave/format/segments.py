"""Checksum segments cut at bucket boundaries (docs/FORMAT.md section 3, `bucket_segments`).

A Saver writes a table's rows in bucket order and cuts their checksum segments at bucket
boundaries, so that a reader with another world size reads only the buckets it owns. Those cuts
follow one rule given the chunk's bucket row starts; a format_version 4 index names the rule
instead of listing every segment end (the ends took about 40 % of a 1000-rank index)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple


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
    `[row_starts[i], row_starts[i + 1])` of `row_bytes` each; a chunk of 0 bytes has one end, 0."""
    total = row_starts[-1] * row_bytes
    if total == 0:
        return (0,)
    step, min_bytes = rule.step, rule.min_bytes
    out = []
    begin = 0
    for boundary in [r * row_bytes for r in row_starts[1:]]:
        while boundary - begin > step:
            begin += step
            out.append(begin)
        if boundary > begin and (boundary - begin >= min_bytes or boundary == total):
            out.append(boundary)
            begin = boundary
    if not out or out[-1] != total:
        out.append(total)
    return tuple(out)


def count(row_starts: Sequence[int], row_bytes: int, rule: BucketSegments) -> int:
    """len(ends(...)) without listing them: the steps inside a stretch are counted, not walked, so
    a hostile index (step 1 over gigabytes) costs a pass over its buckets, nothing more."""
    total = row_starts[-1] * row_bytes
    if total == 0:
        return 1
    step, min_bytes = rule.step, rule.min_bytes
    n = 0
    begin = 0
    for r in row_starts[1:]:
        boundary = r * row_bytes
        gap = boundary - begin
        if gap > step:
            inner = (gap - 1) // step  # the cuts that leave at most `step` bytes before the boundary
            begin += inner * step
            n += inner
        if boundary > begin and (boundary - begin >= min_bytes or boundary == total):
            n += 1
            begin = boundary
    return n if n and begin == total else n + 1
