"""The load side of the Saver facade (save/saver.py): loading the newest loadable checkpoint of an
output dir (``Saver.load(fallback=True)``) and, after a load, whether the next incremental save
can be relative to the checkpoint loaded (docs/FORMAT.md section 10).

Kept apart so saver.py stays about the facade's arguments and the save path; the loads themselves
are load/'s (load/execute.py).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch

from recsave.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    OverLimitError,
    RankFailedError,
)
from recsave.format import ckptlist
from recsave.format import index as index_mod
from recsave.load import contents
from recsave.load.execute import load_entries
from recsave.load.plan import LoadTarget
from recsave.load.report import LoadReport
from recsave.save import delta
from recsave.storage import Storage, dist, get_storage

_DAMAGE = (CorruptCheckpointError, CheckpointNotFoundError, FormatVersionError)


def load_with_fallback(target: LoadTarget, conf: Dict[str, Any], shard_id: Optional[int],
                       committed: Callable[[str], ckptlist.Listing], damaged: Optional[Set[str]],
                       alone: bool = False) -> LoadReport:
    """Loads the newest loadable committed checkpoint of the output dir conf["path"], warning (at
    the caller of Saver.load) about each one skipped. `committed(path)` lists an output dir's
    committed checkpoints; the ids found damaged are added to `damaged` (None: not recorded, for
    an output dir other than the Saver's) so that the next save of such an id replaces it.
    `alone`: this process loads whole tables as rank 0 of 1, with no collective (shard_num=1)."""
    path = conf["path"]
    st = get_storage(path)
    rank, world = (0, 1) if alone else dist.resolve_for_exchange(shard_id)
    # Every rank looks at its own storage (per-rank copies of an output dir): a rank that fails to
    # read its list (or whose shard_id is refused) must not go on to the loads' collectives alone.
    # One exchange of a few bytes: any rank's failure raises on all. (Copies that list different
    # ids are the loads' to reconcile: a checkpoint one rank lacks fails on it as damage, and every
    # rank skips it alike.)

    def candidates() -> Tuple[str, Tuple[str, ...]]:
        if not alone:
            dist.require_own_rank(shard_id, "load")
        return _candidates(st, path, committed)
    found = dist.run_everywhere(f"listing the checkpoints of {path}", candidates, world, rank=rank)
    assert found is not None  # every rank ran _candidates
    kind, listed = found
    if kind != "output dir":  # a checkpoint directory, or not an output dir: loaded (or refused) as given
        return load_entries(target, [conf], shard_id=shard_id, alone=alone)
    ids = list(listed)
    for n, ckpt_id in enumerate(reversed(ids)):
        try:
            return load_entries(target, [conf], shard_id=shard_id, ckpt_id=ckpt_id, alone=alone)
        except (*_DAMAGE, RankFailedError) as exc:
            # With several ranks one rank may find damage in its share while the others learn of it
            # as RankFailedError: every rank skips, or every rank raises, on the same facts (all
            # ranks' failures, which each of them knows), else they would load different checkpoints.
            if not dist.failed_only_with(exc, _DAMAGE):
                raise
            if dist.failed_anywhere_with(exc, (OverLimitError,)):
                # An index over the knob max_index_bytes here may be intact (a job that raised the
                # knob wrote it): not damage, never skipped, and so never replaced by a later save.
                raise
            version = ckptlist.newer_format_version(st, path, ckpt_id)
            if version is not None:  # intact, written by a newer recsave: not damage, never skipped
                raise FormatVersionError(
                    f"{st.join(path, ckpt_id)} was written by a newer recsave (format_version "
                    f"{version}); upgrade recsave, or restore an explicit older step with "
                    f"restore(global_step=...) (Saver.load(ckpt_id=...))", path=st.join(path, ckpt_id)) from exc
            # Anything else is damage, a version no recsave writes included (e.g. a flipped byte).
            if damaged is not None:  # the next save of this id replaces it (a job that starts afresh)
                damaged.add(ckpt_id)
            if n == len(ids) - 1:
                warnings.warn(f"every committed checkpoint of {path} was tried and none can be loaded "
                              f"({', '.join(reversed(ids))}); the error of the oldest follows",
                              RuntimeWarning, stacklevel=3)
                raise
            warnings.warn(f"{st.join(path, ckpt_id)} cannot be loaded ({type(exc).__name__}: {exc}); "
                          f"falling back to the previous committed checkpoint "
                          f"{st.join(path, ids[-n - 2])}", RuntimeWarning, stacklevel=3)
    return load_entries(target, [conf], shard_id=shard_id, alone=alone)  # no ids: raises not found


def _candidates(st: Storage, path: str, committed: Callable[[str], ckptlist.Listing]
                ) -> Tuple[str, Tuple[str, ...]]:
    """What a fallback load finds at `path`: ("checkpoint", ()) for a checkpoint directory, ("output
    dir", its committed ids) for an output dir, ("other", ()) for anything else."""
    if st.exists(st.join(path, index_mod.INDEX_FILE)):
        return "checkpoint", ()
    listing = committed(path)
    return ("output dir", tuple(listing.ids)) if listing.found else ("other", ())


def baseline_after_load(model: torch.nn.Module, report: LoadReport, conf: Dict[str, Any], storage: Storage,
                        output_dir: str) -> Optional[delta.Baseline]:
    """After a restore of every table (all its columns, cleared first, under its own name) from
    one of `output_dir`'s checkpoints, the next delta can be relative to it: every table's change
    baseline moves to now and the Baseline is returned. Otherwise None (the next save is full)."""
    if len(report.checkpoints) != 1 or conf.get("hashtable_clear", True) is not True or conf.get("oname"):
        return None
    # A table a load may pad, truncate or cast no longer holds the checkpoint's rows: a delta of it
    # would mix its rows with the checkpoint's unchanged ones of another width or dtype. (Without
    # these policies a differing dim or dtype is an error, so the tables match the checkpoint.)
    if conf.get("dim_policy", "error") != "error" or conf.get("dtype_policy", "error") != "error":
        return None
    # Both through split: it normalises a local path (a relative output_dir, "./run", a trailing
    # slash) as the report's path already is.
    out_dir, ckpt_id = storage.split(report.checkpoints[0])
    if storage.split(storage.join(output_dir, ckpt_id))[0] != out_dir:
        return None
    tables, _ = contents.model_state(model)
    for name, table in tables.items():
        for column in [name] + [f"{name}@{s}" for s in table.slot_names()]:
            item = report.loaded.get(column)
            if item is None or item.category not in ("sparse", "sparse_opt") or item.source != column:
                return None

    if not all(delta.tracks_changes(t) for t in tables.values()):
        return None
    # The share of the checkpoint the load read: one rank's buckets leave each table partitioned
    # (the same for every table of one load), whole tables leave none.
    shares = {(p[0], p[1]) if (p := t.partition) is not None else (0, 1) for t in tables.values()}
    if len(shares) != 1 and tables:
        return None
    for table in tables.values():
        table.reset_changes()  # type: ignore[attr-defined]
    return delta.Baseline.of(ckpt_id, tables, shares.pop() if shares else (0, 1))
