"""Plan a load: resolve every config entry to a source (checkpoint or Parquet), match names
(load/config.py), check shapes and compute rows and bytes, all before anything is modified. The
result is a LoadPlan that load/execute.py carries out (docs/ARCHITECTURE.md, "A load")."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Sequence, Tuple, cast

import torch

from recsave.errors import ConfigError
from recsave.load import config, contents
from recsave.load.config import SPARSE_OPTIM, Plan
from recsave.load.report import table_rows_read
from recsave.load.shared_reads import fail_before_sharing, open_sources
from recsave.load.sources import open_source
from recsave.storage import dist

Won = Dict[str, Tuple[str, str]]  # model name -> (category, name in the source), per entry


@dataclass(frozen=True)
class LoadTarget:
    """What a load writes into: the model and the objects registered with its Saver.

    `extra_data` receives the state of each extra a load applies, and the unregistered extras of
    the extra.pt files it reads (what Saver.get_extra_data returns). Names in `optional`
    (registered with optional=True) may be absent from a checkpoint: they are skipped with a note,
    never counted as missing."""
    model: torch.nn.Module
    extras: Mapping[str, Any]       # name -> object with state_dict / load_state_dict
    io_states: Mapping[str, Any]    # name -> object with dump_io_state / load_io_state(s)
    concurrency: int = 4
    extra_data: Dict[str, Any] = field(default_factory=dict)
    optional: AbstractSet[str] = frozenset()


@dataclass
class PlannedItem:
    category: str
    checkpoint: str          # source checkpoint (or Parquet export)
    source: str              # name in the source
    entry: int               # index of the bank entry that provides it (the last one wins)
    rows: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class ResolvedEntries:
    """The entries of a plan as execute() needs them: opened sources, per-entry name plans and
    the names each entry wins, for the ranks the plan was made for."""
    rank: int
    world: int
    plans: List[Plan]
    sources: List[Any]
    won: List[Won]
    entry_of: List[int]   # plan position -> index of its entry in the caller's list


@dataclass
class LoadPlan:
    """A dry run of a load / model bank: what each model name will get, from where, at what cost.
    Nothing is read but indexes and metadata; executing the plan does exactly this."""

    items: Dict[str, PlannedItem] = field(default_factory=dict)
    left_initialised: List[str] = field(default_factory=list)   # model names no entry provides
    skipped: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    checkpoints: List[str] = field(default_factory=list)        # per entry (skipped entries: "")
    notes: List[str] = field(default_factory=list)              # e.g. optional names a checkpoint lacks
    rows: int = 0
    nbytes: int = 0
    resolved: Optional[ResolvedEntries] = field(default=None, repr=False, compare=False)

    def source_versions(self) -> Dict[int, str]:
        """Version of each entry's source (by entry index); a source that committed a newer
        checkpoint since has another version."""
        if self.resolved is None:
            return {}
        return {i: src.version for i, src in zip(self.resolved.entry_of, self.resolved.sources)}

    def __str__(self) -> str:
        lines = [f"{'name':32} {'category':10} {'entry':>5} {'rows':>10} {'MB':>9}  source"]
        for name, it in sorted(self.items.items()):
            lines.append(f"{name:32} {it.category:10} {it.entry:>5} {it.rows:>10} {it.nbytes / 1e6:>9.2f}  "
                         f"{it.checkpoint}:{it.source}")
        lines.append(f"total: {len(self.items)} names, {self.rows} rows, {self.nbytes / 1e6:.2f} MB to read")
        if self.left_initialised:
            lines.append(f"left initialised: {', '.join(self.left_initialised)}")
        return "\n".join(lines)


def plan_entries(target: LoadTarget, entries: Sequence[Dict[str, Any]], *, shard_id: Optional[int] = None,
                 ckpt_id: Optional[str] = None, direct_path: bool = False,
                 require_path: bool = False, share_reads: bool = False, alone: bool = False) -> LoadPlan:
    """Resolves config entries against the target's model into a LoadPlan (a dry run).

    `share_reads`: every rank of the process group plans this load together (a load that is
    executed), so rank 0 reads each index once and broadcasts it (load/shared_reads.py), and the
    planning ends with one exchange of every rank's outcome: a rank failing alone here (its own
    copy of an index damaged) makes every rank raise, with every rank's failure known to each
    (a fallback load then decides alike), instead of one going on into the next collective. A dry
    run alone leaves it off: it may be called on one rank only.

    `alone`: this process loads as rank 0 of 1 whatever its group (Saver.load's shard_num=1):
    whole tables, no collective, the others take no part."""
    if not share_reads or alone:
        return _plan_entries(target, entries, shard_id, ckpt_id, direct_path, require_path, False, alone)
    rank, world = dist.resolve_for_exchange(shard_id)
    plan = dist.run_everywhere("planning the load", lambda: _plan_entries(
        target, entries, shard_id, ckpt_id, direct_path, require_path, True, False), world, rank=rank)
    assert plan is not None
    return plan


def _plan_entries(target: LoadTarget, entries: Sequence[Dict[str, Any]], shard_id: Optional[int],
                  ckpt_id: Optional[str], direct_path: bool, require_path: bool, share_reads: bool,
                  alone: bool) -> LoadPlan:
    try:
        if alone:
            rank, world = 0, 1
        else:
            dist.require_own_rank(shard_id, "load")
            rank, world = dist.resolve(shard_id, None)
        # The model's own checks too: a rank whose model is refused must still meet the others.
        tables, dense = contents.model_state(target.model)
        contents.check_names(tables, dense, set(target.extras), set(target.io_states), "load")
        model = contents.of_model(tables, dense, target.extras, target.io_states, target.optional)
        confs = [config.parse(entry, where=f"model bank entry {i}" if require_path else "load_conf",
                              require_path=True) for i, entry in enumerate(entries)]
    except BaseException as exc:
        if not share_reads:
            raise
        fail_before_sharing(exc, dist.group()[1])  # the others go on to open_sources' broadcast: meet them there
    entry_of = [i for i, conf in enumerate(confs) if not conf.skip]
    openings = [(cast(str, confs[i].path), ckpt_id, direct_path) for i in entry_of]
    sources = open_sources(openings, world) if share_reads else [open_source(*o) for o in openings]
    plans: List[Plan] = [config.plan(confs[i], model, src.contents, src.ckpt_dir, src.index)
                         for i, src in zip(entry_of, sources)]
    result = LoadPlan()
    opened = dict(zip(entry_of, sources))
    result.checkpoints = [opened[i].ckpt_dir if i in opened else "" for i in range(len(confs))]
    won = config.winners(plans)
    config.raise_incompatible(plans, won)
    if rank == 0:  # every rank plans alike: said once
        _warn_merges_over_earlier_entries(plans, won, entry_of)
    _check_io_states(won, sources, world, target)
    notes: List[Tuple[str, str]] = []  # (model name, note)
    for k, (src, p, w) in enumerate(zip(sources, plans, won)):
        for name in p.skipped:
            if name not in result.skipped:
                result.skipped.append(name)
        result.missing += [n for n in p.missing if n not in result.missing]
        result.unexpected += [n for n in p.unexpected if n not in result.unexpected]
        notes += [(name, n) for name, n in zip(p.note_names, p.notes) if (name, n) not in notes]
        _plan_items(result, src, w, entry_of[k], rank, world)
    result.left_initialised = sorted(set(model.categories()) - set(result.items))
    # What one entry lacks (or skips) another may load: only names no entry loads stay missing,
    # skipped or noted as kept.
    result.skipped = sorted(n for n in result.skipped if n not in result.items)
    result.missing = [n for n in result.missing if n not in result.items]
    result.notes = [n for name, n in notes if name not in result.items]
    result.rows = table_rows_read(result.items)
    result.nbytes = sum(it.nbytes for it in result.items.values())
    result.resolved = ResolvedEntries(rank, world, plans, sources, won, entry_of)
    return result


def _warn_merges_over_earlier_entries(plans: Sequence[Plan], won: Sequence[Won], entry_of: Sequence[int]) -> None:
    """A table won by a merging entry (hashtable_clear=False) that an earlier entry also loads: the
    later entry wins the name, so the earlier one's rows are never read, and the merge goes into
    the model's live rows. Written as [load A, merge B] that reads as "A, then B on top"."""
    for j, (p, w) in enumerate(zip(plans, won)):
        if p.conf.hashtable_clear:
            continue
        for name, (category, _) in sorted(w.items()):
            earlier = [entry_of[i] for i in range(j) if category == "sparse" and name in plans[i].items]
            if earlier:
                warnings.warn(f"model bank entry {entry_of[j]} merges table {name!r} into the model's live rows "
                              f"(hashtable_clear=False) and, as the later entry, wins it: entry(ies) {earlier} "
                              f"do not load it. To merge into what an earlier entry loads, load that entry "
                              f"first (its own load_model_bank call), then merge", RuntimeWarning, stacklevel=2)


def table_columns(won: Won) -> Dict[str, Tuple[str, Dict[str, str]]]:
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


def _plan_items(result: LoadPlan, src: Any, won: Won, entry: int, rank: int, world: int) -> None:
    for table, (src_table, columns) in table_columns(won).items():
        # Row metadata is read with the embedding (execute._stage_tables), where the source has it.
        meta = [m for m in src.meta_columns(src_table) if m not in columns.values()] if "embedding" in columns else []
        rows, cost = src.table_cost(src_table, list(columns.values()) + meta, rank, world)
        for i, (column, src_column) in enumerate(columns.items()):
            name = table if column == "embedding" else f"{table}@{column}"
            # The ids (and row metadata) are read once per table and booked on its first column.
            nbytes = cost[src_column] + (cost["id"] + sum(cost[m] for m in meta) if i == 0 else 0)
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
    return int(n)


def _check_io_states(won: Sequence[Won], sources: Sequence[Any], world: int, target: LoadTarget) -> None:
    """Io states saved by N workers load on M != N only into objects that can reshard them (of
    each source, the io states it wins: a later entry may load one instead)."""
    for w, src in zip(won, sources):
        names = [n for n, (cat, _) in w.items() if cat == "io_state"]
        rigid = [n for n in names if not callable(getattr(target.io_states[n], "load_io_states", None))]
        if src.io_state_count != world and rigid:
            raise ConfigError(
                f"{src.ckpt_dir}: io state(s) {rigid} were saved by {src.io_state_count} worker(s) but "
                f"{world} are loading; exclude 'io_state', restart with {src.io_state_count} workers, "
                f"or give the object a load_io_states(states, rank, world_size) method that reshards",
                path=src.ckpt_dir)
