"""The files a source looked at when it opened, as they were then (`Storage.ukey`: size, mtime and
inode locally, the ETag on an object store). A source that reads by path again later (a table at a
time, or ids then values) checks them after each read: a file written again in between would give
one load rows of two versions, or ids the rows of others."""
from __future__ import annotations

from typing import Dict, Iterable, Optional

from recsave.errors import ConfigError
from recsave.storage import Storage


class OpenedFiles:
    """Records files' ukeys at a source's open; check() refuses a file changed since."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._ukeys: Dict[str, Optional[str]] = {}

    def record(self, path: str, *, may_be_missing: bool = False) -> Optional[str]:
        """`path`'s ukey now, remembered (None for a missing file, with `may_be_missing`: a read
        names it as damage, and one that appears later reads as changed)."""
        ukey = _ukey_or_none(self._storage, path) if may_be_missing else self._storage.ukey(path)
        self._ukeys[path] = ukey
        return ukey

    def check(self, paths: Optional[Iterable[str]] = None) -> None:
        """ConfigError naming the first of `paths` (default: every file recorded; one never recorded
        is skipped) that is no longer as recorded."""
        for path in self._ukeys if paths is None else paths:
            if path in self._ukeys and _ukey_or_none(self._storage, path) != self._ukeys[path]:
                raise ConfigError(f"{path}: the file changed since it was opened (written again while it was "
                                  f"read); plan the load again", path=path)


def _ukey_or_none(storage: Storage, path: str) -> Optional[str]:
    try:
        return storage.ukey(path)
    except FileNotFoundError:
        return None
