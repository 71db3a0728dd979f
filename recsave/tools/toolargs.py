"""Arguments shared by the export tools (tools/export.py Parquet export, tools/deltafeed.py delta
feed, tools/serving.py serving export): the `tables` selection, a fresh output directory, and
undoing what a failed export wrote."""
from __future__ import annotations

import contextlib
from typing import Any, List, Optional, Sequence

from recsave.argcheck import check
from recsave.errors import ConfigError, RecsaveError, UsageError
from recsave.format import ckptlist
from recsave.format.index import INDEX_FILE
from recsave.load.arrow import table_dir_name
from recsave.storage import Storage


def check_tables_arg(tables: Any, where: str) -> None:
    """`tables` is None, a table name or a list / tuple of names (ArgumentTypeError otherwise)."""
    if tables is not None and not isinstance(tables, str):
        check(tables, (list, tuple), "tables", where, optional=True, expected="a table name or a list of them")
        for name in tables:
            check(name, str, "tables", where, expected="a list of table names (str)")


def select_tables(tables: Any, available: Sequence[str], within: str, path: Optional[str] = None) -> List[str]:
    """The names `tables` selects (None: every one of `available`; repeats dropped, order kept).
    ConfigError for a name not in `available`, saying it is not `within` (e.g. "the checkpoint X")."""
    names = list(available) if tables is None else list(dict.fromkeys([tables] if isinstance(tables, str) else tables))
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ConfigError(f"no table(s) {unknown} in {within}; it has {sorted(available)}", path=path,
                          key=unknown[0])
    return names


def check_out_dir(storage: Storage, out_dir: str, manifest: str, names: Sequence[str], holds: str) -> str:
    """Refuses (UsageError) an `out_dir` that holds `holds` already (its file `manifest` exists) or a
    non-empty directory of one of the tables `names`: nothing is overwritten. Returns the path of
    the manifest to write."""
    manifest_path = storage.join(out_dir, manifest)
    if storage.exists(manifest_path):
        raise UsageError(f"{manifest_path} exists: {out_dir} holds {holds} already; remove it or write to "
                         f"another directory", path=manifest_path)
    for name in names:
        table_dir = storage.join(out_dir, table_dir_name(name))
        if storage.exists(table_dir) and (not storage.isdir(table_dir) or storage.listdir(table_dir)):
            raise UsageError(f"{table_dir} exists and is not empty; remove it or write to another directory "
                             f"(table {name!r} is never overwritten)", path=table_dir, key=name)
    return manifest_path


def missing_dirs(storage: Storage, path: str) -> List[str]:
    """`path` and those of its parents that do not exist yet, outermost first: what an export that
    makes `path` creates, and removes again (when empty) if it fails."""
    missing: List[str] = []
    while not storage.exists(path):
        missing.insert(0, path)
        parent, name = storage.split(path)
        if not name or parent == path:
            break
        path = parent
    return missing


def make_dir(storage: Storage, path: str, created: List[str]) -> None:
    """Makes directory `path` (and its parents), adding it to `created` when it is new: what
    undo_writes removes again (when empty) if the export fails."""
    if not storage.exists(path):
        created.append(path)
    storage.makedirs(path)


def undo_writes(storage: Storage, written: Sequence[str], created: Sequence[str]) -> None:
    """Removes what a failed export wrote, as far as it can (the export's error is what matters):
    the files `written`, then each directory of `created` (innermost first) that is empty now, so
    nothing another writer put there is touched."""
    for path in written:
        with contextlib.suppress(Exception):
            storage.remove_file(path)
    for path in reversed(created):
        with contextlib.suppress(Exception):
            storage.remove_empty_dir(path)


def refuse_source_dirs(src: Any, storage: Storage, dst: str, where: str, into: str,
                       output_dir: bool = True) -> None:
    """UsageError when `dst` (on `storage`) lies in the directory of recsave checkpoint `src`
    (rotating the checkpoint away would delete it) or, with `output_dir` (for a writer of
    checkpoints), is its output dir (what `where` commits there would become that training job's
    latest). `into` names what `where` writes, for the message (e.g. "a serving checkpoint")."""
    ckpt_dir = src.storage.canonical(src.ckpt_dir)
    target = storage.canonical(dst)
    if output_dir and target == src.storage.canonical(src.storage.split(src.ckpt_dir)[0]):
        raise UsageError(f"{where}: {dst} is the output dir of {src.ckpt_dir}; write to another directory "
                         f"({into} there would become the training job's latest)", path=dst)
    if target == ckpt_dir or target.startswith(ckpt_dir.rstrip("/") + "/"):
        raise UsageError(f"{where}: {dst} lies in the checkpoint {src.ckpt_dir}; write to another "
                         f"directory (rotating that checkpoint away would delete {into})", path=dst)
    host = _checkpoint_holding(storage, target)
    if host is not None:  # another checkpoint: its job's rotation and gc would never delete it again
        raise UsageError(f"{where}: {dst} is or lies in the checkpoint {host}; write to another directory "
                         f"({into} there would make {host} hold files recsave did not write)", path=dst)


def _checkpoint_holding(storage: Storage, path: str) -> Optional[str]:
    """The nearest of `path` and its parents that is a recsave checkpoint directory (holds a valid
    index, or one a newer recsave wrote), else None. The walk stops below a URL's root
    (`s3://bucket` is the last level asked: `s3://index` would be another owner's bucket), and at a
    level it may not read (a permission error is no checkpoint of this job's)."""
    for _ in range(256):  # deeper than any real path; a storage whose split never ends stops here
        if not path.rstrip("/"):  # the file system's root: split("") would be the working directory
            parent, name = "", ""
        else:
            parent, name = storage.split(path.rstrip("/"))
        try:
            if storage.exists(storage.join(path, INDEX_FILE)) and ckptlist.holds_valid_index(storage, parent, name):
                return path
        except (OSError, RecsaveError):
            return None
        if not parent or parent.endswith("://") or parent.rstrip("/") == path.rstrip("/"):
            return None
        path = parent
    return None
