"""All-or-nothing loads: everything a load changes is staged first, then applied at once; if applying
fails part way, what was applied is undone, so a failed load leaves the model, its optimizers and
registered objects exactly as they were (docs/ARCHITECTURE.md, "A load").

Tables (any TableLike, tables/tablelike.py) are staged in scratch tables (new_like) that the load
fills through the usual paths, then swapped in (swap_contents, O(1) for a HashTable); the replaced
contents are kept until the load has finished, so reloading a model that already holds rows
briefly holds both. Dense
parameters, extras and io states are applied after the tables, each after a snapshot to undo it."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from recsave.errors import RecsaveError, ShapeMismatchError, UsageError
from recsave.tables import partition as partitioning
from recsave.tables.tablelike import TableLike

Undo = Callable[[], None]


class LoadTransaction:
    """Collects a load's changes (stage_*), then apply() makes them all or none."""

    def __init__(self, tables: Dict[str, TableLike], dense: Dict[str, torch.Tensor]):
        self._tables = tables
        self._dense = dense
        self._scratch: Dict[str, Any] = {}  # each a new_like() of its live table
        self._partitions: Dict[str, Tuple[int, int, int]] = {}
        self._dense_values: Dict[str, torch.Tensor] = {}
        self._changes: List[Tuple[str, Callable[[], Undo]]] = []  # (what, apply -> its undo)
        self._undo: List[Tuple[str, Undo]] = []

    def table(self, name: str, *, keep_rows: bool, partition: Optional[Tuple[int, int, int]] = None) -> Any:
        """The scratch table standing for model table `name`: empty (with the live table's config
        and slots), or a copy of its rows with `keep_rows` (merges and slot-only loads). Later
        entries of the same load get the same scratch, holding what earlier entries staged.
        `partition`: the load's (rank, world size, buckets); the table becomes that shard, or
        whole with a world of 1 (a shard an earlier multi-rank save or load made, loading alone)."""
        if name not in self._scratch:
            live = self._tables[name]
            scratch = live.new_like(copy_rows=keep_rows)
            # (the live table's partition too: a TableLike's new_like need not copy it)
            if partition is not None and (partition[1] > 1 or live.partition is not None
                                          or scratch.partition is not None):
                if keep_rows and partition[1] > 1:
                    _refuse_foreign_rows(name, scratch, partition)
                scratch.set_partition(*partition)
                self._partitions[name] = partition
            self._scratch[name] = scratch
        return self._scratch[name]

    def stage_dense(self, name: str, value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(self._dense[name].shape):
            raise ShapeMismatchError(f"dense {name!r}: the checkpoint's shape is {tuple(value.shape)}, the "
                                     f"model's {tuple(self._dense[name].shape)}", key=name)
        self._dense_values[name] = value

    def stage_call(self, what: str, apply: Callable[[], Undo]) -> None:
        """A change to a registered object: `apply()` makes it and returns how to undo it."""
        self._changes.append((what, apply))

    def apply(self) -> None:
        """Applies every staged change in order (tables, dense, then the calls); on an error undoes
        what it applied and re-raises."""
        try:
            # Each undo is registered before its change: an error (or an interrupt) that lands
            # right after a change, or half way through it, is undone too.
            for name, scratch in self._scratch.items():
                live = self._tables[name]
                self._undo.append((f"table {name}", _swap_back(live, scratch, live.partition)))
                live.swap_contents(scratch)
                if name in self._partitions:
                    live.set_partition(*self._partitions[name])
            for name, value in self._dense_values.items():
                target = self._dense[name]
                self._undo.append((f"dense {name}", _copy_back(target, target.detach().clone())))
                with torch.no_grad():
                    target.copy_(value)
            for what, change in self._changes:
                self._undo.append((what, change()))
        except BaseException:
            self.rollback()
            raise

    def rollback(self) -> None:
        """Undoes what apply() did, newest first (a no-op when nothing is applied). Every step runs
        even when one fails; then the first failure is raised, naming the step (the error being
        handled, if any, stays its context)."""
        failed: List[Tuple[str, BaseException]] = []
        while self._undo:
            what, undo = self._undo.pop()
            try:
                undo()
            except Exception as exc:  # the other steps must still run
                failed.append((what, exc))
        if failed:
            step, error = failed[0]
            others = f" ({len(failed) - 1} more undo step(s) failed too)" if len(failed) > 1 else ""
            raise RecsaveError(f"undoing a failed load could not restore {step}{others}: "
                               f"{type(error).__name__}: {error}; that object may hold part of the "
                               f"checkpoint's state: reload or restart the job") from error

    def done(self) -> None:
        """Drops what the load staged and the undo steps, with the contents they hold (the
        replaced tables after a success, the staged ones after a failure)."""
        self._undo.clear()
        self._scratch.clear()
        self._partitions.clear()
        self._dense_values.clear()
        self._changes.clear()


def state_dict_change(obj: Any, state: Any) -> Callable[[], Undo]:
    """``obj.load_state_dict(state)``, undone by loading a deep copy of its state from before."""
    def apply() -> Undo:
        before = copy.deepcopy(obj.state_dict())
        return _guarded(lambda: obj.load_state_dict(state), lambda: obj.load_state_dict(before))
    return apply


def io_state_change(obj: Any, load: Callable[[], None]) -> Callable[[], Undo]:
    """An io state load, undone by loading what ``obj.dump_io_state()`` gave before."""
    def apply() -> Undo:
        before = obj.dump_io_state()
        return _guarded(load, lambda: obj.load_io_state(before))
    return apply


def _guarded(change: Callable[[], Any], undo: Undo) -> Undo:
    """Runs `change`; if it raises part way, undoes it before re-raising (the object may have
    applied some of the state)."""
    try:
        change()
    except BaseException:
        undo()
        raise
    return undo


def _refuse_foreign_rows(name: str, kept: Any, partition: Tuple[int, int, int]) -> None:
    """A load that keeps a table's rows (a merge, a slot-only load) as rank r of W makes the table
    that rank's shard: rows it holds of other ranks' buckets would stay there, written by its next
    save as this rank's (which refuses them) and never found by their owners. UsageError first,
    with nothing changed."""
    ids = kept.id_rows()[0]
    found = partitioning.first_foreign(ids, partition)
    if found is not None:
        i, owner, count = found
        raise UsageError(
            f"table {name!r}: this load keeps the table's rows (hashtable_clear=False, or slots only) as "
            f"rank {partition[0]} of {partition[1]}, but the table holds id {int(ids[i])} of rank {owner} "
            f"({count} id(s) of other ranks in all); route the ids to their owners "
            f"(recsave.partition.owner_of) before the lookups, or load with hashtable_clear=True",
            key=name)


def _swap_back(live: TableLike, scratch: Any, partition: Optional[Tuple[int, int, int]]) -> Undo:
    """Swaps back, only when the staged contents are in `live` (the swap may not have happened)."""
    staged = scratch.columns()["embedding"]

    def undo() -> None:
        if live.columns()["embedding"] is staged:
            live.swap_contents(scratch)
        if live.partition != partition:
            live.set_partition(*(partition or (0, 1)))  # a world of 1: no partition
    return undo


def _copy_back(target: torch.Tensor, old: torch.Tensor) -> Undo:
    def undo() -> None:
        with torch.no_grad():
            target.copy_(old)
    return undo

