"""The index's own checksum (docs/FORMAT.md section 3, "The seal"): the last key of an index,
``"index_crc32c"``, holds the CRC32C of every byte before it.

Everything else in a checkpoint is covered by a CRC32C the index records; without a seal, damage
to the index itself that still parses and validates (a digit of `step` or of a metric, a renamed
`crc32c` key that leaves a file unchecked) would load silently. The key is written last, as the
exact text ``,"index_crc32c":N}``, so a reader can check the bytes before it without
re-serialising anything, and readers that do not know it ignore it (an optional top-level key).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from recsave import _C
from recsave.format import checks

KEY = "index_crc32c"
_OPEN = b',"' + KEY.encode() + b'":'


def seal(body: bytes) -> bytes:
    """`body` (a JSON object with at least one key, compact, without the seal) with the seal appended
    as its last key."""
    if not body.endswith(b"}") or body[:-1].rstrip() == b"{":
        raise ValueError("seal() needs a non-empty JSON object")
    head = memoryview(body)[:-1]
    return b"".join((head, _OPEN, str(int(_C.crc32c(head))).encode(), b"}"))


def intact(data: bytes) -> Optional[bool]:
    """From the bytes alone, without decoding them: True when `data` ends with a seal matching the
    CRC32C of the bytes before it, False when it ends with a seal that does not match, None when
    it ends with no seal (an index written before seals, or not an index: parse it to tell)."""
    at = data.rfind(_OPEN)
    if at < 0 or not data.endswith(b"}"):
        return None
    digits = data[at + len(_OPEN):-1]
    if not digits.isdigit() or len(digits) > 10 or str(int(digits)).encode() != digits:
        return None  # not as seal() writes it: check() would refuse it, a parse tells
    return int(_C.crc32c(memoryview(data)[:at])) == int(digits)


def check(data: bytes, index: Dict[str, Any], path: str) -> None:
    """Raises CorruptCheckpointError unless the decoded `index` (of the bytes `data`) has no seal (an
    index written before seals: nothing to check) or its seal is the last key, written as recsave
    writes it, and matches the CRC32C of the bytes before it."""
    if KEY not in index:
        return
    recorded = checks.as_int(index[KEY], KEY, path, hi=(1 << 32) - 1)
    tail = _OPEN + str(recorded).encode() + b"}"
    if not data.endswith(tail):
        raise checks.corrupt(path, f'"{KEY}" must close the index, written as ,"{KEY}":{recorded}}}')
    actual = int(_C.crc32c(memoryview(data)[:len(data) - len(tail)]))
    if actual != recorded:
        raise checks.corrupt(path, f"the index's bytes have CRC32C {actual}, not the {recorded} its "
                                   f'"{KEY}" records: the index was damaged or edited after it was written')
