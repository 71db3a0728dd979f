"""Index bytes read once for the length of one pass over an output dir (a repair): installed with
format/index.py `reading_through`, so that every index_mod.read_bytes of the pass (the list's
rebuild, the damage check, the chain's parents and CRC32Cs) shares one read of each index."""
from __future__ import annotations

import copy
from typing import Dict, Tuple, Union

from recsave.errors import CheckpointNotFoundError, CorruptCheckpointError
from recsave.storage import Storage

_Outcome = Union[bytes, CheckpointNotFoundError, CorruptCheckpointError]
DEFAULT_BUDGET = 128 << 20  # bytes of indexes remembered (a repair's peak memory stays bounded)


class ReadOnce:
    """An index bytes reader (`reading_through(ReadOnce().read)`) that reads each path once and
    answers later reads with the same bytes, or the same error: absent, over the limit, not a
    file. Only for a caller holding the writer lock, under which no index changes; a failed read
    (StorageError, maybe transient) is not remembered. Holds the bytes until it is dropped, up to
    `budget` bytes in all: an output dir of many checkpoints of thousand-rank indexes would
    otherwise hold them all at once, where a pass without it holds one; indexes past the budget
    are read again when asked again."""

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        self._got: Dict[Tuple[str, int], _Outcome] = {}
        self._room = budget

    def read(self, storage: Storage, path: str, limit: int) -> bytes:
        key = (path, limit)
        got = self._got.get(key)
        if got is None:
            try:
                got = storage.read_bytes(path, limit)
            except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
                got = exc.with_traceback(None)
            if isinstance(got, bytes) and len(got) > self._room:
                return got
            self._room -= len(got) if isinstance(got, bytes) else 0
            self._got[key] = got
        if isinstance(got, bytes):
            return got
        raise copy.copy(got)  # a fresh one each time: a raise adds to the traceback it carries
