"""Writes and commits checkpoints of one output dir (docs/FORMAT.md section 5, "Commit protocol";
docs/ARCHITECTURE.md, "A save"): shard files and io state of every rank, then on rank 0 model.pt,
extra.pt, the index (the commit point) and the `checkpoint` list, then pruning."""
from __future__ import annotations

import contextlib
import functools
import re
import warnings
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from recsave import _C, knobs, threads
from recsave.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    OverLimitError,
    UsageError,
    WriterLockedError,
)
from recsave.format import chain, ckptlist, retention, torchio
from recsave.format import index as index_mod
from recsave.format.commits import DeferredCommits
from recsave.format.records import IndexPart, Meta, Partition, Retention
from recsave.format.writer import write_shards
from recsave.load import contents
from recsave.save import delta
from recsave.save.layout import TableLayout, bucket_layout
from recsave.save.pruning import Pruner
from recsave.save.snapshot import SaveState
from recsave.storage import Storage, dist
from recsave.storage.lock import LeaseGrant, LeaseWatch, WriterLock, check_held, renewed, still_owned
from recsave.storage.lock import hold as hold_writer_lock
from recsave.tables import partition
from recsave.tables.rows import META_COLUMNS, TOMBSTONE_COLUMN

MODEL_FILE, EXTRA_FILE, IO_COUNT_FILE = "model.pt", "extra.pt", "io_state_count"
_STEP_ID = re.compile(r"ckpt_(\d+)\Z")


_ORDER_INLINE_ROWS = 1 << 16  # a table's bucket order below this many rows takes well under 1 ms


def step_of_id(ckpt_id: str) -> Optional[int]:
    """The step a checkpoint id names (``ckpt_<N>``), else None."""
    m = _STEP_ID.match(ckpt_id)
    return int(m.group(1)) if m else None


def io_state_file(rank: int) -> str:
    return f"io_state_{rank}.pt"


# What each rank reports of a table it wrote: live rows, tombstones, its table step (None: none).
_TableCounts = Tuple[int, int, Optional[int]]


def _agreed_steps(ckpt_id: str, steps: Mapping[str, Mapping[int, int]]) -> Dict[str, int]:
    """The table step the index records for each table: the largest of the ranks' (every rank
    restores it). Ranks hold different steps when a sparse optimizer stepped a table on some ranks
    only (no lookup of it there in some batches); recording rank 0's left other ranks' rows with a
    last_step past their table's step. Warns naming them: rows' ages, and the sparse optimizer's
    step counts (rank 0's in extra.pt), are then off on the ranks that were behind."""
    differ = {name: per_rank for name, per_rank in steps.items() if len(set(per_rank.values())) > 1}
    if differ:
        named = "; ".join(f"{name!r}: " + ", ".join(f"rank {r} at {v}" for r, v in sorted(per_rank.items()))
                          for name, per_rank in sorted(differ.items()))
        warnings.warn(f"{ckpt_id}: the ranks hold different table steps ({named}); the checkpoint records the "
                      f"largest, which every rank restores, and the sparse optimizer's step counts of rank 0. A "
                      f"sparse optimizer steps a table only on the ranks that looked it up: look every table "
                      f"up on every rank each batch (an empty lookup counts) to keep them equal",
                      RuntimeWarning, stacklevel=2)
    return {name: max(per_rank.values()) for name, per_rank in steps.items()}


@dataclass
class _Made:
    """What one rank created for a save: its files, and whether it created the directory."""
    directory: bool = False
    files: List[str] = field(default_factory=list)


class CheckpointWriter:
    """Writes checkpoints into `output_dir` and keeps its `checkpoint` list and rotation: max_keep,
    keep_every_n_steps, keep_best (format/retention.py).

    Holds the output dir's writer lock from the first write until close(). `damaged` holds ids of
    committed checkpoints found unloadable (by a fallback load): the next write of such an id
    unlists and replaces it instead of refusing it as committed."""

    def __init__(self, storage: Storage, output_dir: str, max_keep: Optional[int], concurrency: int,
                 num_buckets: int, *, own_dir: bool = True):
        self.storage = storage
        self.output_dir = output_dir
        self.own_dir = own_dir  # a Saver's output dir, not one a tool was pointed at (holds_foreign_files)
        self.max_keep = max_keep
        self.concurrency = concurrency
        self.num_buckets = num_buckets
        self.keep_every_n_steps: Optional[int] = None
        self.keep_best = 0
        self.best_metric: Optional[str] = None
        self.best_mode = "max"
        # Ids a checkpoint needs (kept with it by rotation): a delta's parent (format/chain.py).
        # (No bound method here: a cycle would keep the Saver, and its writer lock, alive.)
        self._parents_of: Dict[str, List[str]] = {}  # committed indexes do not change: read each once
        self.depends_on: Callable[[str], Iterable[str]] = functools.partial(_cached_parents, storage, output_dir,
                                                                            self._parents_of)
        self.last_bytes = 0  # bytes of the last committed checkpoint this rank knows of (write())
        self.commits = 0  # indexes this writer has written (its commit points; rank 0 only)
        self._facts: Dict[str, Tuple[Optional[int], Optional[Mapping[str, float]]]] = {}  # id -> step, metrics
        self._committed: Dict[str, chain.IndexIdentity] = {}  # id -> its index, as this process wrote it
        self.damaged: Set[str] = set()
        self.list_warnings: Set[str] = set()  # rebuilt-list warnings given already (ckptlist.committed)
        self._lock: Optional[WriterLock] = None
        self._holding = False  # _hold_lock since the last close(): remembered indexes are current
        self._warned_newer: Set[str] = set()
        self._pruner = Pruner(storage, output_dir)  # rotation's deletions, off the save's path

    @property
    def retention(self) -> Retention:
        """The retention settings in force (recorded in each index unless only max_keep is set)."""
        return Retention(self.max_keep, self.keep_every_n_steps, self.keep_best, self.best_metric, self.best_mode)

    def write(self, ckpt_id: str, state: SaveState, rank: int, world: int,
              metrics: Optional[Mapping[str, float]] = None, *, step: Optional[int] = None,
              policy: Optional[Retention] = None) -> str:
        """Writes `state` as checkpoint `ckpt_id` on every rank and commits it; returns its path.
        `metrics` (rank 0's) go into the index, and so does `step` (rank 0's; default: the step
        the id names, step_of_id). `policy`: the retention the commit records and rotates by
        (default: the settings in force at the commit; an async save passes those of its call).
        On failure every rank removes the files and directory it created, then rank 0 the partial
        directory, unless another writer may own them now (_clean_up_failed); the previous
        checkpoint stays latest. After the commit a rank other than 0 with an output dir of its
        own removes there the checkpoints rank 0's rotation removed (_prune_own_dir)."""
        ckpt_dir = self.storage.join(self.output_dir, ckpt_id)
        self._parents_of.pop(ckpt_id, None)  # this id gets a new index (and maybe another parent)
        made = _Made()
        watch: Optional[LeaseWatch] = None  # rank 0's lock as the other ranks see it
        stage = "prepare"
        try:
            # Ranks that name different checkpoints (their global steps differ) would each write
            # into their own directory and rank 0 commit an index listing files it has not got: the
            # id is agreed in this step's exchange, before anything is written.
            # Rank 0's writer lock travels in the same exchange: the other ranks check it as they write.
            grant = dist.run_everywhere(self._preparing(ckpt_dir), lambda: self._prepare_dir(ckpt_dir, ckpt_id),
                                        world, only_rank0=True, rank=rank, agree=("the checkpoint id", ckpt_id),
                                        rank0_result=True)
            stage = "write"
            self._committed.pop(ckpt_id, None)  # prepared: its old index, if any, is going
            watch = LeaseWatch(self.storage, grant) if rank != 0 and grant is not None else None
            fence = self._fence(rank, watch)
            mine = dist.run_everywhere(f"writing the shards of {ckpt_dir}",
                                       lambda: self._write_rank_files(ckpt_dir, state, rank, world, made, fence),
                                       world)
            parts = dist.gather_to_rank0(mine, world, rank)  # only rank 0 commits: only it needs them
            stage = "commit"
            # Every rank learns which checkpoints rank 0's rotation removed (in the same exchange).
            committed = dist.run_everywhere(f"committing {ckpt_dir}",
                                            lambda: self._commit(ckpt_dir, ckpt_id, parts or [], state, world,
                                                                 metrics, step, policy or self.retention),
                                            world, only_rank0=True, rank=rank, rank0_result=True)
        except BaseException as exc:
            if stage != "prepare":  # a failed prepare created nothing (and may concern a kept dir)
                self._clean_up_failed(ckpt_dir, ckpt_id, made, rank, world, stage == "commit",
                                      not getattr(exc, "collective_failed", False), watch)
            raise
        # Rank 0 knows every file's size (it commits); the others know their own files only.
        own = sum(f.size for f in mine[0].files.values()) if mine is not None else 0
        total, pruned = committed if committed is not None else (None, [])
        self.last_bytes = total if rank == 0 and total is not None else own
        if rank != 0 and pruned:
            self._prune_own_dir(ckpt_id, pruned)
        return ckpt_dir

    def _prune_own_dir(self, ckpt_id: str, pruned: Sequence[str]) -> None:
        """A rank other than 0, after a commit whose rotation removed `pruned` from rank 0's output
        dir: when this rank's output dir is its own (per-rank local disks: it holds neither a
        `checkpoint` list nor a writer lock, ckptlist.writers_files_in), removes its directories of
        those checkpoints (its shards and io states), which nothing else would ever delete. On a
        dir shared with rank 0 (or when that cannot be told) it removes nothing: rank 0's rotation
        did. Never raises: the checkpoint is committed; a failure is a warning."""
        st, out = self.storage, self.output_dir
        names = [n for n in pruned if n != ckpt_id]
        if not self.own_dir or not names:
            return
        try:
            if ckptlist.writers_files_in(st, out):
                return
            self._pruner.join()  # this rank's last deletion (one thread at a time on PRUNED_DIR)
            ckptlist.remove_rank_copies(st, out, names, remove=self._pruner.remove)
        except Exception as exc:  # not only OSError: raising would report a committed save as failed
            warnings.warn(f"{out}: removing this rank's files of the checkpoints rotation pruned "
                          f"({', '.join(names)}) failed ({type(exc).__name__}: {exc}); {ckpt_id} is committed",
                          RuntimeWarning, stacklevel=3)
        finally:
            self._pruner.start()

    @staticmethod
    def _preparing(ckpt_dir: str) -> str:
        return f"preparing {ckpt_dir}"

    def _fence(self, rank: int, watch: Optional[LeaseWatch]) -> Callable[[], None]:
        """What a rank calls before each piece it writes: rank 0 checks (and renews) its writer
        lock; another rank checks rank 0's lock as granted in the prepare exchange (LeaseWatch)."""
        if rank == 0:
            return lambda: check_held(self._lock)
        return watch.check if watch is not None else (lambda: None)

    def loaded_intact(self, paths: Iterable[str]) -> None:
        """Checkpoints a load read whole are not damaged, whatever an earlier fallback found (a
        file missing for a while on a network file system): no later save or make_latest unlists
        them."""
        for path in paths:
            parent, name = self.storage.split(path.rstrip("/"))
            if parent.rstrip("/") == self.output_dir.rstrip("/"):
                self.damaged.discard(name)

    def fail_before_writing(self, ckpt_id: str, error: BaseException, rank: int, world: int) -> None:
        """A rank whose snapshot failed takes part in the exchange the others' write() starts with
        (its prepare step), reporting `error`: they raise RankFailedError naming it at once. It
        returns quietly when that exchange fails (the caller raises `error` itself)."""
        if world <= 1 or not dist.collective(world):
            return
        def fail() -> None:
            raise error
        with contextlib.suppress(BaseException):
            dist.run_everywhere(self._preparing(self.storage.join(self.output_dir, ckpt_id)), fail, world,
                                rank=rank, agree=("the checkpoint id", ckpt_id))

    def make_latest(self, ckpt_id: str, rank: int, world: int) -> str:
        """Lists committed checkpoint `ckpt_id` last in `checkpoint` (rank 0, under the writer
        lock), and unlists the ones a fallback load of this process found damaged that no listed
        checkpoint needs (as a save does, _publish: a restart knows nothing of them, and its save
        of the id would be refused as committed); no file is written or deleted. Returns its path."""
        def relist() -> None:
            self._pruner.join()  # this writer's last deletion; a dropped writer's, acquire() waits for
            self._hold_lock()
            ids = ckptlist.committed(self.storage, self.output_dir, warned=self.list_warnings).ids
            if ckpt_id not in ids:
                raise CheckpointNotFoundError(f"{self.output_dir}: no committed checkpoint {ckpt_id} to list as the "
                                              f"latest; committed: {ids or 'none'}", path=self.output_dir)
            unlisted = self._unlist_damaged(ids, ckpt_id)  # a listed delta's chain members stay
            kept = [i for i in ids if i != ckpt_id and i not in unlisted] + [ckpt_id]
            if kept != list(ids):
                ckptlist.write(self.storage, self.output_dir, kept)

        dist.run_everywhere(f"listing {ckpt_id} as the latest", relist, world, only_rank0=True, rank=rank)
        return self.storage.join(self.output_dir, ckpt_id)

    def _clean_up_failed(self, ckpt_dir: str, ckpt_id: str, made: "_Made", rank: int, world: int,
                         committing: bool, group_usable: bool, watch: Optional[LeaseWatch]) -> None:
        """Best effort, never raising (the save's own error is the one to report): removes what
        this rank created for a failed save, unless rank 0 says no (_may_discard: the failure came
        after rank 0 listed it, or the writer lock is another writer's now, or either is unknown).

        Every rank but 0 removes its files, and the directory when it created it and it is empty
        (per-rank local disks each have their own output dir); after all ranks are done, rank 0
        removes the whole directory. With a broken group (a dead peer) nothing waits for the
        others, and a rank other than 0 keeps its files when the failure came during the commit,
        or when rank 0's lock is another writer's now or cannot be read (`watch.may_discard()`):
        a rank 0 gone silent outlives its lease before the group's timeout ends, and the writer
        that took the lock over may be writing the same names."""
        collective = group_usable and world > 1
        try:
            verdict: Optional[bool] = self._may_discard(ckpt_id, committing) if rank == 0 else None
            if collective:
                verdict = dist.gather_objects(verdict, world)[0]
            elif rank != 0:
                verdict = not committing and (watch is None or watch.may_discard())
            if verdict is not True:
                return  # keep everything
            if rank != 0:
                for path in made.files:
                    with contextlib.suppress(Exception):
                        self.storage.remove_file(path)
                if made.directory and not self.storage.listdir(ckpt_dir):
                    self.storage.remove_tree(ckpt_dir)
            if collective:
                dist.barrier(world)
            if rank == 0:
                self._discard_uncommitted(ckpt_dir, ckpt_id)
        except Exception:  # the original error matters more; the next save cleans leftovers
            pass

    def _may_discard(self, ckpt_id: str, committing: bool) -> Optional[bool]:
        """Rank 0: whether a failed save's files may be removed (None: unknown). Not when its
        writer lock is another writer's now: that writer may be saving the same id (it took over
        a lease that ran out; storage/lock.py). Not when the failure came after the commit made
        it into the `checkpoint` list."""
        try:
            if not still_owned(self._lock):
                return False
            if not committing:
                return True
            listed = self._listed(ckpt_id)
            return None if listed is None else not listed
        except Exception:  # unknown; every rank still takes part in the verdict's exchange
            return None

    def _listed(self, ckpt_id: str) -> Optional[bool]:
        """Whether `ckpt_id` is in the `checkpoint` list (None when the list cannot be read)."""
        try:
            return ckpt_id in ckptlist.read(self.storage, self.output_dir)
        except Exception:
            return None

    def settle(self) -> None:
        """Waits for what a committed save left running: the deletion of the checkpoint
        directories its rotation pruned (moved out of their ids already)."""
        self._pruner.join()

    def close(self) -> None:
        """Waits for the deletion of pruned checkpoints, then releases the writer lock (a later
        write takes it again). Interrupted while the deletion runs, it leaves the lock to the
        deleting thread, which releases it when done (save/pruning.py), rather than let another
        writer save into a name being deleted."""
        try:
            self._pruner.join()
        except BaseException:
            if self._pruner.running():
                self._lock = None  # the thread's reference keeps it held; its finalizer releases it
                self._holding = False
            else:
                self._release_lock()
            raise
        self._release_lock()

    def _release_lock(self) -> None:
        self._holding = False
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _discard_uncommitted(self, ckpt_dir: str, ckpt_id: str) -> None:
        """Removes a failed save's directory unless it made it into the `checkpoint` list (or the
        list cannot be read: then nothing is removed)."""
        if self._listed(ckpt_id) is False:
            with contextlib.suppress(Exception):  # the original error matters more; the next save cleans up
                self.storage.remove_tree(ckpt_dir)

    def _prepare_dir(self, ckpt_dir: str, ckpt_id: str) -> Optional[LeaseGrant]:
        self._pruner.join()  # the last save's pruned directories are gone before this one looks
        self._hold_lock()
        newer = ckptlist.newer_format_version(self.storage, self.output_dir, ckpt_id)
        if newer is not None:  # intact, only unreadable here: never replaced, listed or not
            raise CheckpointExistsError(
                f"{ckpt_dir} was written by a newer recsave (format_version {newer}); save under "
                f"another id, or upgrade recsave", path=ckpt_dir)
        # A lost or garbled list is rebuilt from the indexes, and stale ids dropped, before anything
        # is written (docs/FORMAT.md section 5).
        listed_ids = list(ckptlist.committed(self.storage, self.output_dir, rewrite=True,
                                             warned=self.list_warnings).ids)
        exists = self.storage.exists(ckpt_dir)  # one look: a remote store answers each with a request
        if exists and (ckpt_id not in listed_ids or ckpt_id in self.damaged):  # a listed one: refused below
            self._refuse_needed(ckpt_dir, ckpt_id, listed_ids)  # before unlisting or replacing anything
        if ckpt_id in self.damaged and ckpt_id in listed_ids:
            # A fallback restore skipped this damaged checkpoint: unlist it, then write it anew.
            ckptlist.write(self.storage, self.output_dir, [i for i in listed_ids if i != ckpt_id])
            listed_ids.remove(ckpt_id)
        self.damaged.discard(ckpt_id)
        self._refuse_committed(ckpt_dir, ckpt_id, listed_ids)
        # A leftover of a crashed save (no index, or an index that never made it into the list) was
        # never committed: safe to replace. A directory holding files recsave does not write is the
        # user's: never removed.
        if exists:
            if ckptlist.holds_foreign_files(self.storage, self.output_dir, ckpt_id, own_dir=self.own_dir):
                raise CheckpointExistsError(
                    f"{ckpt_dir} exists and is a file or holds files recsave did not write; save under "
                    f"another id or move it away", path=ckpt_dir)
            self.storage.remove_tree(ckpt_dir)
        self.storage.makedirs(self.output_dir)
        return None if self._lock is None else self._lock.grant()

    def _refuse_needed(self, ckpt_dir: str, ckpt_id: str, listed_ids: Sequence[str]) -> None:
        """CheckpointExistsError when the existing directory a save would replace (a damaged or unlisted
        checkpoint) is a chain member of a listed checkpoint not found damaged, and its index is
        still valid (sealed intact, as rotation checks it): replacing it would make that one
        unloadable (docs/FORMAT.md section 10). Files are not looked at (rank 0's disk need not hold
        the other ranks' shards, and one missing for a while is no proof of loss); one whose index
        is gone or damaged may be replaced."""
        others = [i for i in listed_ids if i != ckpt_id and i not in self.damaged]
        needing = [i for i in others if ckpt_id in chain.needed_by(self.storage, self.output_dir, [i], self.depends_on)]
        if needing and ckptlist.holds_valid_index(self.storage, self.output_dir, ckpt_id):
            raise CheckpointExistsError(
                f"{ckpt_dir} is a delta chain member of the committed checkpoint(s) {', '.join(needing)}: "
                f"replacing it would make them unloadable; save under another id, or delete "
                f"{', '.join(needing)} first", path=ckpt_dir)

    def _hold_lock(self) -> None:
        """Takes (or renews) the writer lock. Taken anew (after close(), or lost), what this writer
        remembers of other checkpoints' indexes (their parents, steps, metrics) may be stale:
        another writer may have saved those ids again meanwhile, so it is read again."""
        anew = not self._holding or (self._lock is not None and not self._lock.held)
        if anew and self.storage.exists(self.output_dir) and not self.storage.isdir(self.output_dir):
            # Before the lock: taking it under a file failed as "another Saver is competing" on
            # memory://, and on an object store checkpoints beside an object at the key were lost.
            raise UsageError(f"output_dir {self.output_dir} is a file, not a directory: give a path that is a "
                             f"directory or does not exist yet", path=self.output_dir)
        self._lock = hold_writer_lock(self._lock, self.storage, self.output_dir)
        if anew:
            self._parents_of.clear()
            self._facts.clear()
        self._holding = True  # until close(): also with the writer_lock knob off (no lock object)

    def _refuse_committed(self, ckpt_dir: str, ckpt_id: str, listed_ids: Sequence[str]) -> None:
        if ckpt_id in listed_ids and ckpt_id not in self.damaged \
                and self.storage.exists(self.storage.join(ckpt_dir, index_mod.INDEX_FILE)):
            raise CheckpointExistsError(
                f"{ckpt_dir} is a committed checkpoint already; save under another id or delete it first",
                path=ckpt_dir)

    def refuse_committed_early(self, ckpt_id: str) -> None:
        """CheckpointExistsError now when `ckpt_id` is committed already (listed, with its index,
        not found damaged): for an async save of one process, which would otherwise learn it only
        from its background write (that write checks again, under the writer lock)."""
        ids = ckptlist.committed(self.storage, self.output_dir, warned=self.list_warnings).ids
        self._refuse_committed(self.storage.join(self.output_dir, ckpt_id), ckpt_id, ids)

    def _write_rank_files(self, ckpt_dir: str, state: SaveState, rank: int, world: int, made: "_Made",
                          fence: Callable[[], None]) -> Tuple[IndexPart, Dict[str, _TableCounts]]:
        made.directory = not self.storage.exists(ckpt_dir)
        self.storage.makedirs(ckpt_dir)
        part = index_mod.new_part(rank)
        rows: Dict[str, _TableCounts] = {}  # table -> (live rows, tombstones, table step) of this rank
        names = sorted(state.tables)
        # The next table's bucket order is computed while this one is written (two in memory at
        # most). Durable files are fsynced and renamed together when the block exits, before the
        # commit point (format/commits.py). Plain threads (recsave/threads.py): an async save may
        # be writing at interpreter exit.
        with DeferredCommits() as commits:
            layout_of = knobs.carried(bucket_layout)

            def order(k: int) -> Any:
                table = state.tables[names[k]]
                # The first table's order has no write to overlap: it runs here, beside the second
                # table's (started first, so that its thread's start overlaps it too). A small
                # table's (a delta's changed rows) costs less than a thread's start and the GIL
                # hand-overs.
                rows = table.row_count()
                if k == 0 or (rows is not None and rows < _ORDER_INLINE_ROWS):
                    return threads.run_here(layout_of, names[k], table, rank, world, self.num_buckets)
                return threads.start(layout_of, names[k], table, rank, world, self.num_buckets,
                                     name="recsave-order")

            upcoming: Dict[int, Any] = {}  # table number -> future of its layout
            if len(names) > 1:
                upcoming[1] = order(1)
            try:
                if names:
                    upcoming[0] = order(0)
                for k, name in enumerate(names):
                    layout = upcoming.pop(k).result()
                    if k + 1 < len(names) and k + 1 not in upcoming:
                        upcoming[k + 1] = order(k + 1)
                    fence()  # no file written into a directory another writer may own now
                    table_part = self._write_table(ckpt_dir, layout, rank, len(part.files), commits)
                    made.files += [self.storage.join(ckpt_dir, f) for f in table_part.files]
                    table = state.tables[name]
                    rows[name] = (layout.num_rows if state.parent is None else table.live_rows, layout.tombstones,
                                  table.step)
                    part = part.joined(table_part)
                fence()  # before the durable files' renames as the block exits
            except BaseException:
                futures_wait(list(upcoming.values()))  # nothing reads the tables after the save returns
                raise
        fence()
        made.files.append(self.storage.join(ckpt_dir, io_state_file(rank)))
        part = part.with_files({io_state_file(rank): torchio.save(self.storage, ckpt_dir, io_state_file(rank),
                                                                  state.io_state, rank)})
        return part, rows

    def _write_table(self, ckpt_dir: str, layout: TableLayout, rank: int, first_part: int,
                     commits: DeferredCommits) -> IndexPart:
        """Writes one table's files (the engine gathers embedding and slots in bucket order)."""
        return write_shards(ckpt_dir, layout.tensors, rank=rank, concurrency=self.concurrency,
                            storage=self.storage, chunk_meta={t: layout.chunk_meta(t) for t in layout.tensors},
                            first_part=first_part, segments=layout.segments, commits=commits)

    def _commit(self, ckpt_dir: str, ckpt_id: str,
                gathered: Sequence[Tuple[IndexPart, Dict[str, _TableCounts]]],
                state: SaveState, world: int, metrics: Optional[Mapping[str, float]],
                step: Optional[int], policy: Retention) -> Tuple[int, List[str]]:
        """Rank 0: writes model.pt, extra.pt, the index (the commit point), lists the checkpoint and
        rotates; returns the checkpoint's bytes and the checkpoints rotation removed (_publish)."""
        st = self.storage
        check_held(self._lock)  # before model.pt and extra.pt; renewed again before the index
        parts = [part for part, _ in gathered]
        rows: Dict[str, int] = {}
        tombstones: Dict[str, int] = {}
        steps: Dict[str, Dict[int, int]] = {}  # table -> {rank: its table step}
        for k, (_, table_rows) in enumerate(gathered):
            for name, (count, dead, table_step) in table_rows.items():
                rows[name] = rows.get(name, 0) + count
                tombstones[name] = tombstones.get(name, 0) + dead
                if table_step is not None:
                    steps.setdefault(name, {})[k] = table_step
        files = {
            MODEL_FILE: torchio.save(st, ckpt_dir, MODEL_FILE, {n: t.cpu() for n, t in state.dense.items()}, 0),
            EXTRA_FILE: torchio.save(st, ckpt_dir, EXTRA_FILE, state.extras, 0),
            IO_COUNT_FILE: torchio.save_bytes(st, ckpt_dir, IO_COUNT_FILE, f"{world}\n".encode(), 0),
        }
        meta = contents.index_meta(state.tables, state.dense, state.extras, state.io_state, world, rows)
        _check_tensors_described(parts, meta)
        index = index_mod.merge_parts(parts, step=step_of_id(ckpt_id) if step is None else step, world_size=world,
                                      partition=Partition(partition.SCHEME, self.num_buckets),
                                      meta=meta, metrics=metrics,
                                      retention=None if policy.plain else policy)
        index = delta.with_tables(index, state, tombstones, _agreed_steps(ckpt_id, steps))
        if state.parent is not None:
            index = delta.as_delta(st, self.output_dir, index, state.parent, self._committed.get(state.parent))
        index = index.with_files(files)
        # The lock once more right before the commit point: a save longer than writer_lease_s may
        # have lost it to another Saver, whose rotation may be deleting this directory. Renewed,
        # never taken anew: a lock lost during this save stays lost even if it is free again.
        renewed(self._lock)
        data = index_mod.dumps(index)
        index_mod.write_bytes(ckpt_dir, data, storage=st)
        self.commits += 1
        self._committed[ckpt_id] = chain.IndexIdentity(int(_C.crc32c(data)), index.base or ckpt_id)
        self._facts[ckpt_id] = (index.step, index.metrics)
        # What rotation asks of the new checkpoint is known: reading its index back costs a parse.
        self._parents_of[ckpt_id] = chain.needs_of(index)
        return index.total_bytes, self._publish(ckpt_id, policy)

    def remember_restored(self, ckpt_id: str, read: chain.IndexIdentity) -> None:
        """After a whole restore from `ckpt_id` (the next delta's parent), on the rank that commits:
        the index the load parsed (its bytes' CRC32C, its chain's base), so that a delta save
        notices another writer saving that id again (also since the load read it), as it does
        for its own commits."""
        self._committed[ckpt_id] = read

    def committed_index(self, ckpt_id: str) -> Optional[chain.IndexIdentity]:
        """What this writer committed as `ckpt_id`'s index (None: not known here; rank 0 only)."""
        return self._committed.get(ckpt_id)

    def _publish(self, ckpt_id: str, policy: Retention) -> List[str]:
        """Lists the new checkpoint (one atomic replace of `checkpoint`), then deletes what the
        retention selection (format/retention.py) does not keep and leftovers of crashed saves;
        returns the ids of the checkpoint directories it removed (also when pruning failed part
        way), for the other ranks' own output dirs (_prune_own_dir). Never deletes the checkpoint
        just written."""
        st, out = self.storage, self.output_dir
        self._still_held_for_listing(ckpt_id)  # the listing below may rewrite the list
        listing = ckptlist.committed(st, out, rewrite=True, warned=self.list_warnings, being_written=ckpt_id)
        ids: List[str] = [i for i in listing.ids if i != ckpt_id] + [ckpt_id]
        # Checkpoints a fallback restore of this process found damaged leave the list (as
        # make_latest unlists them): a restart would otherwise fall back past them again, refuse
        # its save of their id as committed, and count them against max_keep. Their directories
        # stay for inspection (a later save's or `recsave gc`'s to remove); one a listed
        # checkpoint still needs stays listed.
        unlisted = self._unlist_damaged(ids, ckpt_id)
        ids = [i for i in ids if i not in unlisted]
        try:
            kept = retention.select_by(ids, policy, step_of=lambda i: self._fact(i)[0],
                                       metrics_of=lambda i: self._fact(i)[1], depends_on=self.depends_on)
            keep = [i for i in ids if i in kept or self._written_by_newer(i)]
        except (OSError, OverLimitError) as exc:  # StorageError too: what an index says is unknown, not absent
            warnings.warn(f"{out}: could not read what rotation needs to decide ({exc}); every checkpoint "
                          f"is kept this time, the next save prunes", RuntimeWarning, stacklevel=2)
            keep = ids
        for gone in set(self._facts) - set(keep):
            del self._facts[gone]
        for gone in set(self._committed) - set(keep):
            del self._committed[gone]
        self._still_held_for_listing(ckpt_id)
        ckptlist.write(st, out, keep)
        # Directories with a damaged index (a rebuilt list left them out) are never pruned there.
        # The checkpoint is committed and listed: a failure to prune is the next save's to retry.
        # Pruned directories are moved aside here and deleted on a thread (save/pruning.py).
        removed: List[str] = []

        def remove(path: str) -> None:
            self._pruner.remove(path, lock=self._lock)
            removed.append(st.split(path.rstrip("/"))[1])

        try:
            check_held(self._lock)  # a writer that took the lock over meanwhile owns what is here now
            ckptlist.collect_garbage(st, out, keep + sorted(unlisted), self.depends_on, remove=remove,
                                     pruned=[i for i in ids if i not in keep])
        except Exception as exc:  # not only OSError: raising would report a committed save as failed
            warnings.warn(f"{out}: pruning old checkpoint directories failed ({type(exc).__name__}: {exc}); "
                          f"{ckpt_id} is committed and listed, the next save prunes again",
                          RuntimeWarning, stacklevel=2)
        finally:
            self._pruner.start(self._lock)
        staying = set(keep) | unlisted | {ckpt_id}  # collect_garbage keeps them; never named to the others
        return [name for name in removed if name not in staying]

    def _unlist_damaged(self, ids: Sequence[str], ckpt_id: str) -> Set[str]:
        """The listed ids found damaged that no other listed, undamaged checkpoint needs (as a
        delta chain member: _refuse_needed's rule)."""
        damaged = {i for i in ids if i in self.damaged and i != ckpt_id}
        if not damaged:
            return set()
        others = [i for i in ids if i not in damaged]
        try:
            needed = set(chain.needed_by(self.storage, self.output_dir, others, self.depends_on))
        except (OSError, OverLimitError):  # what they need is unknown: they stay listed (the next save retries)
            return set()
        return damaged - needed

    def _still_held_for_listing(self, ckpt_id: str) -> None:
        """WriterLockedError, before the list is written, when this writer no longer holds the lock
        (frozen past its lease since the index, and taken over): its list would drop the new
        holder's checkpoints and its rotation delete them. Free while the lease is fresh
        (check_held renews only after half a lease)."""
        try:
            check_held(self._lock)
        except WriterLockedError as exc:
            raise WriterLockedError(
                f"{self.output_dir}: the index of {ckpt_id} was written, but this Saver lost the writer lock "
                f"before listing it ({exc}); {ckpt_id} is not listed, and the writer holding the lock now "
                f"may remove it: save again", path=self.storage.join(self.output_dir, ckpt_id)) from exc

    def _fact(self, ckpt_id: str) -> Tuple[Optional[int], Optional[Mapping[str, float]]]:
        """(step, metrics) of a committed checkpoint, from its index (read once: indexes never
        change); (None, None) when it is gone, damaged or newer (kept by other rules). A failed
        read (StorageError) raises, as does an index over the knob max_index_bytes here
        (OverLimitError): without its step and metrics a best or every-n checkpoint would fall out
        of the selection and be deleted."""
        if ckpt_id not in self._facts:
            index = index_mod.read_for_retention(self.storage.join(self.output_dir, ckpt_id), self.storage)
            if index is None:
                return None, None
            self._facts[ckpt_id] = (index.step, index.metrics)
        return self._facts[ckpt_id]

    def _written_by_newer(self, ckpt_id: str) -> bool:
        """Whether a checkpoint falling out of max_keep was written by a newer recsave: rotation
        keeps it (listed) and warns once per checkpoint."""
        version = ckptlist.newer_format_version(self.storage, self.output_dir, ckpt_id)
        if version is None:
            return False
        if ckpt_id not in self._warned_newer:
            self._warned_newer.add(ckpt_id)
            warnings.warn(f"{self.storage.join(self.output_dir, ckpt_id)} was written by a newer recsave "
                          f"(format_version {version}): it is not deleted by max_keep rotation; delete it "
                          f"yourself if it is not needed", RuntimeWarning, stacklevel=2)
        return True


def _cached_parents(storage: Storage, output_dir: str, cache: Dict[str, List[str]], ckpt_id: str) -> List[str]:
    """chain.parent_ids, remembered in `cache` (CheckpointWriter.depends_on)."""
    if ckpt_id not in cache:
        cache[ckpt_id] = chain.parent_ids(storage, output_dir, ckpt_id)
    return cache[ckpt_id]


def _check_tensors_described(parts: Sequence[IndexPart], meta: Meta) -> None:
    """UsageError unless every tensor a rank wrote belongs to a table and column of the index's meta
    (rank 0's tables and slots): a load resolves tables through the meta, so a table or slot only
    another rank has would be written and then never loaded."""
    known = {f"{n}@{c}" for n, t in meta.tables.items() for c in ("id", "embedding", *t.slots, *META_COLUMNS,
                                                                   TOMBSTONE_COLUMN)}
    stray = sorted({(part.rank, name) for part in parts for name in part.tensors if name not in known})
    if stray:
        raise UsageError(f"rank(s) {sorted({r for r, _ in stray})} hold tables or slots that rank 0 does not "
                         f"({[n for _, n in stray][:5]}): every rank must hold the same tables with the same "
                         f"slots; nothing was committed")
    # The other way round: a column rank 0 has and another rank lacks would be committed with rank
    # 0's rows only, shorter than the table's ids, and no load could take it. (Tombstones are per
    # rank: only a rank that deleted ids writes them.)
    def columns(part: IndexPart) -> Set[str]:
        return {n for n in part.tensors if not n.endswith(f"@{TOMBSTONE_COLUMN}")}
    reference = columns(min(parts, key=lambda p: p.rank)) if parts else set()
    lacking = sorted((part.rank, name) for part in parts for name in reference - columns(part))
    if lacking:
        raise UsageError(f"rank(s) {sorted({r for r, _ in lacking})} lack tables or slots that rank 0 holds "
                         f"({[n for _, n in lacking][:5]}): every rank must hold the same tables with the same "
                         f"slots; nothing was committed")
