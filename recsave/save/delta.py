"""Incremental (delta) saves (docs/FORMAT.md section 10): decide, on every rank alike, whether a save
can be a delta of the Saver's latest checkpoint, take each table's changes at the snapshot, and
turn the committed index into a delta's (kind, parent with its index CRC32C, base)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Collection, Dict, List, Mapping, Optional, Set, Tuple

import torch

from recsave.errors import RecsaveError, WriterLockedError
from recsave.format import chain
from recsave.format import index as index_mod
from recsave.format.records import KIND_DELTA, KIND_FULL, Index, Parent, version_for
from recsave.save.snapshot import Delta, SaveState, change_epoch
from recsave.storage import Storage, dist
from recsave.tables.tablelike import TableLike
from recsave.tables.tracking import TableChanges

log = logging.getLogger("recsave")


@dataclass(frozen=True)
class Baseline:
    """What a delta save is relative to: the checkpoint the Saver saved or restored last, and the
    change epoch each of its tables had right after (HashTable.change_epoch)."""
    ckpt_id: str
    epochs: Mapping[str, int]
    columns: Mapping[str, Tuple[str, ...]]  # per table: its slots then (a delta needs the same)
    # (rank, world) whose share of the checkpoint the tables held then: a delta saved by another
    # (rank, world) would be a share of other buckets' rows, and rows the tables never held (a
    # share-only load, then a whole-table save) would come back from the parent at restore.
    share: Tuple[int, int] = (0, 1)

    @classmethod
    def of(cls, ckpt_id: str, tables: Mapping[str, TableLike], share: Tuple[int, int]) -> "Baseline":
        """The baseline `ckpt_id` with the tables as they are now (epochs and slots), holding
        `share` = (rank, world) of it."""
        return cls(ckpt_id, {n: _epoch(t) for n, t in tables.items()},
                   {n: tuple(t.slot_names()) for n, t in tables.items()}, share)


def tracks_changes(table: TableLike) -> bool:
    """Whether the table has HashTable's change tracking (a TableLike need not)."""
    return all(callable(getattr(table, m, None)) for m in ("take_changes", "reset_changes"))


def _epoch(table: TableLike) -> int:
    epoch = change_epoch(table)
    return -1 if epoch is None else epoch


def why_full(tables: Mapping[str, TableLike], baseline: Optional[Baseline], storage: Storage,
             output_dir: str, rank: int = 0, known: Optional[chain.IndexIdentity] = None,
             world: int = 1) -> Optional[str]:
    """Why this rank cannot save a delta (None: it can), before the changes are taken. `known`: what
    this process committed as the baseline's index, if it did."""
    if baseline is None:
        return ("the change baseline is unknown (no save or restore by this Saver yet, a model-bank "
                "load or a failed save since)")
    if baseline.share != (rank, world):
        return (f"the tables held {_share(*baseline.share)} of {baseline.ckpt_id!r}, and this save writes "
                f"{_share(rank, world)}")
    if set(tables) != set(baseline.epochs):
        return f"the model's tables {sorted(tables)} are not those of {baseline.ckpt_id!r}"
    for name, table in tables.items():
        if tuple(table.slot_names()) != baseline.columns[name]:
            return f"the slots of table {name!r} changed since {baseline.ckpt_id!r}"
        if not tracks_changes(table):
            return f"table {name!r} does not track changes (a TableLike without take_changes)"
        if _epoch(table) != baseline.epochs[name]:
            return f"the change baseline of table {name!r} was moved by someone other than this Saver"
    # Rank 0 writes the index (other ranks may have output dirs of their own)
    return _parent_problem(storage, storage.join(output_dir, baseline.ckpt_id), known) if rank == 0 else None


def _share(rank: int, world: int) -> str:
    return f"rank {rank} of {world}'s share" if world > 1 else "whole tables"


def _parent_problem(storage: Storage, parent_dir: str, known: Optional[chain.IndexIdentity]) -> Optional[str]:
    """Why the checkpoint in parent_dir cannot be a delta's parent (None: it can): it must be
    committed and full or a delta (a serving export restored from is no chain member). An index
    this process committed (a full or a delta) and whose bytes are unchanged needs no parse."""
    try:
        if known is not None:
            if chain.index_crc(storage, parent_dir) == known.crc32c:
                return None
            # Another writer saved this id again (this Saver closed, or its lock was taken over):
            # a delta of the new index would restore rows this model never had.
            return f"the parent {parent_dir} was saved again by another writer since this Saver committed it"
        kind = index_mod.read(parent_dir, storage).kind
    except RecsaveError as exc:
        return f"the parent {parent_dir} cannot be read ({type(exc).__name__})"
    return None if kind in (KIND_FULL, KIND_DELTA) else f"the parent {parent_dir} is of kind {kind!r}"


@dataclass(frozen=True)
class Taken:
    """What take() decided: the deltas to write (None: a full save), the next baseline given the id
    the save commits as, and the changes taken for the tables the caller asked for (`want`)."""
    deltas: Optional[Dict[str, Delta]]
    next_baseline: Callable[[str], Baseline]
    changes: Dict[str, TableChanges]


def join_take_exchange(world: int, why: str) -> None:
    """For a rank whose save fails before its snapshot (its arguments refused): takes part in
    take()'s exchange of the ranks' reasons against a delta, as a rank with reason `why`, so that
    the ranks' next collective is the write's first exchange, where that rank meets them with its
    error (CheckpointWriter.fail_before_writing)."""
    if dist.collective(world):
        dist.gather_objects((why, set()), world)


def take(tables: Mapping[str, TableLike], baseline: Optional[Baseline], incremental: bool, storage: Storage,
         output_dir: str, rank: int, world: int, want: Collection[str] = (),
         known: Optional[chain.IndexIdentity] = None) -> Taken:
    """Moves every table's change baseline to now (a full save too, so the next delta is relative to
    it) and returns what the save writes. Every rank takes part (one small collective when
    several): all write a delta or all a full, and a table cleared on one rank is written whole, and
    marked cleared, by all. The changes of the tables in `want` are taken even for a full save (an
    async save's stager copies only those rows)."""
    reason = why_full(tables, baseline, storage, output_dir, rank, known, world) if incremental else "incremental=False"
    # Every save moves the baselines. A save already known to be full only resets them: listing
    # the changed rows is a pass over every table's mask (50 ms for 4M rows) it would not use.
    # A table reachable under two names (a shared table without name=) is taken once, its changes
    # given to every name: a second take_changes would find none, and its name's delta (or async
    # copy) would keep the parent's rows.
    to_take = {id(t) for n, t in tables.items() if reason is None or n in want}
    taken: Dict[str, TableChanges] = {}
    once: Dict[int, TableChanges] = {}
    for n, t in tables.items():
        if not tracks_changes(t):
            continue
        if id(t) in to_take:
            if id(t) not in once:
                once[id(t)] = t.take_changes()  # type: ignore[attr-defined]
            taken[n] = once[id(t)]
        else:
            t.reset_changes()  # type: ignore[attr-defined]
    wanted = {n: c for n, c in taken.items() if n in want}
    after = Baseline.of("", tables, (rank, world))

    def next_baseline(ckpt_id: str) -> Baseline:
        return dataclasses.replace(after, ckpt_id=ckpt_id)

    untracked = sorted(n for n in tables if n not in taken or not taken[n].tracked)
    if reason is None and untracked:
        reason = f"table(s) {untracked} do not track changes (knob track_changes is off)"
    cleared: Set[str] = {n for n, c in taken.items() if reason is None and c.cleared}
    if dist.collective(world):
        votes: List[Tuple[Optional[str], Set[str]]] = dist.gather_objects((reason, cleared), world)
        reasons = [r for r, _ in votes if r is not None]
        reason = reasons[0] if reasons else None
        cleared = set().union(*(c for _, c in votes))
    if reason is not None:
        if incremental:
            log.info("recsave: saving a full checkpoint instead of a delta: %s", reason)
        return Taken(None, next_baseline, wanted)
    deltas: Dict[str, Delta] = {}
    for name, changes in taken.items():
        if name in cleared and not changes.cleared:  # cleared on another rank: this one writes all its rows
            ids, rows = tables[name].id_rows()
            deltas[name] = Delta(ids, rows, torch.empty(0, dtype=torch.int64), True)
        else:
            deltas[name] = Delta(changes.ids, changes.rows, changes.tombstones, bool(changes.cleared))
    return Taken(deltas, next_baseline, wanted)


def with_tables(index: Index, state: SaveState, tombstones: Mapping[str, int],
                steps: Optional[Mapping[str, int]] = None) -> Index:
    """The index with each table's step (from `steps` where it names the table: the ranks'
    agreed one; else this rank's) and, for a delta, its cleared flag and tombstone count."""
    if index.meta is None:
        return index
    tables = {}
    for name, meta in index.meta.tables.items():
        table = state.tables.get(name)
        if table is None:
            tables[name] = meta
            continue
        step = (steps or {}).get(name, table.step)
        if state.parent is None:
            tables[name] = dataclasses.replace(meta, step=step)
        else:
            tables[name] = dataclasses.replace(meta, step=step, cleared=table.cleared,
                                               tombstones=int(tombstones.get(name, 0)))
    return dataclasses.replace(index, meta=dataclasses.replace(index.meta, tables=tables))


def as_delta(storage: Storage, output_dir: str, index: Index, parent_id: str,
             known: Optional[chain.IndexIdentity] = None) -> Index:
    """The index as a delta of checkpoint `parent_id` (kind, parent, base; format_version 2, or 3
    with bucket ranges: records.version_for). `known`: what this process committed as the
    parent's index, taken when the bytes there still match it."""
    parent_dir = storage.join(output_dir, parent_id)
    if known is not None:
        crc = chain.index_crc(storage, parent_dir)
        if crc != known.crc32c:
            raise WriterLockedError(
                f"{parent_dir} was saved again by another writer while this delta of it was being "
                f"saved; nothing was committed (this Saver's next save is full)", path=parent_dir)
        base = known.base
    else:
        parent, crc = chain.read_with_crc(storage, parent_dir)
        base = parent.base if parent.is_delta and parent.base is not None else parent_id
    return dataclasses.replace(index, format_version=version_for(KIND_DELTA, index.tensors), kind=KIND_DELTA,
                               parent=Parent(parent_id, crc), base=base)
