"""Saver: writes a model's hash tables through the C++ engine and its dense state with torch.save,
commits the checkpoint, rotates old ones, and loads them back (see loader.py)."""
from __future__ import annotations

import re
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from recsave.format import ckptlist
from recsave.load import contents
from recsave.storage import dist
from recsave import knobs
from recsave.load import loader
from recsave.tables import partition
from recsave import threads
from recsave.format import torchio
from recsave.errors import CheckpointExistsError, CheckpointNotFoundError, ConfigError, UsageError
from recsave.errors import CorruptCheckpointError
from recsave.storage.lock import WriterLock, hold as hold_writer_lock
from recsave.format import index as index_mod
from recsave.format.commits import DeferredCommits
from recsave.format.records import IndexPart, Partition
from recsave.format.writer import RowSource, write_shards
from recsave.load.config import SPARSE_OPTIM
from recsave.load.report import LoadPlan, LoadReport
from recsave.save.snapshot import PinnedPair, SaveState, Stager, TableState, capture
from recsave.storage.backends import Storage, get_storage

MODEL_FILE, EXTRA_FILE, IO_COUNT_FILE = "model.pt", "extra.pt", "io_state_count"
_STEP_ID = re.compile(r"ckpt_(\d+)\Z")


# Smallest checksum segment at a bucket boundary: a reader needing a bucket range reads at most one
# partial segment at each end, so this bounds the extra bytes of a reshard read.
MIN_SEGMENT_BYTES = 64 << 10


def bucket_segment_ends(row_starts: Sequence[int], row_bytes: int, max_bytes: int) -> List[int]:
    """Checksum segment ends (bytes) for rows sorted by bucket: cut at bucket boundaries once a
    segment holds MIN_SEGMENT_BYTES, and inside buckets about every `max_bytes` (on row boundaries,
    so rows can be produced in blocks)."""
    total = row_starts[-1] * row_bytes
    if total == 0:
        return [0]
    step = max(row_bytes, max_bytes // row_bytes * row_bytes)  # every end on a row boundary
    ends: List[int] = []
    begin = 0
    for boundary in [r * row_bytes for r in row_starts[1:]]:
        while boundary - begin > step:
            begin += step
            ends.append(begin)
        if boundary - begin >= MIN_SEGMENT_BYTES or boundary == total:
            if boundary > begin:
                ends.append(boundary)
                begin = boundary
    if not ends or ends[-1] != total:
        ends.append(total)
    return ends


def io_state_file(rank: int) -> str:
    return f"io_state_{rank}.pt"


@dataclass
class _TableLayout:
    """One table's tensors in bucket order, as write_shards takes them."""
    tensors: Dict[str, Any]
    meta: Dict[str, Any]  # chunk fields: the bucket row starts
    segments: Dict[str, List[int]]
    num_rows: int


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
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if max_keep is not None and (not isinstance(max_keep, int) or max_keep < 1):
            raise UsageError(f"max_keep must be a positive int or None (keep all), got {max_keep!r}")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise UsageError(f"concurrency must be a positive int, got {concurrency!r}")
        self.model = model
        self.sparse_optim = sparse_optim
        self.output_dir = output_dir
        self.storage: Storage = get_storage(output_dir)
        self.max_keep = max_keep
        self.concurrency = concurrency
        self.num_buckets = partition.DEFAULT_NUM_BUCKETS
        self._extras: Dict[str, Any] = {}
        self._io_states: Dict[str, Any] = {}
        self._extra_data: Dict[str, Any] = {}
        self._damaged: set = set()  # committed ids of output_dir found unloadable by a fallback load
        self._writer_lock: Optional[WriterLock] = None  # taken by the first save (lock.py)
        self._stager: Optional[Stager] = None  # host buffers of async saves, reused
        self._writer: Optional[ThreadPoolExecutor] = None  # runs async saves' writes, one at a time
        self._pending: Optional[Tuple[str, Future]] = None  # (ckpt_id, write future) of async_save
        if sparse_optim is not None:
            self._check_stateful(SPARSE_OPTIM, sparse_optim)
            self._extras[SPARSE_OPTIM] = sparse_optim

    # ----------------------------------------------------------------------------- registration
    def register_for_checkpointing(self, name: str, obj: Any) -> None:
        """Saves ``obj.state_dict()`` in extra.pt under `name`; loading calls ``obj.load_state_dict``."""
        self._check_name(name)
        self._check_stateful(name, obj)
        self._extras[name] = obj

    def register_io_state(self, name: str, obj: Any) -> None:
        """Saves ``obj.dump_io_state()`` per rank; loading calls ``obj.load_io_state(state)``."""
        self._check_name(name)
        if not callable(getattr(obj, "dump_io_state", None)) or not callable(getattr(obj, "load_io_state", None)):
            raise UsageError(f"io state {name!r}: {type(obj).__name__} needs dump_io_state() and "
                             f"load_io_state(state) methods")
        self._io_states[name] = obj

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name or "@" in name:
            raise UsageError(f"registered name {name!r} must be a non-empty string without '@'")
        if name in self._extras or name in self._io_states:
            raise UsageError(f"{name!r} is registered already; pick another name", key=name)
        tables, dense = contents.model_state(self.model)
        if name in tables or name in dense:
            raise UsageError(f"{name!r} is already a table or parameter name of the model", key=name)

    @staticmethod
    def _check_stateful(name: str, obj: Any) -> None:
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise UsageError(f"{name!r}: {type(obj).__name__} needs state_dict() and load_state_dict()")

    # ----------------------------------------------------------------------------------- listing
    def checkpoints(self) -> List[str]:
        """Paths of the committed checkpoints, oldest first."""
        return [self.storage.join(self.output_dir, i) for i in ckptlist.read(self.storage, self.output_dir)]

    def latest_checkpoint(self) -> Optional[str]:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    def get_extra_data(self, name: str) -> Any:
        """The state saved under extra `name` in the checkpoint loaded last."""
        if name not in self._extra_data:
            raise UsageError(f"no extra data {name!r} was loaded; loaded extras: {sorted(self._extra_data)}",
                             key=name)
        return self._extra_data[name]

    # -------------------------------------------------------------------------------------- save
    def save(self, ckpt_id: str, shard_id: Optional[int] = None, shard_num: Optional[int] = None) -> str:
        """Writes checkpoint `ckpt_id` under output_dir and commits it; returns its path.

        Order (docs/FORMAT.md section 5): shard files and io state of every rank, then on rank 0
        model.pt, extra.pt, the index (the commit point) and the `checkpoint` list, then pruning.
        On failure the partial directory is removed and the previous checkpoint stays latest.
        A pending async_save is waited for first; if it failed, its error is raised here.
        """
        ckptlist.validate_id(ckpt_id)
        self._wait_pending(consume=True)
        rank, world = dist.resolve(shard_id, shard_num)
        return self._write_state(ckpt_id, self._capture(rank, world, None), rank, world)

    def async_save(self, ckpt_id: str, shard_id: Optional[int] = None, shard_num: Optional[int] = None,
                   pinned: bool = False) -> Tuple[Future, Future]:
        """Saves like save(), but returns once the state is snapshotted: returns
        ``(stage_future, write_future)``.

        It first waits for the previous async write (raising its error, if any, instead of saving).
        Then it copies every table (ids, embedding and all slots at one moment), the dense tensors,
        extras and io states into host buffers reused from save to save (page-locked for CUDA
        tensors with `pinned`), and hands the copy to a background thread that writes and commits
        it. Training may change the model at once: the checkpoint holds the state at the call.
        `stage_future` is done on return; `write_future` yields the checkpoint path, or the error
        of the write, which is also raised by the next save / async_save, wait() or close(). Every
        rank calls async_save in the same order (the writes run collectives on recsave's group).
        The host copy costs memory of about the size of the tables and dense tensors.
        """
        ckptlist.validate_id(ckpt_id)
        self._wait_pending(consume=True)
        rank, world = dist.resolve(shard_id, shard_num)
        if dist.collective(world):
            dist.recsave_group()  # creating the group is itself a collective: do it on the calling thread
        if self._stager is None or self._stager.pinned != pinned:
            self._stager = Stager(pinned)
        state = self._capture(rank, world, self._stager)
        stage_future: Future = Future()
        stage_future.set_result(None)  # staging is done on this thread, before returning
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="recsave-async-save")
        write_future = self._writer.submit(knobs.carried(self._write_state), ckpt_id, state, rank, world)
        self._pending = (ckpt_id, write_future)
        return stage_future, write_future

    def wait(self) -> Optional[str]:
        """Waits for the pending async write; returns its checkpoint path (None when nothing was
        pending) or raises its error."""
        return self._wait_pending(consume=True)

    @property
    def pending_checkpoint(self) -> Optional[str]:
        """The id an async write is (or was last) writing, until wait(), the next save or a load
        after its success collects it (a failed write stays pending for the next save / wait /
        close to raise)."""
        return self._pending[0] if self._pending is not None else None

    def _wait_pending(self, consume: bool) -> Optional[str]:
        """Waits for the async write. With `consume` its result is collected (its error raised);
        without, an error stays pending for the next save / wait / close."""
        if self._pending is None:
            return None
        ckpt_id, future = self._pending
        exc = future.exception()
        if not consume:
            if exc is None:
                self._pending = None
            return None
        self._pending = None
        if exc is not None:
            note = (f"(raised by the background write of async_save({ckpt_id!r}); the previous "
                    f"committed checkpoint is still the latest)")
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(note)
            else:
                exc.__notes__ = [*getattr(exc, "__notes__", []), note]
            raise exc
        return future.result()

    def _capture(self, rank: int, world: int, stager: Optional[Stager]) -> SaveState:
        tables, dense = contents.model_state(self.model)
        if world > 1:
            for table in tables.values():
                table.set_partition(rank, world, self.num_buckets)
        return capture(tables, dense, self._extras, self._io_states, stager)

    def _write_state(self, ckpt_id: str, state: SaveState, rank: int, world: int) -> str:
        st, out = self.storage, self.output_dir
        ckpt_dir = st.join(out, ckpt_id)
        dist.run_everywhere(f"preparing {ckpt_dir}", lambda: self._prepare_dir(ckpt_dir, ckpt_id), world,
                            only_rank0=True, rank=rank)
        try:
            st.makedirs(ckpt_dir)
            mine = dist.run_everywhere(f"writing the shards of {ckpt_dir}",
                                       lambda: self._write_rank_files(ckpt_dir, state, rank, world), world)
            parts = dist.gather_objects(mine, world)
            dist.run_everywhere(f"committing {ckpt_dir}",
                                lambda: self._commit(ckpt_dir, ckpt_id, parts, state, world),
                                world, only_rank0=True, rank=rank)
        except BaseException:
            if rank == 0:
                self._discard_uncommitted(ckpt_dir, ckpt_id)
            raise
        return ckpt_dir

    def _discard_uncommitted(self, ckpt_dir: str, ckpt_id: str) -> None:
        """Removes a failed save's directory unless it made it into the `checkpoint` list."""
        try:
            if ckpt_id not in ckptlist.read(self.storage, self.output_dir):
                self.storage.remove_tree(ckpt_dir)
        except Exception:  # the original error matters more; the next save cleans leftovers
            pass

    def _prepare_dir(self, ckpt_dir: str, ckpt_id: str) -> None:
        self._writer_lock = hold_writer_lock(self._writer_lock, self.storage, self.output_dir)
        listed_ids = ckptlist.read(self.storage, self.output_dir)
        if ckpt_id in self._damaged and ckpt_id in listed_ids:
            # A fallback restore skipped this damaged checkpoint: unlist it, then write it anew.
            ckptlist.write(self.storage, self.output_dir, [i for i in listed_ids if i != ckpt_id])
            listed_ids.remove(ckpt_id)
        self._damaged.discard(ckpt_id)
        listed = ckpt_id in listed_ids
        if listed and self.storage.exists(self.storage.join(ckpt_dir, index_mod.INDEX_FILE)):
            raise CheckpointExistsError(
                f"{ckpt_dir} is a committed checkpoint already; save under another id or delete it first",
                path=ckpt_dir)
        # A leftover of a crashed save (no index, or an index that never made it into the list) was
        # never committed: safe to replace.
        if self.storage.exists(ckpt_dir):
            self.storage.remove_tree(ckpt_dir)
        self.storage.makedirs(self.output_dir)

    def _write_rank_files(self, ckpt_dir: str, state: SaveState, rank: int, world: int) -> tuple:
        part = index_mod.new_part(rank)
        rows: Dict[str, int] = {}
        names = sorted(state.tables)
        # The next table's bucket order is computed while this one is written (two in memory at
        # most). Durable files are fsynced and renamed together when the block exits, before the
        # commit point (format/commits.py). Plain threads (recsave/threads.py): an async save may
        # be writing at interpreter exit.
        with DeferredCommits() as commits:
            layout_of = knobs.carried(self._bucket_layout)
            order = lambda k: threads.start(layout_of, names[k], state.tables[names[k]], rank, world,  # noqa: E731
                                            name="recsave-order")
            upcoming = order(0) if names else None
            try:
                for k, name in enumerate(names):
                    layout = upcoming.result()
                    upcoming = order(k + 1) if k + 1 < len(names) else None
                    table_part = self._write_table(ckpt_dir, layout, rank, len(part.files), commits)
                    rows[name] = layout.num_rows
                    part = part.joined(table_part)
            except BaseException:
                if upcoming is not None:  # nothing reads the tables after the save returns
                    futures_wait([upcoming])
                raise
        part = part.with_files({io_state_file(rank): torchio.save(self.storage, ckpt_dir, io_state_file(rank),
                                                                  state.io_state, rank)})
        return part, rows

    def _bucket_layout(self, name: str, table: TableState, rank: int, world: int) -> "_TableLayout":
        """A table's tensors with rows sorted by bucket: ids, embedding and slots as sources the
        writer gathers as it writes (never a second copy of the table)."""
        # Peak memory here grows with the table's rows: temporaries are few and freed early.
        ids, rows = table.id_rows()
        first, stop = partition.bucket_range(rank, world, self.num_buckets)
        keys = partition.bucket_of(ids, self.num_buckets).sub_(first)  # bucket - first
        if world > 1 and bool(((keys < 0) | (keys >= stop - first)).any()):
            raise UsageError(
                f"table {name!r} on rank {rank} of {world} holds ids owned by other ranks; route ids "
                f"with recsave.partition.owner_of(ids, {world}) before the lookup", key=name)
        order = partition.stable_order(keys, stop - first)
        row_starts = [0] + torch.cumsum(torch.bincount(keys, minlength=stop - first), 0).tolist()
        del keys
        # Ids come in row order with distinct rows: a table that never freed a row has rows 0..n-1,
        # and its rows in bucket order are the order itself.
        dense = rows.numel() == 0 or int(rows[-1]) == rows.numel() - 1
        sorted_rows = order if dense else rows[order]
        tensors: Dict[str, Any] = {f"{name}@id": RowSource.take(ids, order)}
        buffers = PinnedPair() if any(t.is_cuda for t in table.columns.values()) else None
        for column in ["embedding"] + table.slot_names():
            tensors[f"{name}@{column}"] = table.row_source(column, sorted_rows, buffers)
        seg_max = knobs.get("segment_bytes")
        segments = {n: bucket_segment_ends(row_starts, t.nbytes // max(ids.numel(), 1), seg_max)
                    for n, t in tensors.items()}
        return _TableLayout(tensors, {"buckets": {"first": first, "row_starts": row_starts}}, segments,
                            int(ids.numel()))

    def _write_table(self, ckpt_dir: str, layout: "_TableLayout", rank: int, first_part: int,
                     commits: DeferredCommits) -> IndexPart:
        """Writes one table's files (the engine gathers embedding and slots in bucket order)."""
        return write_shards(ckpt_dir, layout.tensors, rank=rank, concurrency=self.concurrency,
                            storage=self.storage, chunk_meta={t: layout.meta for t in layout.tensors},
                            first_part=first_part, segments=layout.segments, commits=commits)

    def _commit(self, ckpt_dir: str, ckpt_id: str, gathered: Sequence[tuple], state: SaveState,
                world: int) -> None:
        st = self.storage
        parts = [part for part, _ in gathered]
        rows: Dict[str, int] = {}
        for _, table_rows in gathered:
            for name, count in table_rows.items():
                rows[name] = rows.get(name, 0) + count
        files = {
            MODEL_FILE: torchio.save(st, ckpt_dir, MODEL_FILE, {n: t.cpu() for n, t in state.dense.items()}, 0),
            EXTRA_FILE: torchio.save(st, ckpt_dir, EXTRA_FILE, state.extras, 0),
            IO_COUNT_FILE: torchio.save_bytes(st, ckpt_dir, IO_COUNT_FILE, f"{world}\n".encode(), 0),
        }
        m = _STEP_ID.match(ckpt_id)
        meta = contents.index_meta(state.tables, state.dense, state.extras, state.io_state, world, rows)
        index = index_mod.merge_parts(parts, step=int(m.group(1)) if m else None, world_size=world,
                                      partition=Partition(partition.SCHEME, self.num_buckets),
                                      meta=meta)
        index = index.with_files(files)
        index_mod.write(ckpt_dir, index, storage=st)
        self._publish(ckpt_id)

    def _publish(self, ckpt_id: str) -> None:
        """Lists the new checkpoint (one atomic replace of `checkpoint`), then deletes what fell out
        of max_keep and leftovers of crashed saves. Never deletes the checkpoint just written."""
        st, out = self.storage, self.output_dir
        ids = [i for i in ckptlist.read(st, out) if i != ckpt_id] + [ckpt_id]
        keep = ids if self.max_keep is None else ids[-self.max_keep:]
        ckptlist.write(st, out, keep)
        ckptlist.collect_garbage(st, out, keep)

    # ------------------------------------------------------------------------- writer lock: close
    def close(self) -> None:
        """Waits for a pending async write (raising its error), frees the async host buffers and
        releases the writer lock of output_dir taken by the first save (the lock is also released
        when the Saver is garbage-collected or the interpreter exits). A later save takes it again."""
        try:
            self._wait_pending(consume=True)
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            if self._stager is not None:
                self._stager.release()
                self._stager = None
            if self._writer_lock is not None:
                self._writer_lock.release()
                self._writer_lock = None

    # -------------------------------------------------------------------------------------- load
    def load(self, ckpt_path: Optional[str] = None, ckpt_id: Optional[str] = None,
             load_conf: Optional[Dict[str, Any]] = None, shard_id: Optional[int] = None,
             direct_path: bool = False, fallback: bool = False) -> LoadReport:
        """Loads a checkpoint into the model and the registered objects.

        `ckpt_path` is an output dir (its latest checkpoint, or `ckpt_id`) or, with `direct_path`,
        a checkpoint directory; default: this saver's output_dir. `load_conf` selects what to load
        (DESIGN.md "Load / model-bank config"). With `fallback`, when the latest checkpoint of an
        output dir is corrupt or incomplete, the previous committed one is loaded instead (and so
        on), with a warning naming the bad one. A pending async write is waited for first (its
        error, if any, stays for the next save / wait / close)."""
        self._wait_pending(consume=False)
        conf = dict(load_conf or {})
        if ckpt_path is not None:
            conf["path"] = ckpt_path
        conf.setdefault("path", self.output_dir)
        if fallback and ckpt_id is None and not direct_path:
            return self._load_with_fallback(conf, shard_id)
        return loader.load_entries(self, [conf], shard_id=shard_id, ckpt_id=ckpt_id, direct_path=direct_path)

    def _load_with_fallback(self, conf: Dict[str, Any], shard_id: Optional[int]) -> LoadReport:
        """Loads the newest loadable committed checkpoint of the output dir conf["path"]."""
        path = conf["path"]
        st = get_storage(path)
        if st.exists(st.join(path, index_mod.INDEX_FILE)) or not st.exists(st.join(path, ckptlist.LIST_FILE)):
            return loader.load_entries(self, [conf], shard_id=shard_id)  # not an output dir
        ids = ckptlist.read(st, path)
        for n, ckpt_id in enumerate(reversed(ids)):
            try:
                return loader.load_entries(self, [conf], shard_id=shard_id, ckpt_id=ckpt_id)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                if n == len(ids) - 1:
                    raise
                if path == self.output_dir:  # the next save of this id replaces it
                    self._damaged.add(ckpt_id)
                warnings.warn(f"{st.join(path, ckpt_id)} cannot be loaded ({type(exc).__name__}: {exc}); "
                              f"falling back to the previous committed checkpoint "
                              f"{st.join(path, ids[-n - 2])}", RuntimeWarning, stacklevel=3)
        return loader.load_entries(self, [conf], shard_id=shard_id)  # no ids: raises not found

    def load_by_config(self, ckpt_path: str, load_conf: Optional[Dict[str, Any]] = None,
                       shard_id: Optional[int] = None) -> LoadReport:
        """Loads `ckpt_path` (checkpoint dir or output dir) as selected by `load_conf`."""
        if not isinstance(ckpt_path, str) or not ckpt_path:
            raise CheckpointNotFoundError(f"ckpt_path must name a checkpoint, got {ckpt_path!r}")
        return self.load(ckpt_path, load_conf=load_conf, shard_id=shard_id)

    def load_model_bank(self, entries: Sequence[Dict[str, Any]], shard_id: Optional[int] = None) -> LoadReport:
        """Applies bank entries in order; for a name given by several entries the last one wins."""
        if not isinstance(entries, (list, tuple)):
            raise ConfigError("model bank entries must be a list of dicts")
        self._wait_pending(consume=False)
        return loader.load_entries(self, list(entries), shard_id=shard_id, require_path=True)

    def plan_model_bank(self, entries: Sequence[Dict[str, Any]], shard_id: Optional[int] = None) -> LoadPlan:
        """Dry run of load_model_bank: resolves every entry and lists, per name, the source, rows and
        bytes to read, and what stays initialised. Reads only indexes; changes nothing."""
        if not isinstance(entries, (list, tuple)):
            raise ConfigError("model bank entries must be a list of dicts")
        return loader.plan_entries(self, list(entries), shard_id=shard_id, require_path=True)
