"""The `checkpoint` file of an output directory: committed checkpoint ids, oldest first."""
from __future__ import annotations

import json
import re
from typing import List, Optional

from recsave import knobs
from recsave.errors import CorruptCheckpointError, RecsaveError, UsageError
from recsave.format.checks import is_plain_name
from recsave.format.index import FORMAT_VERSION, INDEX_FILE
from recsave.storage import Storage
from recsave.storage.lock import LOCK_FILE

LIST_FILE = "checkpoint"
MAX_LIST_BYTES = 16 << 20


def validate_id(ckpt_id: object) -> str:
    """A checkpoint id is a plain directory name (docs/FORMAT.md section 1)."""
    if not isinstance(ckpt_id, str) or not is_plain_name(ckpt_id) or ckpt_id == LIST_FILE:
        raise UsageError(f"checkpoint id {ckpt_id!r} is not usable: use letters, digits, '_', '.', '-' "
                         f"(no path separators, not '.', '..' or {LIST_FILE!r}), e.g. 'ckpt_1000'")
    return ckpt_id


def read(storage: Storage, output_dir: str) -> List[str]:
    """Committed ids, oldest first; [] when there is no `checkpoint` file."""
    path = storage.join(output_dir, LIST_FILE)
    if not storage.exists(path):
        return []
    raw = storage.read_bytes(path, MAX_LIST_BYTES)
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"{path}: not UTF-8 text; repair or delete it", path=path) from None
    ids: List[str] = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        if not is_plain_name(line) or line == LIST_FILE:
            raise CorruptCheckpointError(
                f"{path}: line {n} {line!r} is not a checkpoint id (plain directory names only; "
                f"'..' and paths are refused); repair the file", path=path)
        if line in ids:  # a repeated id counts where it appears last (the last line is the latest)
            ids.remove(line)
        ids.append(line)
    return ids


def write(storage: Storage, output_dir: str, ids: List[str]) -> None:
    """Replaces the `checkpoint` file atomically (temp + rename locally, one put remotely)."""
    storage.write_atomic(storage.join(output_dir, LIST_FILE), "".join(f"{i}\n" for i in ids).encode())


# Files a recsave checkpoint directory may hold (temporary names of interrupted writes included).
_OWN_FILE = re.compile(r"(index|model\.pt|extra\.pt|io_state_count|io_state_\d+\.pt|"
                       r"sparse-\d+-\d+\.safetensors)(\.tmp-[0-9-]+)?\Z")


def looks_like_checkpoint(storage: Storage, output_dir: str, name: str) -> bool:
    """Whether output_dir/name is a recsave checkpoint directory (committed or a crash leftover):
    a valid id holding only files recsave writes (at least one). Anything else — other files, empty
    directories — is left alone."""
    if not is_plain_name(name) or name == LIST_FILE:
        return False
    path = storage.join(output_dir, name)
    if not storage.isdir(path):
        return False
    files = storage.listdir(path)
    return bool(files) and all(_OWN_FILE.match(f) for f in files)


def newer_format_version(storage: Storage, output_dir: str, name: str) -> Optional[int]:
    """The format_version of checkpoint output_dir/name when a newer recsave wrote it (higher than
    the one this recsave reads), else None (also when it has no readable index). Such a checkpoint
    is intact, only unreadable here: it is never deleted, replaced or treated as damaged."""
    path = storage.join(output_dir, name, INDEX_FILE)
    try:
        if not storage.exists(path):
            return None
        version = json.loads(storage.read_bytes(path, knobs.get("max_index_bytes")).decode("utf-8")).get(
            "format_version")
    except (RecsaveError, OSError, ValueError, AttributeError):  # unreadable or not an object: not newer
        return None
    if type(version) is int and version > FORMAT_VERSION:
        return version
    return None


def collect_garbage(storage: Storage, output_dir: str, keep: List[str]) -> List[str]:
    """Removes checkpoint directories of output_dir not in `keep` (pruned ones and leftovers of
    crashed saves); returns their names. Other files and directories, and checkpoints written by a
    newer recsave (newer_format_version), are never touched."""
    removed = []
    for name in storage.listdir(output_dir):
        if name not in keep and looks_like_checkpoint(storage, output_dir, name) \
                and newer_format_version(storage, output_dir, name) is None:
            storage.remove_tree(storage.join(output_dir, name))
            removed.append(name)
    return removed


# Temporary names recsave's writers leave when a process dies mid-write: Storage.open_write's
# ``<file>.tmp-<pid>`` (the `checkpoint` list, the writer lock's renewal, index, .pt files) and the
# engine's ``<shard>.tmp-<pid>-<n>``.
_OUTPUT_DIR_TEMP = re.compile(rf"({LIST_FILE}|{re.escape(LOCK_FILE)})\.tmp-[0-9-]+\Z")
_TEMP_SUFFIX = re.compile(r"\.tmp-[0-9-]+\Z")


def remove_temp_files(storage: Storage, output_dir: str) -> List[str]:
    """Removes the temporary files of interrupted writes from output_dir and from its checkpoint
    directories (looks_like_checkpoint: only recsave's files inside); returns their paths relative
    to output_dir. Committed files, other files and checkpoints written by a newer recsave are never
    touched. The caller must hold the writer lock: a save in progress has such files too."""
    removed = []
    for name in storage.listdir(output_dir):
        if _OUTPUT_DIR_TEMP.match(name):
            storage.remove_file(storage.join(output_dir, name))
            removed.append(name)
        elif looks_like_checkpoint(storage, output_dir, name) \
                and newer_format_version(storage, output_dir, name) is None:
            ckpt_dir = storage.join(output_dir, name)
            for fname in storage.listdir(ckpt_dir):
                if _TEMP_SUFFIX.search(fname) and _OWN_FILE.match(fname):
                    storage.remove_file(storage.join(ckpt_dir, fname))
                    removed.append(f"{name}/{fname}")
    return sorted(removed)
