"""Loads as plan + execute. Planning resolves every entry to a source (checkpoint or Parquet),
matches names (loadconf), checks shapes and computes rows and bytes — all before anything is
modified; executing reads and applies what each entry wins: tables first, then slot-only merges,
dense parameters, extras and io states."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from recsave.load import contents
from recsave.storage import dist
from recsave.load import config as loadconf
from recsave.errors import ConfigError
from recsave.tables.hashtable import HashTable
from recsave.load.config import SPARSE_OPTIM, Plan
from recsave.load.report import LoadedItem, LoadPlan, LoadReport, PlannedItem
from recsave.tables.devcopy import HostToDevice
from recsave.load.sources import open_source

if TYPE_CHECKING:
    from recsave.save.saver import Saver


@dataclass
class _Execution:
    """What execute() needs beyond the public plan."""
    rank: int
    world: int
    plans: List[Plan]
    sources: List[Any]
    won: List[Dict[str, Tuple[str, str]]]
    entry_of: List[int]   # plan position -> index of its entry in the caller's list


def plan_entries(saver: "Saver", entries: Sequence[Dict[str, Any]], *, shard_id: Optional[int] = None,
                 ckpt_id: Optional[str] = None, direct_path: bool = False,
                 require_path: bool = False) -> LoadPlan:
    """Resolves config entries against the saver's model into a LoadPlan (a dry run)."""
    rank, world = dist.resolve(shard_id, None)
    tables, dense = contents.model_state(saver.model)
    model = contents.of_model(tables, dense, saver._extras, saver._io_states)
    plans: List[Plan] = []
    sources: List[Any] = []
    entry_of: List[int] = []
    result = LoadPlan()
    for i, entry in enumerate(entries):
        conf = loadconf.parse(entry, where=f"model bank entry {i}" if require_path else "load_conf",
                              require_path=True)
        if conf.skip:
            result.checkpoints.append("")
            continue
        src = open_source(conf.path, ckpt_id, direct_path)  # type: ignore[arg-type]
        plans.append(loadconf.plan(conf, model, src.contents, src.ckpt_dir, src.index))
        sources.append(src)
        entry_of.append(i)
        result.checkpoints.append(src.ckpt_dir)
    _check_io_states(plans, sources, world, saver)
    won = loadconf.winners(plans)
    for k, (src, p, w) in enumerate(zip(sources, plans, won)):
        for name in p.skipped:
            if name not in result.skipped:
                result.skipped.append(name)
        result.missing += [n for n in p.missing if n not in result.missing]
        result.unexpected += [n for n in p.unexpected if n not in result.unexpected]
        _plan_items(result, src, w, entry_of[k], rank, world)
    result.left_initialised = sorted(set(model.categories()) - set(result.items))
    result.skipped = sorted(n for n in result.skipped if n not in result.items)
    rows_per_table = {n.partition("@")[0]: it.rows for n, it in result.items.items()
                      if it.category in ("sparse", "sparse_opt") and n != SPARSE_OPTIM}
    result.rows = sum(rows_per_table.values())
    result.nbytes = sum(it.nbytes for it in result.items.values())
    result._execution = _Execution(rank, world, plans, sources, won, entry_of)
    return result


def _table_columns(won: Dict[str, Tuple[str, str]]) -> Dict[str, Tuple[str, Dict[str, str]]]:
    """model table -> (source table, {model column: source column}); columns are 'embedding' or slots."""
    out: Dict[str, Tuple[str, Dict[str, str]]] = {}
    for name, (cat, source) in won.items():
        if cat not in ("sparse", "sparse_opt") or name == SPARSE_OPTIM:
            continue
        table, _, slot = name.partition("@")
        src_table, _, src_slot = source.partition("@")
        entry = out.setdefault(table, (src_table, {}))
        entry[1][slot or "embedding"] = src_slot or "embedding"
    return out


def _plan_items(result: LoadPlan, src: Any, won: Dict[str, Tuple[str, str]], entry: int,
                rank: int, world: int) -> None:
    for table, (src_table, columns) in _table_columns(won).items():
        rows, cost = src.table_cost(src_table, list(columns.values()), rank, world)
        for i, (column, src_column) in enumerate(columns.items()):
            name = table if column == "embedding" else f"{table}@{column}"
            # The ids are read once per table and booked on its first column.
            nbytes = cost[src_column] + (cost["id"] if i == 0 else 0)
            result.items[name] = PlannedItem(won[name][0], src.ckpt_dir, won[name][1], entry, rows, nbytes)
    for name, (cat, source) in won.items():
        if cat == "dense":
            result.items[name] = PlannedItem(cat, src.ckpt_dir, source, entry,
                                             nbytes=_dense_bytes(src, source))
        elif cat in ("extra", "io_state") or name == SPARSE_OPTIM:
            result.items[name] = PlannedItem(cat, src.ckpt_dir, source, entry)


def _dense_bytes(src: Any, name: str) -> int:
    shape, dtype = src.contents.dense[name]
    n = getattr(torch, dtype).itemsize
    for d in shape:
        n *= d
    return n


def _check_io_states(plans: Sequence[Plan], sources: Sequence[Any], world: int, saver: "Saver") -> None:
    """Io states saved by N workers load on M != N only into objects that can reshard them."""
    for p, src in zip(plans, sources):
        names = [n for n, (cat, _) in p.items.items() if cat == "io_state"]
        rigid = [n for n in names if not callable(getattr(saver._io_states[n], "load_io_states", None))]
        if src.io_state_count != world and rigid:
            raise ConfigError(
                f"{src.ckpt_dir}: io state(s) {rigid} were saved by {src.io_state_count} worker(s) but "
                f"{world} are loading; exclude 'io_state', restart with {src.io_state_count} workers, "
                f"or give the object a load_io_states(states, rank, world_size) method that reshards",
                path=src.ckpt_dir)


def execute(saver: "Saver", plan: LoadPlan, only: Optional[set] = None) -> LoadReport:
    """Carries out a plan from plan_entries (optionally only for the model names in `only`)."""
    ex = plan._execution
    if not isinstance(ex, _Execution):
        raise ConfigError("this LoadPlan was not made by plan_model_bank / plan_entries")
    tables, dense = contents.model_state(saver.model)
    won = [{n: v for n, v in w.items() if only is None or n in only} for w in ex.won]
    report = LoadReport(checkpoints=[c for c in plan.checkpoints if c], skipped=list(plan.skipped),
                        missing=list(plan.missing), unexpected=list(plan.unexpected))
    report.step = ex.sources[-1].step if ex.sources else None
    # Small files first: they are verified before any table changes.
    pt_files = [_read_pt_files(s, w) for s, w in zip(ex.sources, won)]
    for slots_only in (False, True):
        for src, p, w in zip(ex.sources, ex.plans, won):
            _apply_tables(saver, tables, src, p, w, ex.rank, ex.world, plan, report, slots_only)
    for src, w, files in zip(ex.sources, won, pt_files):
        _apply_small(saver, dense, src, w, files, ex.rank, ex.world, plan, report)
    rows_per_table: Dict[str, int] = {}
    for name, item in report.loaded.items():
        if item.category in ("sparse", "sparse_opt") and name != SPARSE_OPTIM:
            rows_per_table[name.partition("@")[0]] = item.rows
    report.rows_read = sum(rows_per_table.values())
    report.bytes_read = sum(it.nbytes for it in report.loaded.values())
    return report


def load_entries(saver: "Saver", entries: Sequence[Dict[str, Any]], **kwargs: Any) -> LoadReport:
    """Plans and executes config entries in order; the last entry wins a name."""
    return execute(saver, plan_entries(saver, entries, **kwargs))


def _read_pt_files(src: Any, won: Dict[str, Tuple[str, str]]) -> Dict[str, Any]:
    files: Dict[str, Any] = {}
    if any(cat == "dense" for cat, _ in won.values()):
        files["model"] = src.read_pt("model.pt")
    if any(cat == "extra" or name == SPARSE_OPTIM for name, (cat, _) in won.items()):
        files["extra"] = src.read_pt("extra.pt")
    return files


def _fit(values: torch.Tensor, table: HashTable, ids: torch.Tensor, column: str) -> torch.Tensor:
    """Applies the entry's dim policy (checked in planning): truncate, or pad with the values new
    rows would get (the table's initialiser for embeddings, the slot's init value for slots)."""
    dim = table.embedding_dim
    if values.shape[1] > dim:
        return values[:, :dim]
    if values.shape[1] < dim:
        if column == "embedding":
            out = table.initial_rows(ids).to(values.dtype)
        else:
            out = torch.full((values.shape[0], dim), table.slot_init(column), dtype=values.dtype)
        out[:, :values.shape[1]] = values
        return out
    return values


def _apply_tables(saver: "Saver", tables: Dict[str, HashTable], src: Any, plan: Plan,
                  won: Dict[str, Tuple[str, str]], rank: int, world: int, load_plan: LoadPlan,
                  report: LoadReport, slots_only: bool) -> None:
    for table_name, (src_table, columns) in sorted(_table_columns(won).items()):
        has_embedding = "embedding" in columns
        if has_embedding == slots_only:
            continue
        table = tables[table_name]
        if world > 1:
            table.set_partition(rank, world, src.num_buckets)
        if has_embedding and _load_in_place(saver, table, src, src_table, columns, plan, rank, world):
            loaded_rows = len(table)
        else:
            ids, data = src.read_table(src_table, list(columns.values()), rank, world, saver.concurrency)
            values = {c: _fit(data[s], table, ids, c) for c, s in columns.items()}
            slot_values = {c: v for c, v in values.items() if c != "embedding"}
            if has_embedding:
                table.load_rows(ids, values["embedding"], slot_values, clear=plan.conf.hashtable_clear)
                loaded_rows = ids.numel()
            else:
                loaded_rows = table.set_slot_rows(ids, slot_values)
        for column in columns:
            name = table_name if column == "embedding" else f"{table_name}@{column}"
            planned = load_plan.items[name]
            report.loaded[name] = LoadedItem(won[name][0], src.ckpt_dir, won[name][1], loaded_rows,
                                             planned.nbytes)


def _load_in_place(saver: "Saver", table: HashTable, src: Any, src_table: str, columns: Dict[str, str],
                   plan: Plan, rank: int, world: int) -> bool:
    """The restore fast path: a cleared CPU table whose shape and dtype match reads the checkpoint
    straight into its storage (no second copy of the table in memory). False: use the general path."""
    info = src.contents.tables.get(src_table)
    if (not plan.conf.hashtable_clear or src.kind != "checkpoint" or info is None
            or info.dim != table.embedding_dim or info.dtype != contents.dtype_name(table.dtype)):
        return False
    ids, _ = src.read_table(src_table, [], rank, world, saver.concurrency)

    def fill(views: Dict[str, torch.Tensor]) -> None:
        if all(v.device.type == "cpu" for v in views.values()):
            src.read_table(src_table, [columns[c] for c in columns], rank, world, saver.concurrency,
                           out={columns[c]: views[c] for c in columns}, with_ids=False)
            return
        with HostToDevice() as h2d:  # column k+1 is read while column k is copied to the device
            for column, view in views.items():
                host = h2d.buffer(view)
                src.read_table(src_table, [columns[column]], rank, world, saver.concurrency,
                               out={columns[column]: host}, with_ids=False)
                h2d.copy(view, host)

    # The columns are read while the id map is rebuilt from the ids.
    return table.prepare_load(ids, list(columns), fill) is not None


def _apply_small(saver: "Saver", dense: Dict[str, torch.Tensor], src: Any, won: Dict[str, Tuple[str, str]],
                 files: Dict[str, Any], rank: int, world: int, load_plan: LoadPlan,
                 report: LoadReport) -> None:
    if "extra" in files:
        saver._extra_data.update(files["extra"])
    io_data = None
    for name, (cat, source) in sorted(won.items()):
        if cat == "dense":
            with torch.no_grad():
                dense[name].copy_(files["model"][source])
        elif cat == "extra" or name == SPARSE_OPTIM:
            saver._extras[name].load_state_dict(files["extra"][source])
        elif cat == "io_state":
            saved = src.io_state_count
            if io_data is None:
                ranks = range(saved) if saved != world else [rank]
                io_data = [src.read_pt(f"io_state_{r}.pt") for r in ranks]
            obj = saver._io_states[name]
            if saved != world:
                obj.load_io_states([d[source] for d in io_data], rank, world)
            else:
                obj.load_io_state(io_data[0][source])
        else:
            continue
        report.loaded[name] = LoadedItem(cat, src.ckpt_dir, source, 0, load_plan.items[name].nbytes)
