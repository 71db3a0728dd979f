"""Saver: the facade a training job uses. It saves a model's hash tables through the C++ engine and
its dense state with torch.save (save/pipeline.py writes and commits), and loads checkpoints back
(load/; its fallback and delta-baseline steps in save/restore.py, argument checks in
save/arguments.py). docs/ARCHITECTURE.md shows how the layers fit."""
from __future__ import annotations

import contextlib
import functools
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple, TypeVar, cast

import torch

from recsave import argcheck, knobs, threads
from recsave.argcheck import check
from recsave.errors import CheckpointNotFoundError, UsageError
from recsave.format import ckptlist, retention
from recsave.format.records import Retention
from recsave.load import contents
from recsave.load.config import SPARSE_OPTIM
from recsave.load.execute import execute, load_entries
from recsave.load.plan import LoadPlan, LoadTarget, plan_entries
from recsave.load.report import LoadReport
from recsave.save import arguments, background, delta, restore
from recsave.save.background import BackgroundWrite
from recsave.save.pipeline import CheckpointWriter, step_of_id
from recsave.save.prefill import Prefill
from recsave.save.saveinfo import SaveInfo, log_commit
from recsave.save.snapshot import SaveState, Stager, capture, change_epoch
from recsave.storage import Storage, dist, get_storage
from recsave.tables import partition
from recsave.tables.modes import outside_inference_mode

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _one_call_at_a_time(method: _Method) -> _Method:
    """Runs a public Saver method under the Saver's lock: calls from several threads take turns.
    Two async_save calls interleaved on one Saver copied into the one set of host buffers while
    the other's write read them, and committed a checkpoint holding the other call's state. The
    background write never takes the lock (a wait() holding it waits for that write)."""
    @functools.wraps(method)
    def serialized(self: "Saver", *args: Any, **kwargs: Any) -> Any:
        with self._calls:
            return method(self, *args, **kwargs)
    return cast(_Method, serialized)


class Saver:
    """Saves and loads a model's sparse tables, dense parameters and registered state.

    Args:
        model: the nn.Module; its HashTables are saved as sharded sparse files, the rest of its
            state_dict as ``model.pt``.
        sparse_optim: a recsave.optim optimizer; its slots live in the tables, its scalar state is
            saved as the extra ``sparse_optim``.
        output_dir: local path or fsspec URL holding the checkpoints and the ``checkpoint`` file.
        max_keep: committed checkpoints to keep (older ones are deleted); None keeps all.
        concurrency: threads of the C++ engine per file.
    """

    def __init__(self, model: torch.nn.Module, sparse_optim: Any = None, output_dir: str = "./",
                 max_keep: Optional[int] = 1, concurrency: int = 4):
        check(model, torch.nn.Module, "model", "Saver", expected="a torch.nn.Module")
        argcheck.path(output_dir, "output_dir", "Saver")
        self._calls = threads.ForkSafeRLock()  # _one_call_at_a_time
        self.model = model
        self.sparse_optim = sparse_optim
        self.output_dir = output_dir
        self.storage: Storage = get_storage(output_dir)
        self._checkpoints = CheckpointWriter(self.storage, output_dir, 1, 4, partition.DEFAULT_NUM_BUCKETS)
        self.max_keep = max_keep
        self.concurrency = concurrency
        self._extras: Dict[str, Any] = {}
        self._optional: Set[str] = set()  # extras a checkpoint may lack (register_for_checkpointing)
        self._io_states: Dict[str, Any] = {}
        self._extra_data: Dict[str, Any] = {}
        self._stager: Optional[Stager] = None  # host buffers of async saves, reused
        self._background = BackgroundWrite()
        self._prefill = Prefill()  # prepare_async's head start on the stager
        self._last_save: Optional[SaveInfo] = None
        self._last_load: Optional[LoadReport] = None
        self._loads_started = 0
        self._baseline: Optional[delta.Baseline] = None  # what the next delta is relative to
        self.last_save_kind: Optional[str] = None  # "full" or "delta": what the last save wrote
        if sparse_optim is not None:
            arguments.stateful("sparse_optim", sparse_optim, "Saver")
            self._extras[SPARSE_OPTIM] = sparse_optim

    # ------------------------------------------------------------------------------- settings
    @property
    def max_keep(self) -> Optional[int]:
        """Committed checkpoints to keep (older ones are deleted at the next commit); None keeps all."""
        return self._checkpoints.max_keep

    @max_keep.setter
    def max_keep(self, value: Optional[int]) -> None:
        check(value, int, "max_keep", "Saver", optional=True)
        if value is not None and value < 1:
            raise UsageError(f"max_keep must be a positive int or None (keep all), got {value!r}")
        with self._calls:  # a save on another thread commits under the value it started with
            self._checkpoints.max_keep = value

    @_one_call_at_a_time
    def set_retention(self, *, keep_every_n_steps: Optional[int] = None, keep_best: int = 0,
                      best_metric: Optional[str] = None, best_mode: str = "max") -> None:
        """Retention beyond max_keep (CheckpointManager sets it): rotation also keeps the first
        checkpoint of every window of `keep_every_n_steps` steps and the `keep_best` ones with the
        best value of metric `best_metric` (``save(metrics=...)``; `best_mode` "max" or "min").
        Applies from the next commit; ``recsave gc`` and ``recsave ls`` follow the settings
        recorded in the latest checkpoint's index (docs/FORMAT.md)."""
        where = "Saver.set_retention"
        check(keep_every_n_steps, int, "keep_every_n_steps", where, optional=True)
        check(keep_best, int, "keep_best", where)
        check(best_metric, str, "best_metric", where, optional=True)
        check(best_mode, str, "best_mode", where)
        retention.check_policy(where, keep_every_n_steps=keep_every_n_steps, keep_best=keep_best,
                               best_metric=best_metric, best_mode=best_mode)
        w = self._checkpoints
        w.keep_every_n_steps, w.keep_best, w.best_metric, w.best_mode = \
            keep_every_n_steps, keep_best, best_metric, best_mode

    @property
    def retention(self) -> Retention:
        """The retention settings in force (max_keep and those of set_retention)."""
        return self._checkpoints.retention

    @property
    def delta_parent(self) -> Optional[str]:
        """Path of the checkpoint the next incremental save would be a delta of (the one this Saver
        saved or restored last), None when its change baseline is unknown (that save is then full;
        it may also be full for a reason only the save finds, e.g. the parent gone)."""
        return None if self._baseline is None else self.storage.join(self.output_dir, self._baseline.ckpt_id)

    @property
    def last_save(self) -> Optional[SaveInfo]:
        """The last save of this Saver that committed (an async one once its write is done)."""
        return self._last_save

    @property
    def last_load(self) -> Optional[LoadReport]:
        """The report of this Saver's last load or model-bank load (the object it returned); None
        before any, and after one that failed (it may have changed some tables)."""
        return self._last_load

    @_one_call_at_a_time
    def refuse_committed(self, ckpt_id: str) -> None:
        """CheckpointExistsError now when `ckpt_id` is a committed checkpoint of output_dir
        (listed, with its index, not found damaged): what a save of it checks before writing, for
        a caller that must know before it changes the model (CheckpointManager's evict). One
        process's view: with several ranks the save's own check, agreed in its first exchange,
        is the one that counts."""
        ckptlist.validate_id(ckpt_id)
        self._checkpoints.refuse_committed_early(ckpt_id)

    @property
    def loads_started(self) -> int:
        """How many loads and model-bank loads this Saver has begun (failed ones too): when it
        changes, the model may hold other state than a checkpoint saved before."""
        return self._loads_started

    @property
    def commits_made(self) -> int:
        """How many checkpoints this Saver has committed (written their index; a save that failed
        after that point counts). With several ranks only rank 0 commits: 0 on the others."""
        return self._checkpoints.commits

    @property
    def concurrency(self) -> int:
        """Threads of the C++ engine per file operation."""
        return self._checkpoints.concurrency

    @concurrency.setter
    def concurrency(self, value: int) -> None:
        check(value, int, "concurrency", "Saver")
        if value < 1:
            raise UsageError(f"concurrency must be a positive int, got {value!r}")
        with self._calls:
            self._checkpoints.concurrency = value

    @property
    def num_buckets(self) -> int:
        """Buckets of the id partition written into new checkpoints (docs/FORMAT.md)."""
        return self._checkpoints.num_buckets

    @property
    def damaged_checkpoints(self) -> FrozenSet[str]:
        """Ids of this output dir's committed checkpoints that a fallback load found unloadable;
        the next save of such an id replaces it."""
        return frozenset(self._checkpoints.damaged)

    # ----------------------------------------------------------------------------- registration
    @_one_call_at_a_time
    def register_for_checkpointing(self, name: str, obj: Any, optional: bool = False) -> None:
        """Saves ``obj.state_dict()`` in extra.pt under `name`; loading calls ``obj.load_state_dict``.

        With `optional`, a checkpoint without `name` (e.g. one written before it was registered)
        still loads under strict configs: `obj` keeps its state, and the LoadReport lists `name` in
        ``skipped`` with a note. Otherwise such a checkpoint lacks a selected name (ConfigError)."""
        check(optional, bool, "optional", "register_for_checkpointing")
        arguments.registered_name(name, self.model, list(self._extras) + list(self._io_states))
        arguments.stateful("obj", obj, f"register_for_checkpointing({name!r})")
        self._extras[name] = obj
        if optional:
            self._optional.add(name)

    @_one_call_at_a_time
    def register_io_state(self, name: str, obj: Any) -> None:
        """Saves ``obj.dump_io_state()`` per rank; loading calls ``obj.load_io_state(state)``."""
        arguments.registered_name(name, self.model, list(self._extras) + list(self._io_states))
        arguments.io_stateful(name, obj)
        self._io_states[name] = obj

    # ----------------------------------------------------------------------------------- listing
    def checkpoints(self) -> List[str]:
        """Paths of the committed checkpoints, oldest first. When the `checkpoint` file is lost or
        garbled, the list is rebuilt from the checkpoints' indexes with a RuntimeWarning (the next
        save rewrites the file; docs/FORMAT.md section 1)."""
        return [self.storage.join(self.output_dir, i) for i in self._committed(self.output_dir).ids]

    def _committed(self, path: str) -> ckptlist.Listing:
        """The committed checkpoints of output dir `path`, read only (warnings given once per Saver)."""
        return ckptlist.committed(get_storage(path) if path != self.output_dir else self.storage, path,
                                  warned=self._checkpoints.list_warnings)

    def latest_checkpoint(self) -> Optional[str]:
        """Path of the latest committed checkpoint (see checkpoints()), None when there is none."""
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    def get_extra_data(self, name: str) -> Any:
        """The state a load last applied to the registered extra `name` (its model name, after an
        'oname' rename): a load that does not take it (kept out by its config, or a source without
        it) leaves it as it leaves the object. An extra the Saver has no object for is there once a
        load has read the extra.pt holding it (docs/API.md, "Saver")."""
        check(name, str, "name", "get_extra_data")
        if name not in self._extra_data:
            raise UsageError(f"no extra data {name!r} was loaded; loaded extras: {sorted(self._extra_data)}",
                             key=name)
        return self._extra_data[name]

    # -------------------------------------------------------------------------------------- save
    @_one_call_at_a_time
    def save(self, ckpt_id: str, shard_id: Optional[int] = None, shard_num: Optional[int] = None,
             metrics: Optional[Mapping[str, float]] = None, incremental: bool = False) -> str:
        """Writes checkpoint `ckpt_id` under output_dir and commits it; returns its path.

        With `incremental`, the checkpoint is a delta of this Saver's latest checkpoint (saved or
        restored by it): only the rows changed since and the ids removed, plus the dense part,
        extras and io states (docs/FORMAT.md section 10). When that baseline is unknown (nothing
        saved or restored yet, a model-bank load or a failed save since, a table's changes moved
        by someone else or not tracked) the save is full, logged at INFO; `last_save_kind` tells.

        Order (docs/FORMAT.md section 5): shard files and io state of every rank, then on rank 0
        model.pt, extra.pt, the index (the commit point) and the `checkpoint` list, then pruning.
        On failure the partial directory is removed and the previous checkpoint stays latest.
        A pending async_save is waited for first; if it failed, its error is raised here.
        `metrics` (name -> float; rank 0's count) are stored in the index, for keep_best.
        """
        start = time.monotonic()
        background.wait_for_every_write()
        args = self._save_args("save", ckpt_id, shard_id, shard_num, metrics, incremental=incremental)
        assert args is not None  # a save's refusal is raised
        rank, world, values = args
        self._prefill.join()  # the save moves the change baseline a prefill records
        self._background.collect(consume=True)
        state, after = self._capture(ckpt_id, rank, world, None, incremental)
        path = self._write(ckpt_id, state, rank, world, values, after, self.retention)
        elapsed = time.monotonic() - start
        self._record_commit(ckpt_id, path, rank, elapsed, elapsed, values, state.parent is not None)
        return path

    def _save_args(self, where: str, ckpt_id: Any, shard_id: Any, shard_num: Any, metrics: Any,
                   **flags: Any) -> Optional[Tuple[int, int, Optional[Dict[str, float]]]]:
        """(rank, world, metrics) of a save, checked. Inside a process group of several ranks, a
        rank whose arguments are refused meets the others at their write's first exchange with
        its error first (they raise RankFailedError at once, not at the collective timeout); for
        async_save it then holds a write failed with its error, as they do, and gets None."""
        try:
            for name, value in flags.items():  # incremental, pinned
                check(value, bool, name, where)
            rank, world = arguments.save_args(where, ckpt_id, shard_id, shard_num)
            return rank, world, retention.check_metrics(where, metrics)
        except Exception as exc:
            group_rank, group_world = dist.group()
            # shard_num=1 in a larger group: a process saving alone, the others take no part
            alone = shard_num is not None and shard_num == 1 and group_world != 1
            if dist.collective(group_world) and not alone:
                # What the others do before their first collective: a pending write's error
                # (raised here as there, without collectives), then their collectives until the
                # write's first exchange: the async mode's group, the snapshot's vote on a delta.
                self._prefill.join()
                self._background.collect(consume=True)
                with contextlib.suppress(Exception):
                    if where == "async_save":
                        dist.recsave_group()
                    delta.join_take_exchange(group_world, f"a rank's {where} arguments were refused")
                self._checkpoints.fail_before_writing(str(ckpt_id), exc, group_rank, group_world)
                if where == "async_save":
                    # The others learn of it from their write (its future, the next save, wait()
                    # or close()): so does this rank, from a write that failed with it.
                    self._background.fail(str(ckpt_id), exc)
                    return None
            raise

    @_one_call_at_a_time
    def make_latest(self, ckpt_id: str) -> str:
        """Lists committed checkpoint `ckpt_id` as the latest (last in the `checkpoint` file), so that
        a restart resumes from it, e.g. a checkpoint restored after rewinding past newer ones when the
        job must stop before it saves again; nothing is written or deleted, and rotation later prunes
        from the oldest listed as usual. Waits for a pending async write first (raising its error).
        CheckpointNotFoundError when `ckpt_id` is not committed. Every rank calls it; rank 0 writes."""
        rank, world = arguments.save_args("make_latest", ckpt_id, None, None)
        background.wait_for_every_write()
        self._prefill.join()
        self.wait()
        return self._checkpoints.make_latest(ckpt_id, rank, world)

    def _write(self, ckpt_id: str, state: SaveState, rank: int, world: int, values: Optional[Dict[str, float]],
               after: Callable[[str], delta.Baseline], policy: Retention) -> str:
        """Writes and commits under retention `policy` (the settings of the save's call: a setting
        changed while an async write runs applies from the next save); on success the baseline of
        the next delta is this checkpoint, on failure it is unknown (the next incremental save is
        full)."""
        self._baseline = None
        path = self._checkpoints.write(ckpt_id, state, rank, world, values, policy=policy)
        self._baseline = after(ckpt_id)
        return path

    def _record_commit(self, ckpt_id: str, path: str, rank: int, seconds: float, stall: float,
                       metrics: Optional[Dict[str, float]], is_delta: bool = False,
                       staged_rows: Optional[int] = None) -> None:
        """Sets last_save; rank 0 logs the commit."""
        info = SaveInfo(ckpt_id, path, step_of_id(ckpt_id), "delta" if is_delta else "full",
                        self._checkpoints.last_bytes, seconds, stall, metrics, staged_rows)
        self._last_save = info
        if rank == 0:
            log_commit(info)

    @_one_call_at_a_time
    def async_save(self, ckpt_id: str, shard_id: Optional[int] = None, shard_num: Optional[int] = None,
                   pinned: bool = False, metrics: Optional[Mapping[str, float]] = None,
                   incremental: bool = False) -> Tuple[Future, Future]:
        """Saves like save(), but returns once the state is snapshotted: returns
        ``(stage_future, write_future)``.

        It first waits for the previous async write (raising its error, if any, instead of saving).
        Then it copies every table (ids, embedding and all slots at one moment), the dense tensors,
        extras and io states into host buffers reused from save to save (page-locked for CUDA
        tensors with `pinned`), and hands the copy to a background thread that writes and commits
        it. Training may change the model at once: the checkpoint holds the state at the call.
        `stage_future` is done on return; `write_future` yields the checkpoint path, or the error
        of the write, which is also raised by the next save / async_save, wait() or close(). In a
        process group an argument or snapshot refused on this rank becomes its write's error too
        (the other ranks' writes fail with it), so that every rank raises from the same call. Every
        rank calls async_save in the same order (the writes run collectives on recsave's group).
        The host copy costs memory of about the size of the tables and dense tensors (of the
        changed rows only, for a delta: `incremental` as in save()).
        """
        start = time.monotonic()
        knobs.get("async_failure_exit_code")  # a bad value is refused here, not after the snapshot
        background.wait_for_every_write()
        args = self._save_args("async_save", ckpt_id, shard_id, shard_num, metrics, incremental=incremental,
                               pinned=pinned)
        done: Future = Future()
        done.set_result(None)  # staging is done on this thread, before returning
        if args is None:  # refused here, in step with the other ranks: its write failed with it
            return done, self._background.pending_future()
        rank, world, values = args
        self._background.collect(consume=True)
        if world == 1:  # several ranks learn it together, in the write's first exchange
            self._checkpoints.refuse_committed_early(ckpt_id)
        if dist.collective(world):
            dist.recsave_group()  # creating the group is itself a collective: do it on the calling thread
        self._prefill.join()
        if self._stager is None or self._stager.pinned != pinned:
            self._stager = Stager(pinned)
        met_group: List[BaseException] = []
        try:
            state, after = self._capture(ckpt_id, rank, world, self._stager, incremental, met_group)
        except Exception as exc:
            # Only a failure the other ranks learnt of (the snapshot's, at the write's first
            # exchange): one before it leaves them in an exchange this rank never joined.
            if not dist.collective(world) or exc not in met_group:
                raise
            # As a refused argument (_save_args): the other ranks' writes fail with it in their
            # first exchange; this rank's write holds it too, so that every rank raises it from
            # the same call (write future, next save, wait, close) and they stay in step.
            self._background.fail(ckpt_id, exc)
            return done, self._background.pending_future()
        staged_rows = sum(self._stager.rows_copied.values())
        stage_future = done
        write = knobs.carried(self._write)
        policy = self.retention  # the settings of this call, not those in force when the write commits
        stall = time.monotonic() - start
        self._baseline = None  # until the write succeeds (the next save collects it first)

        def write_and_record() -> str:
            begin = time.monotonic()
            path = write(ckpt_id, state, rank, world, values, after, policy)
            self._record_commit(ckpt_id, path, rank, time.monotonic() - begin, stall, values, state.parent is not None,
                                staged_rows)
            return path
        write_future = self._background.submit(ckpt_id, write_and_record)
        return stage_future, write_future

    @_one_call_at_a_time
    def wait(self) -> Optional[str]:
        """Waits for the pending async write; returns its checkpoint path (None when nothing was
        pending) or raises its error. Then waits for the deletion of the checkpoints rotation
        pruned, which runs on a thread after a save returns (on a local file system; the pruned
        directories leave their ids at once, into output_dir/.recsave+pruned, docs/FORMAT.md)."""
        try:
            path = self._background.collect(consume=True)
        except BaseException:
            with contextlib.suppress(Exception):  # the write's error is the one to raise
                self._checkpoints.settle()
            raise
        self._checkpoints.settle()
        return path

    @_one_call_at_a_time
    def wait_for_pending(self) -> None:
        """Waits for a pending async write without taking its outcome: after a success the list
        names its checkpoint; an error stays pending for the next save, wait() or close() to raise.
        What a load does first; CheckpointManager.restore() too, before it lists the checkpoints."""
        self._background.collect(consume=False)

    @property
    def pending_checkpoint(self) -> Optional[str]:
        """The id an async write is (or was last) writing, until wait(), the next save or a load
        after its success collects it (a failed write stays pending for the next save / wait /
        close to raise)."""
        return self._background.pending_id

    @_one_call_at_a_time
    def prepare_async(self, pinned: bool = False) -> None:
        """Starts copying the model's CPU tables and dense tensors into the host buffers that the next
        ``async_save(pinned=pinned)`` copies into, on a background thread while training goes on, so
        that save does not allocate them (and fault their pages in) while training waits. With the
        knob `stage_changed_rows` this copy counts as that save's previous one: it then copies only
        the rows changed since prepare_async began. It first waits for a pending async write (whose
        error stays pending), which still reads those buffers; the next save, async_save, load,
        execute_plan or close waits for the copy. CheckpointManager(async_mode="async" /
        "async_pinned") calls it after a restore. Memory: the host copy async_save keeps anyway."""
        check(pinned, bool, "pinned", "prepare_async")
        self._prefill.join()
        self._background.collect(consume=False)  # a pending write still reads the buffers
        if self._stager is None or self._stager.pinned != pinned:
            self._stager = Stager(pinned)
        tables, dense = self._model_state("prepare_async")
        self._prefill.start(self._stager, tables, dense)

    def _capture(self, ckpt_id: str, rank: int, world: int, stager: Optional[Stager], incremental: bool,
                 met_group: Optional[List[BaseException]] = None) -> Tuple[SaveState, Callable[[str], delta.Baseline]]:
        """The snapshot, and the next delta's baseline once it commits (given its id). A snapshot
        error reported to the other ranks (at the write's first exchange) is added to `met_group`."""
        try:
            tables, dense = self._model_state("save")
            if world > 1:
                for table in tables.values():
                    table.set_partition(rank, world, self.num_buckets)
            else:
                arguments.refuse_rank_shares(tables, self.num_buckets)
        except Exception as exc:
            # Refused on this rank alone (its model's names): the other ranks are in take()'s
            # vote by now. Meet them there, then at the write's first exchange with this error,
            # so that they raise RankFailedError naming it at once, not at the collective timeout.
            if dist.collective(world):
                with contextlib.suppress(Exception):
                    delta.join_take_exchange(world, "a rank's model was refused")
                self._checkpoints.fail_before_writing(ckpt_id, exc, rank, world)
                if met_group is not None:
                    met_group.append(exc)
            raise
        # Tables whose host copy from this Saver's last async save is still at their change
        # baseline: only the rows changed since need copying (knob stage_changed_rows).
        mirrored: List[str] = []
        if stager is not None and knobs.get("stage_changed_rows"):
            mirrored = [n for n, t in tables.items()
                        if (epoch := stager.mirror_epoch(n)) is not None and epoch == change_epoch(t)]
        known = self._checkpoints.committed_index(self._baseline.ckpt_id) if self._baseline is not None else None
        taken = delta.take(tables, self._baseline, incremental, self.storage, self.output_dir, rank, world,
                           want=mirrored, known=known)
        deltas = taken.deltas
        parent = self._baseline.ckpt_id if deltas is not None and self._baseline is not None else None
        self.last_save_kind = "delta" if deltas is not None else "full"
        try:
            state = capture(tables, dense, self._extras, self._io_states, stager, deltas, parent, taken.changes)
            return state, taken.next_baseline
        except BaseException as exc:
            self._baseline = None  # the changes were taken: the next save must be full
            # The other ranks go on to the write's first exchange: meet them there with this
            # error, so that they raise RankFailedError naming it now, not after the collective
            # timeout (the snapshot checks an io state or extra that only this rank refuses).
            self._checkpoints.fail_before_writing(ckpt_id, exc, rank, world)
            if met_group is not None:
                met_group.append(exc)  # the other ranks know of it now
            raise

    @_one_call_at_a_time
    def close(self) -> None:
        """Waits for a pending async write (raising its error), frees the async host buffers and
        releases the writer lock of output_dir taken by the first save (the lock is also released
        when the Saver is garbage-collected or the interpreter exits). A later save takes it again."""
        try:
            self._prefill.join()
            self._background.collect(consume=True)
        finally:
            self._background.shutdown()
            if self._stager is not None:
                self._stager.release()
                self._stager = None
            self._checkpoints.close()

    # -------------------------------------------------------------------------------------- load
    def _model_state(self, where: str) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
        """The model's tables and dense tensors, refusing names that would overwrite or shadow each
        other (or a registered extra / io state) in a checkpoint (contents.check_names)."""
        tables, dense = contents.model_state(self.model)
        contents.check_names(tables, dense, set(self._extras), set(self._io_states), where)
        return tables, dense

    def _target(self) -> LoadTarget:
        """What a load writes into; its planning (load/plan.py) checks the model's names, inside
        the steps every rank takes together."""
        return LoadTarget(self.model, self._extras, self._io_states, self.concurrency, self._extra_data,
                          frozenset(self._optional))

    @_one_call_at_a_time
    @outside_inference_mode
    def load(self, ckpt_path: Optional[str] = None, ckpt_id: Optional[str] = None,
             load_conf: Optional[Dict[str, Any]] = None, shard_id: Optional[int] = None,
             direct_path: bool = False, fallback: bool = False, shard_num: Optional[int] = None) -> LoadReport:
        """Loads a checkpoint into the model and the registered objects.

        `ckpt_path` is an output dir (its latest checkpoint, or `ckpt_id`) or, with `direct_path`,
        a checkpoint directory; default: this saver's output_dir. `load_conf` selects what to load
        (docs/API.md, "Load / model-bank config"). With `fallback`, when the latest checkpoint of an
        output dir is corrupt or incomplete, the previous committed one is loaded instead (and so
        on), with a warning naming the bad one. A pending async write is waited for first (its
        error, if any, stays for the next save / wait / close).

        Inside a process group each rank loads its share of every table (the buckets it owns)
        together with the others. `shard_num=1` loads in this process alone instead: whole tables,
        no collective (e.g. replicated tables, or a checkpoint one rank saved alone)."""
        check(ckpt_path, str, "ckpt_path", "load", optional=True)
        check(ckpt_id, str, "ckpt_id", "load", optional=True)
        check(load_conf, dict, "load_conf", "load", optional=True)
        check(shard_id, int, "shard_id", "load", optional=True)
        check(direct_path, bool, "direct_path", "load")
        check(fallback, bool, "fallback", "load")
        alone = arguments.load_alone("load", shard_id, shard_num)
        self._prefill.join()  # it reads the tables a load replaces
        background.wait_for_every_write()
        self.wait_for_pending()
        conf = dict(load_conf or {})
        if ckpt_path is not None:
            conf["path"] = ckpt_path
        conf.setdefault("path", self.output_dir)
        self._baseline = None  # a load changes the tables: known again only after a whole restore
        self._last_load = None  # until this one returns: a failed load may have changed some tables
        self._loads_started += 1
        if fallback and ckpt_id is None and not direct_path:
            damaged = self._checkpoints.damaged if conf["path"] == self.output_dir else None
            report = restore.load_with_fallback(self._target(), conf, shard_id, self._committed, damaged, alone)
        else:
            report = load_entries(self._target(), [conf], shard_id=shard_id, ckpt_id=ckpt_id,
                                  direct_path=direct_path, alone=alone)
        self._baseline = restore.baseline_after_load(self.model, report, conf, self.storage, self.output_dir)
        if self._baseline is not None:
            read = report.indexes_read.get(report.checkpoints[0])
            if read is None:  # not a full or delta checkpoint read here: no delta builds on it
                self._baseline = None
            elif dist.group()[0] == 0:
                self._checkpoints.remember_restored(self._baseline.ckpt_id, read)
        self._checkpoints.loaded_intact(report.read_whole)
        self._last_load = report
        return report

    @_one_call_at_a_time
    @outside_inference_mode
    def load_by_config(self, ckpt_path: str, load_conf: Optional[Dict[str, Any]] = None,
                       shard_id: Optional[int] = None, shard_num: Optional[int] = None) -> LoadReport:
        """Loads `ckpt_path` (checkpoint dir or output dir) as selected by `load_conf`
        (`shard_num=1`: whole tables, this process alone, as in `load`)."""
        check(ckpt_path, str, "ckpt_path", "load_by_config")
        if not ckpt_path:
            raise CheckpointNotFoundError(f"ckpt_path must name a checkpoint, got {ckpt_path!r}")
        return self.load(ckpt_path, load_conf=load_conf, shard_id=shard_id, shard_num=shard_num)

    @_one_call_at_a_time
    @outside_inference_mode
    def load_model_bank(self, entries: Sequence[Dict[str, Any]], shard_id: Optional[int] = None,
                        shard_num: Optional[int] = None) -> LoadReport:
        """Applies bank entries in order; for a name given by several entries the last one wins
        (`shard_num=1`: whole tables, this process alone, as in `load`)."""
        return self.execute_plan(self.plan_model_bank(entries, shard_id=shard_id, collective=True,
                                                      shard_num=shard_num))

    @_one_call_at_a_time
    def plan_model_bank(self, entries: Sequence[Dict[str, Any]], shard_id: Optional[int] = None, *,
                        collective: bool = False, shard_num: Optional[int] = None) -> LoadPlan:
        """Dry run of load_model_bank: resolves every entry and lists, per name, the source, rows and
        bytes to read, and what stays initialised. Reads only indexes; changes nothing.

        `collective=True` when every rank of the process group makes this call (to execute the
        plan, as load_model_bank does): rank 0 then reads each index once and broadcasts it. Off,
        each rank reads its own, and a dry run on one rank alone waits for no other. `shard_num=1`
        plans whole tables for this process alone (no collective, whatever `collective` says)."""
        check(entries, (list, tuple), "entries", "plan_model_bank", expected="a list of entry dicts")
        check(shard_id, int, "shard_id", "plan_model_bank", optional=True)
        check(collective, bool, "collective", "plan_model_bank")
        alone = arguments.load_alone("plan_model_bank", shard_id, shard_num)
        if collective and not alone:
            background.wait_for_every_write()  # its exchanges run on recsave's group, as every write's do
        return plan_entries(self._target(), list(entries), shard_id=shard_id, require_path=True,
                            share_reads=collective, alone=alone)

    @_one_call_at_a_time
    @outside_inference_mode
    def execute_plan(self, plan: LoadPlan, only: Optional[Set[str]] = None) -> LoadReport:
        """Carries out a plan made by plan_model_bank (only for the model names in `only`, when
        given). A pending async write is waited for first (its error stays pending)."""
        check(plan, LoadPlan, "plan", "execute_plan", expected="a LoadPlan (from plan_model_bank)")
        names = arguments.only_names(only, plan.items)
        self._prefill.join()
        background.wait_for_every_write()
        self.wait_for_pending()
        self._baseline = None  # the tables hold rows of other checkpoints: the next save is full
        self._last_load = None
        self._loads_started += 1
        self._model_state("load")  # the model may have changed since the plan checked it
        self._last_load = report = execute(self._target(), plan, names)
        return report
