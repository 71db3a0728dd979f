"""Carry out a LoadPlan: read and verify what each entry wins and stage it (tables, then slot-only
merges, dense parameters, extras and io states), then apply it all at once (load/transaction.py):
a load that fails, on any rank, leaves the model as it was."""
from __future__ import annotations

import functools
import os
import sys
import traceback
import warnings
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch

from recsave import knobs
from recsave.errors import ConfigError
from recsave.format.chain import IndexIdentity
from recsave.format.records import KIND_DELTA, KIND_FULL
from recsave.load import config, contents, merge, shared_reads
from recsave.load.config import SPARSE_OPTIM, Plan, sparse_optim_steps
from recsave.load.plan import LoadPlan, LoadTarget, Won, plan_entries, table_columns
from recsave.load.report import LoadedItem, LoadReport, table_rows_read
from recsave.load.sources import CheckpointSource, chain_dirs
from recsave.load.transaction import LoadTransaction, io_state_change, state_dict_change
from recsave.storage import dist
from recsave.tables.devcopy import HostToDevice
from recsave.tables.hashtable import HashTable
from recsave.tables.partition import DEFAULT_NUM_BUCKETS
from recsave.tables.rows import META_COLUMNS
from recsave.tables.staging import DeferredIds
from recsave.tables.tablelike import refuse_meta_tensors


def execute(target: LoadTarget, plan: LoadPlan, only: Optional[Set[str]] = None) -> LoadReport:
    """Carries out a plan from plan_entries (optionally only for the model names in `only`)."""
    ex = plan.resolved
    if ex is None:
        raise ConfigError("this LoadPlan was not made by plan_model_bank / plan_entries")
    tables, dense = contents.model_state(target.model)
    if only is not None:
        only = names_executed(plan, only)
    won = [{n: v for n, v in w.items() if only is None or n in only} for w in ex.won]
    report = LoadReport(checkpoints=[c for c in plan.checkpoints if c], skipped=list(plan.skipped),
                        missing=list(plan.missing), unexpected=list(plan.unexpected), notes=list(plan.notes))
    report.step = ex.sources[-1].step if ex.sources else None
    report.indexes_read = {src.ckpt_dir: read for src in ex.sources if (read := _index_read(src)) is not None}
    report.read_whole = [d for src, w in zip(ex.sources, won) if _reads_every_table(src, w)
                         for d in chain_dirs(src) or [src.ckpt_dir]]
    tx = LoadTransaction(tables, dense)
    extra_data: Dict[str, Any] = {}
    slotted = {name for name, t in tables.items() if callable(getattr(t, "slot_names", None)) and t.slot_names()}
    uncounted: Dict[str, int] = {}  # tables whose slots came from a source without step counts -> count kept

    def stage() -> None:
        # A plan executed after the model changed (plan_model_bank, then execute_plan) is checked
        # again (here, where every rank learns of a rank's refusal): a table whose dim or dtype
        # changed would otherwise be cut, padded or cast silently.
        refuse_meta_tensors({n: dense[n] for w in won for n, (cat, _) in w.items() if cat == "dense"},
                            f"loading {where}")
        model = contents.of_model(tables, dense, target.extras, target.io_states, target.optional)
        for p, src, w in zip(ex.plans, ex.sources, ex.won):
            config.recheck(p, model, src.contents, w)
        # Small files first: they are read and verified before any table is (rank 0 reads them
        # for every rank where they are the same files).
        pt_files = shared_reads.read_pt_files(
            ex.sources, [_pt_files_needed(s, w, slotted) for s, w in zip(ex.sources, won)], ex.world)
        for slots_only in (False, True):
            for src, p, w in zip(ex.sources, ex.plans, won):
                _stage_tables(target, tx, src, p, w, ex.rank, ex.world, plan, report, slots_only)
        counts = _step_counts(target, slotted, ex.sources, won, [p.conf.hashtable_clear for p in ex.plans], pt_files,
                              uncounted)
        if uncounted and ex.rank == 0:  # every rank has the same counts
            # Before anything is applied: a warning made an error (-W error) leaves the model as it was.
            _warn_uncounted(uncounted)
        for src, w, files in zip(ex.sources, won, pt_files):
            _stage_small(target, tx, src, w, files, ex.rank, ex.world, plan, report, extra_data, counts)
        if counts is not None and not any(SPARSE_OPTIM in w for w in won) \
                and counts != target.extras[SPARSE_OPTIM].steps:
            # Tables or slots loaded without the optimizer's state (excluded): their counts go along.
            tx.stage_call("sparse optimizer step counts", _steps_change(target.extras[SPARSE_OPTIM], counts))

    # Every rank has read and verified what it needs before any rank changes its model.
    where = ", ".join(report.checkpoints) or "the model bank"
    try:
        # Every rank must load the same checkpoints (by id: per-rank output dirs differ in path),
        # else each would apply its share of another one, and the same names (a sharded table
        # loaded on some ranks only would be half restored, dense replicas would diverge); agreed
        # in this exchange, no extra round.
        ids = [(src.ckpt_dir.rstrip("/").rsplit("/", 1)[-1], src.step) for src in ex.sources]
        names = sorted({name for w in won for name in w})
        dist.run_everywhere(f"reading {where}", stage, ex.world,
                            agree=("the checkpoints and names loaded", (ids, names)))
        try:
            dist.run_everywhere(f"applying the load of {where}", tx.apply, ex.world)
        except BaseException:
            tx.rollback()  # another rank failed to apply: undo here too
            raise
    except BaseException as exc:
        # A caller may keep the error (a fallback load tries the next checkpoint meanwhile): the
        # locals of the finished frames in its traceback (a half-staged table among them) go now.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        tx.done()  # the staged (or, after a success, the replaced) tables are dropped
    target.extra_data.update(extra_data)
    report.rows_read = table_rows_read(report.loaded)
    report.bytes_read = sum(it.nbytes for it in report.loaded.values())
    return report


def load_entries(target: LoadTarget, entries: Any, **kwargs: Any) -> LoadReport:
    """Plans and executes config entries in order; the last entry wins a name. Every rank of a
    process group takes part: rank 0 reads each index once for all (load/shared_reads.py)."""
    return execute(target, plan_entries(target, entries, share_reads=True, **kwargs))


def _index_read(src: Any) -> Optional[IndexIdentity]:
    """What a load read of a full or delta checkpoint's index (None for other sources)."""
    if not isinstance(src, CheckpointSource) or src.index_crc is None or src.index.kind not in (KIND_FULL, KIND_DELTA):
        return None
    base = src.index.base if src.index.is_delta and src.index.base else src.storage.split(src.ckpt_dir.rstrip("/"))[1]
    return IndexIdentity(src.index_crc, base)


def _reads_every_table(src: Any, won: Won) -> bool:
    """Whether the names `won` from `src` cover each of its tables with all their columns."""
    read: Dict[str, Set[str]] = {}
    for src_table, columns in table_columns(won).values():
        read.setdefault(src_table, set()).update(columns.values())
    return all({"embedding", *info.slots} <= read.get(name, set()) for name, info in src.contents.tables.items())


def _pt_files_needed(src: Any, won: Won, slotted: Set[str]) -> List[str]:
    """The .pt files of a source that the names it wins come from (extra.pt also for the step
    counts of the slots it wins, or of the tables without slots, when it holds a sparse
    optimizer's state: _step_counts)."""
    files = []
    if any(cat == "dense" for cat, _ in won.values()):
        files.append("model.pt")
    counts = SPARSE_OPTIM in getattr(src.contents, "extras", ()) and any(
        (cat == "sparse_opt" and name != SPARSE_OPTIM) or (cat == "sparse" and name not in slotted)
        for name, (cat, _) in won.items())
    if counts or any(cat == "extra" or name == SPARSE_OPTIM for name, (cat, _) in won.items()):
        files.append("extra.pt")
    return files


def _source_counts(src: Any, files: Dict[str, Any]) -> Optional[Dict[str, int]]:
    """The per-table step counts of a source's sparse optimizer: in its extra.pt, if read, or in a
    Parquet export's manifest (`optimizer_steps`)."""
    counts = sparse_optim_steps(files.get("extra.pt"))
    if counts is not None:
        return counts
    recorded = getattr(src, "optimizer_steps", None)
    return recorded() if callable(recorded) else None


def _step_counts(target: LoadTarget, slotted: Set[str], sources: Sequence[Any], won: Sequence[Won],
                 clears: Sequence[bool], pt_files: Sequence[Dict[str, Any]],
                 uncounted: Dict[str, int]) -> Optional[Dict[str, int]]:
    """The sparse optimizer's per-table step counts after this load. A count goes with the
    optimizer state it belongs to (Adagrad's lr_decay and Adam's bias correction read it): the
    slots of a table with slots (`slotted`), else the table's rows. In the order staging applies
    them (every entry's tables, then every entry's slots; the later entry wins each):
    - a table an entry replaces (`clears`) gets its slots at their init: count 0, unless it has no
      slots, when it takes that source's count of the source table (its name before an `oname`
      rename);
    - a table whose slots an entry loads takes that source's count;
    - every other table keeps its live count (a table the load does not take or the checkpoint
      lacks, a merge, a source without counts).
    Counts of source tables the model lacks are never taken. None without a sparse optimizer
    that keeps counts (`steps`). Tables whose slots (any of them) came from a source without
    counts are put in `uncounted`, with the count they keep."""
    live = getattr(target.extras.get(SPARSE_OPTIM), "steps", None)
    if not isinstance(live, dict):
        return None
    counts = dict(live)
    counted = [_source_counts(src, files) for src, files in zip(sources, pt_files)]
    for w, clear, source_counts in zip(won, clears, counted):
        if not clear:  # a merge: the live rows (and slots) stay, so do the counts
            continue
        for name, (category, source) in w.items():
            if category != "sparse" or name not in counts:
                continue
            if name in slotted:
                counts[name] = 0
            elif source_counts is not None and source in source_counts:
                counts[name] = source_counts[source]
    without: Set[str] = set()
    for w, source_counts in zip(won, counted):
        for name, (category, source) in w.items():
            table, source_table = name.partition("@")[0], source.partition("@")[0]
            if category != "sparse_opt" or name == SPARSE_OPTIM or table not in counts:
                continue
            if source_counts is not None and source_table in source_counts:
                counts[table] = source_counts[source_table]
            else:  # a slot without its count: whatever the others bring, they do not go together
                without.add(table)
    uncounted.clear()
    uncounted.update({t: counts[t] for t in sorted(without)})
    return counts


def _refuse_other_optimizer(src: Any, state: Any, optimizer: Any) -> None:
    """ConfigError, while staging (before anything changes, naming the source), when the source's
    sparse optimizer state is another optimizer's: its load_state_dict would refuse it only when
    the load is applied, after every table was read."""
    saved = state.get("optimizer") if isinstance(state, dict) else None
    mine = type(optimizer).__name__
    if isinstance(saved, str) and saved != mine:
        raise ConfigError(f"{src.ckpt_dir}: its sparse optimizer state is a {saved}'s, the model's optimizer is "
                          f"a {mine}; exclude 'sparse_optim' to load the tables without it (slots load where "
                          f"their names match), or construct a {saved}", path=src.ckpt_dir, key=SPARSE_OPTIM)


def _warn_uncounted(uncounted: Dict[str, int]) -> None:
    """Trained slots with a step count that does not go with them: Adam bias-corrects its m / v as
    if new, Adagrad's lr_decay restarts. Said, since nothing else would show it."""
    warnings.warn(
        f"the slots of table(s) {sorted(uncounted)} were loaded from a source that records no sparse optimizer "
        f"step count for them (a torch.save / DCP file, a Parquet export without optimizer_steps, a "
        f"checkpoint saved without that optimizer); their counts stay {list(uncounted.values())}: set the "
        f"sparse optimizer's steps[<table>] if you know them", RuntimeWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """warnings.warn's stacklevel for the first frame outside the recsave package (the user's
    load call), from _warn_uncounted's caller."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame: Optional[FrameType] = sys._getframe(2)  # noqa: SLF001 (the frame walk warnings itself does)
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _steps_change(optimizer: Any, counts: Dict[str, int]) -> Callable[[], Any]:
    """Sets a sparse optimizer's per-table step counts alone (its state is not loaded)."""
    def apply() -> Callable[[], None]:
        before = dict(optimizer.steps)
        optimizer.steps = dict(counts)
        return lambda: setattr(optimizer, "steps", before)
    return apply


def names_executed(plan: LoadPlan, only: Set[str]) -> Set[str]:
    """What execute(plan, only) loads: `only`, plus the slots of the tables in it that their entry
    clears (below)."""
    ex = plan.resolved
    if ex is None:
        raise ConfigError("this LoadPlan was not made by plan_model_bank / plan_entries")
    return _with_slots_of_reloaded_tables(only, ex.won, [p.conf.hashtable_clear for p in ex.plans])


def _with_slots_of_reloaded_tables(only: Set[str], won: Sequence[Won], clears: Sequence[bool]) -> Set[str]:
    """`only` plus the slots of every table in it that its entry clears (`clears`, per entry): such
    a table is staged afresh, so its slots must be loaded again too, each from the entry that won
    it, not left at their init. A merge (hashtable_clear=False) keeps the live rows and their
    slots, which training has changed since: reloading another entry's slot would revert them."""
    reloaded = {n for w, clear in zip(won, clears) for n, (category, _) in w.items()
                if category == "sparse" and n in only and clear}
    return set(only) | {n for w in won for n, (category, _) in w.items()
                        if category == "sparse_opt" and n.split("@", 1)[0] in reloaded}


def _fit(values: torch.Tensor, table: HashTable, ids: torch.Tensor, column: str) -> torch.Tensor:
    """Applies the entry's dim policy (checked in planning): truncate, or pad with the values new
    rows would get (the table's initialiser for embeddings, the slot's init value for slots)."""
    dim = table.embedding_dim
    if values.shape[1] > dim:
        return values[:, :dim]
    if values.shape[1] < dim:
        # In the table's dtype: with dtype_policy cast the padding must not take the checkpoint's
        # rounding (a bf16 checkpoint padded into an fp32 table).
        if column == "embedding":
            out = table.initial_rows(ids).to(table.dtype)
        else:
            out = torch.full((values.shape[0], dim), table.slot_init(column), dtype=table.dtype)
        out[:, :values.shape[1]] = values
        return out
    return values


def _stage_tables(target: LoadTarget, tx: LoadTransaction, src: Any, plan: Plan, won: Won, rank: int, world: int,
                  load_plan: LoadPlan, report: LoadReport, slots_only: bool) -> None:
    staged = []
    for table_name, (src_table, columns) in sorted(table_columns(won).items()):
        has_embedding = "embedding" in columns
        if has_embedding == slots_only:
            continue
        keep_rows = not (has_embedding and plan.conf.hashtable_clear)
        # A load of a table's rows in one process makes a shard whole; slots alone leave it as it is.
        # One process needs no buckets (a world of 1 drops the partition): a checkpoint whose index
        # has none (docs/FORMAT.md allows null) loads there.
        buckets = src.num_buckets if world > 1 else DEFAULT_NUM_BUCKETS
        table = tx.table(table_name, keep_rows=keep_rows,
                         partition=(rank, world, buckets) if world > 1 or has_embedding else None)
        # row metadata, for tables that keep it (a TableLike need not)
        keeps_meta = has_embedding and callable(getattr(table, "meta_columns", None))
        meta = src.meta_columns(src_table) if keeps_meta else []
        # what the restore fast path reads: the columns and the row metadata
        staged.append((table_name, src_table, columns, table, meta, {**columns, **{m: m for m in meta}}))
    # HashTables on the CPU restored from a checkpoint are read in one pass, straight into their storage
    batch = [(name, src_table, read, table)
             for name, src_table, _, table, _, read in _in_place_batch(staged, src, plan)]
    in_place = _load_cpu_tables_in_place(target, batch, src, rank, world)
    batched = {name for name, _, _, _ in batch}  # those not in_place repeat an id: the general path
    # A chain's CPU tables: their bases in that one pass too, then each table's deltas.
    based = _load_chain_bases_in_place(target, staged, src, plan, rank, world) if src.kind == "chain" else set()
    for table_name, src_table, columns, table, meta, read in staged:
        has_embedding = "embedding" in columns
        # A load's rows take the source's table step when they replace the table's rows (the fast
        # paths restore: hashtable_clear) or go into a table never stepped (step 0: the same on
        # every rank, where emptiness of a rank's shard is not); merged into a stepped table they
        # move into its timeline.
        adopt_step = has_embedding and plan.conf.hashtable_clear
        if table_name in in_place:
            loaded_rows = len(table)
        elif has_embedding and src.kind == "chain" and _load_chain_in_place(target, table, src, src_table, columns,
                                                                            plan, rank, world,
                                                                            table_name in based):
            loaded_rows = len(table)
        elif has_embedding and table_name not in batched and _load_in_place(target, table, src, src_table, read,
                                                                             plan, rank, world):
            loaded_rows = len(table)
        else:
            ids, data = src.read_table(src_table, list(columns.values()) + meta, rank, world, target.concurrency)
            if src.kind not in ("checkpoint", "chain"):  # a Saver's files hold each id once (its id map)
                _refuse_repeated_ids(src, src_table, ids)
            for slot in columns:  # a slot of the checkpoint the (scratch) table lacks is created first:
                if slot != "embedding" and slot not in table.slot_names():  # padding reads its init
                    table.add_slot(slot)
            values = {c: _fit(data[s], table, ids, c) for c, s in columns.items()}
            slot_values = {c: v for c, v in values.items() if c != "embedding"}
            adopt_step = adopt_step or (has_embedding and getattr(table, "step", 0) == 0)
            if has_embedding:
                rows_meta = {m: data[m] for m in meta}
                if not adopt_step:
                    rows_meta = _into_live_timeline(rows_meta, table, src.table_step(src_table))
                with_meta = {"meta": rows_meta} if meta else {}  # TableLike: no meta argument
                table.load_rows(ids, values["embedding"], slot_values, clear=plan.conf.hashtable_clear, **with_meta)
                loaded_rows = ids.numel()
            else:
                # `rows` counts the rows read, as the plan's and an embedding's do (docs/API.md,
                # LoadReport), not the ids set_slot_rows found in the table
                table.set_slot_rows(ids, slot_values)
                loaded_rows = ids.numel()
        step = src.table_step(src_table)
        if adopt_step and step is not None and hasattr(table, "advance_step"):
            table.step = step
        for column in columns:
            name = table_name if column == "embedding" else f"{table_name}@{column}"
            planned = load_plan.items[name]
            report.loaded[name] = LoadedItem(won[name][0], src.ckpt_dir, won[name][1], loaded_rows,
                                             planned.nbytes)


def _refuse_repeated_ids(src: Any, table: str, ids: torch.Tensor) -> None:
    """A Parquet or torch.save source may list an id twice (two files, or a hand-made tensor):
    which row would win is arbitrary, so the load is refused, as convert refuses it."""
    values, counts = torch.unique(ids, return_counts=True)
    if values.numel() != ids.numel():
        repeated = values[counts > 1]
        raise ConfigError(f"{src.ckpt_dir}: table {table!r} lists {repeated.numel()} id(s) more than once "
                          f"(e.g. {repeated[:5].tolist()}); each id must appear once: drop the repeats "
                          f"from the source", path=src.ckpt_dir, key=table)


def _into_live_timeline(meta: Dict[str, torch.Tensor], table: Any, src_step: Optional[int]
                        ) -> Dict[str, torch.Tensor]:
    """Row metadata of rows merged into a stepped table (hashtable_clear=False, step > 0): the table
    keeps its step, and each merged row's last_step moves by (table step - the source's step),
    floored at 0, so its age (what evict(older_than_steps=...) reads) is the one it had in its
    source, not a step of another job's count (docs/API.md)."""
    if src_step is None or "last_step" not in meta or not hasattr(table, "advance_step"):
        return meta
    shift = int(table.step) - src_step
    return {**meta, "last_step": (meta["last_step"] + shift).clamp_(min=0)}


def _chain_applies(table: Any, src: Any, src_table: str, columns: Dict[str, str]) -> bool:
    """Whether a chain's table restores in place: a table with the ops the deltas need (a TableLike
    goes the general path, which stages the merged rows with load_rows), and every delta holds the
    table's columns."""
    if not all(callable(getattr(table, m, None)) for m in ("prepare_load", "delete", "meta_columns")):
        return False
    for member in src.members[1:]:
        info = member.index.meta.tables.get(src_table) if member.index.meta is not None else None
        if info is None or any(f"{src_table}@{c}" not in member.index.tensors for c in columns.values()):
            return False
    return True


def _in_place_batch(staged: List[Any], src: Any, plan: Plan,
                    also: Callable[[Any, str, Dict[str, str]], bool] = lambda *_: True) -> List[Any]:
    """The staged entries whose CPU HashTable restores from `src` in the one-pass fast path (and
    passes `also`); one model table per checkpoint table: the reads are keyed by the checkpoint's
    table, so a second model table loading the same one (oname) takes the one-table path."""
    batch: List[Any] = []
    for entry in staged:
        _, src_table, columns, table, _, _ = entry
        if "embedding" in columns and isinstance(table, HashTable) and table.device.type == "cpu" \
                and _restores_in_place(table, src, src_table, plan) and also(table, src_table, columns) \
                and all(b[1] != src_table for b in batch):
            batch.append(entry)
    return batch


def _load_chain_bases_in_place(target: LoadTarget, staged: List[Any], src: Any, plan: Plan, rank: int,
                               world: int) -> Set[str]:
    """The bases of a chain's CPU HashTables in one pass, as a full checkpoint's tables are restored
    (_load_cpu_tables_in_place: the id maps rebuilt while the columns are read, not table after
    table). Returns the names whose base is in place; their deltas are _load_chain_in_place's."""
    if not any("embedding" in columns for _, _, columns, _, _, _ in staged):
        return set()  # a slots-only pass
    base = src.member_source(src.members[0])
    tables = _in_place_batch(staged, base, plan, lambda table, src_table, columns:
                             _chain_applies(table, src, src_table, columns))
    batch = [(name, src_table, {**columns, **{m: m for m in base.meta_columns(src_table)}}, table)
             for name, src_table, columns, table, _, _ in tables]
    return _load_cpu_tables_in_place(target, batch, base, rank, world)


def _load_chain_in_place(target: LoadTarget, table: HashTable, src: Any, src_table: str, columns: Dict[str, str],
                         plan: Plan, rank: int, world: int, base_loaded: bool = False) -> bool:
    """A delta's restore: the chain's base through the fast path (straight into the table; already
    there with `base_loaded`), then each delta applied with table ops (clear when cleared, delete
    its tombstones, upsert its rows with their metadata): docs/FORMAT.md section 10. Each member
    is read once. False: use the general path (the table's state is then replaced by it)."""
    if not base_loaded:
        if not _chain_applies(table, src, src_table, columns):
            return False
        base = src.member_source(src.members[0])
        base_meta = base.meta_columns(src_table)
        if not _load_in_place(target, table, base, src_table, {**columns, **{m: m for m in base_meta}},
                              plan, rank, world):
            return False
    for member in src.members[1:]:
        info = member.index.meta.tables.get(src_table) if member.index.meta is not None else None
        if info is None:  # _chain_applies checked every member: the general path replaces the table
            return False
        ids, data, tombstones = merge.read_member(src.member_source(member), src_table,
                                                  list(columns.values()) + list(META_COLUMNS), rank, world,
                                                  target.concurrency)
        if info.cleared:
            table.clear()
        if tombstones is not None and tombstones.numel():
            table.delete(tombstones)
        slots = {c: data[s] for c, s in columns.items() if c != "embedding"}
        table.load_rows(ids, data[columns["embedding"]], slots, clear=False,
                        meta={m: data[m] for m in META_COLUMNS})
    return True


def _restores_in_place(table: Any, src: Any, src_table: str, plan: Plan) -> bool:
    """Whether the restore fast path applies: a HashTable (prepare_load is optional in TableLike)
    cleared by the load, from a checkpoint table of the same dim and dtype (its slots' too: the
    files are read straight into the table's storage)."""
    info = src.contents.tables.get(src_table)
    dtype = contents.dtype_name(table.dtype)
    return (callable(getattr(table, "prepare_load", None)) and plan.conf.hashtable_clear
            and src.kind == "checkpoint" and info is not None and info.dim == table.embedding_dim
            and info.dtype == dtype and all(d == dtype for d in info.slot_dtypes.values()))


def _load_cpu_tables_in_place(target: LoadTarget, batch: List[Any], src: Any, rank: int, world: int) -> Set[str]:
    """The restore fast path for several CPU tables, given as (name, checkpoint table, columns,
    table): their ids are read, then every table's columns in one pass straight into its storage
    while the id maps are rebuilt (HashTable.prepare_loads). Returns the names restored; a table
    whose ids repeat is left to the general path."""
    if not batch:
        return set()
    threads = target.concurrency

    # What fill reads, without the tables: a failed load's error must not keep them alive (its
    # traceback holds the fill thread's frames; execute clears the frames' locals, not closures).
    reads = [(src_table, columns) for _, src_table, columns, _ in batch]

    def fill(views: List[Dict[str, torch.Tensor]]) -> None:
        src.read_tables_into({src_table: {columns[c]: v[c] for c in columns}
                              for (src_table, columns), v in zip(reads, views)}, rank, world, threads)

    def ids_of(src_table: str) -> Any:
        stored = src.index.tensor(f"{src_table}@id")
        if stored.torch_dtype != torch.int64 or len(stored.shape) != 1:  # converted as they are copied
            return lambda: src.read_table(src_table, [], rank, world, threads)[0]

        # Read straight into the table's row ids once the fill has started, on this thread and
        # with one engine thread: the fill's jobs hold the shared pool, and a read whose helpers
        # queue behind them would wait for the whole fill.
        def read_into(dest: torch.Tensor) -> None:
            src.read_table(src_table, [], rank, world, 1, out={"id": dest})
        return DeferredIds(src.id_count(src_table, rank, world), read_into)

    requests = [(table, ids_of(src_table), list(columns)) for _, src_table, columns, table in batch]
    views = HashTable.prepare_loads(requests, fill)
    return {name for (name, _, _, _), v in zip(batch, views) if v is not None}


def _load_in_place(target: LoadTarget, table: HashTable, src: Any, src_table: str, columns: Dict[str, str],
                   plan: Plan, rank: int, world: int) -> bool:
    """The restore fast path of one table (a CUDA table's: its columns go through pinned host
    blocks): a cleared table whose shape and dtype match reads the checkpoint straight into its
    storage (no second copy of the table in memory). False: use the general path."""
    if not _restores_in_place(table, src, src_table, plan):
        return False
    threads = target.concurrency
    ids, _ = src.read_table(src_table, [], rank, world, threads)  # int64, whatever the checkpoint stores
    block_bytes = knobs.get("write_block_bytes")

    def fill(views: Dict[str, torch.Tensor]) -> None:
        if all(v.device.type == "cpu" for v in views.values()):
            src.read_table(src_table, [columns[c] for c in columns], rank, world, threads,
                           out={columns[c]: views[c] for c in columns}, with_ids=False)
            return
        # A device table's columns are read in blocks of about write_block_bytes into two pinned
        # buffers: block k+1 is read while block k is copied to the device, and the host holds
        # two blocks, not two columns.
        with HostToDevice(block_bytes) as h2d:
            for column, view in views.items():
                step = max(1, block_bytes // max(1, view[:1].numel() * view.element_size()))
                for a in range(0, view.shape[0], step):
                    part = view[a:a + step]
                    host = h2d.buffer(part)
                    src.read_table(src_table, [columns[column]], rank, world, threads,
                                   out={columns[column]: host}, with_ids=False, part=(a, a + part.shape[0]))
                    h2d.copy(part, host)

    # The columns are read while the id map is rebuilt from the ids.
    return table.prepare_load(ids, list(columns), fill) is not None


def _stage_small(target: LoadTarget, tx: LoadTransaction, src: Any, won: Won, files: Dict[str, Any],
                 rank: int, world: int, load_plan: LoadPlan, report: LoadReport, extra_data: Dict[str, Any],
                 counts: Optional[Dict[str, int]]) -> None:
    if "extra.pt" in files:
        # What get_extra_data returns: a registered extra's state once this load applies it (under
        # the model's name, after an 'oname' rename), never one the config kept out; unregistered
        # extras of a file read anyway are there to look at (nothing else holds them).
        registered = set(target.extras)
        taken = {source for name, (cat, source) in won.items() if cat == "extra" or name == SPARSE_OPTIM}
        extra_data.update({n: v for n, v in files["extra.pt"].items() if n not in registered and n not in taken})
    io_data = None
    for name, (cat, source) in sorted(won.items()):
        if cat == "dense":
            tx.stage_dense(name, files["model.pt"][source])
        elif cat == "extra" or name == SPARSE_OPTIM:
            state = files["extra.pt"][source]
            if name == SPARSE_OPTIM:
                _refuse_other_optimizer(src, state, target.extras[name])
            if name == SPARSE_OPTIM and counts is not None and isinstance(state, dict):
                state = {**state, "steps": counts}
            tx.stage_call(f"extra {name}", state_dict_change(target.extras[name], state))
            extra_data[name] = state
        elif cat == "io_state":
            saved = src.io_state_count
            if io_data is None:
                ranks = range(saved) if saved != world else [rank]
                io_data = [src.read_pt(f"io_state_{r}.pt") for r in ranks]
            obj = target.io_states[name]
            if saved != world:
                states = [d[source] for d in io_data]
                tx.stage_call(f"io state {name}",
                              io_state_change(obj, functools.partial(obj.load_io_states, states, rank, world)))
            else:
                state = io_data[0][source]
                tx.stage_call(f"io state {name}", io_state_change(obj, functools.partial(obj.load_io_state, state)))
        else:
            continue
        report.loaded[name] = LoadedItem(cat, src.ckpt_dir, source, 0, load_plan.items[name].nbytes)
