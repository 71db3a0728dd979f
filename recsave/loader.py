"""Executes loads: resolve each config entry to a checkpoint, plan it against the model (all checks
before any change), then read and apply what each entry wins — tables first, then slot-only
merges, dense parameters, extras and io states."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import ckptlist, contents, dist, loadconf, partition, torchio
from .errors import CheckpointNotFoundError, ConfigError
from .format import index as index_mod
from .format.reader import read_tensors
from .loadconf import SPARSE_OPTIM, Plan
from .report import LoadedItem, LoadReport
from .storage import Storage, get_storage

if TYPE_CHECKING:
    from .saver import Saver


@dataclass
class Source:
    """A resolved checkpoint: where it is and what its index says."""
    storage: Storage
    ckpt_dir: str
    index: Dict[str, Any]
    contents: loadconf.Contents


def resolve_checkpoint(path: str, ckpt_id: Optional[str] = None, direct_path: bool = False) -> Source:
    """`path` is a checkpoint directory (it has an index) or an output dir (its `checkpoint` file's
    latest entry, or `ckpt_id`)."""
    storage = get_storage(path)
    if ckpt_id is not None:
        ckpt_dir = storage.join(path, ckptlist.validate_id(ckpt_id))
    elif direct_path or storage.exists(storage.join(path, index_mod.INDEX_FILE)):
        ckpt_dir = path
    else:
        ids = ckptlist.read(storage, path)
        if not ids:
            raise CheckpointNotFoundError(
                f"{path}: no committed checkpoint (no 'checkpoint' file listing one, and no index); "
                f"check the path, or save a checkpoint first", path=path)
        ckpt_dir = storage.join(path, ids[-1])
    index = index_mod.read(ckpt_dir, storage)
    return Source(storage, ckpt_dir, index, contents.of_index(index, ckpt_dir))


def load_entries(saver: "Saver", entries: Sequence[Dict[str, Any]], *, shard_id: Optional[int] = None,
                 ckpt_id: Optional[str] = None, direct_path: bool = False,
                 require_path: bool = False) -> LoadReport:
    """Loads config entries in order into the saver's model; the last entry wins a name."""
    rank, world = dist.resolve(shard_id, None)
    tables, dense = contents.model_state(saver.model)
    model = contents.of_model(tables, dense, saver._extras, saver._io_states)
    plans: List[Plan] = []
    sources: List[Source] = []
    for i, entry in enumerate(entries):
        where = f"model bank entry {i}" if require_path else "load_conf"
        conf = loadconf.parse(entry, where=where, require_path=True)
        if conf.skip:
            continue
        src = resolve_checkpoint(conf.path, ckpt_id, direct_path)  # type: ignore[arg-type]
        plans.append(loadconf.plan(conf, model, src.contents, src.ckpt_dir, src.index))
        sources.append(src)
    _check_io_states(plans, sources, world, saver)
    report = LoadReport()
    for p in plans:
        report.checkpoints.append(p.ckpt_dir)
        report.step = p.index.get("step")
        report.skipped += [n for n in p.skipped if n not in report.skipped]
        report.missing += [n for n in p.missing if n not in report.missing]
        report.unexpected += [n for n in p.unexpected if n not in report.unexpected]
    won = loadconf.winners(plans)
    # Small files first: they are verified before any table changes.
    pt_files = [_read_pt_files(s, w) for s, w in zip(sources, won)]
    for src, p, w in zip(sources, plans, won):
        _apply_tables(saver, tables, src, p, w, rank, world, report, slots_only=False)
    for src, p, w in zip(sources, plans, won):
        _apply_tables(saver, tables, src, p, w, rank, world, report, slots_only=True)
    for src, w, files in zip(sources, won, pt_files):
        _apply_small(saver, dense, src, w, files, rank, world, report)
    return report


def _check_io_states(plans: Sequence[Plan], sources: Sequence[Source], world: int, saver: "Saver") -> None:
    """Io states saved by N workers load on M != N only into objects that can reshard them."""
    for p, src in zip(plans, sources):
        names = [n for n, (cat, _) in p.items.items() if cat == "io_state"]
        saved = src.index["meta"].get("io_state_count", src.index["world_size"])
        rigid = [n for n in names if not callable(getattr(saver._io_states[n], "load_io_states", None))]
        if saved != world and rigid:
            raise ConfigError(
                f"{src.ckpt_dir}: io state(s) {rigid} were saved by {saved} worker(s) but {world} are "
                f"loading; exclude 'io_state', restart with {saved} workers, or give the object a "
                f"load_io_states(states, rank, world_size) method that reshards", path=src.ckpt_dir)


def _read_pt_files(src: Source, won: Dict[str, Tuple[str, str]]) -> Dict[str, Any]:
    files: Dict[str, Any] = {}
    if any(cat == "dense" for cat, _ in won.values()):
        files["model"] = torchio.load(src.storage, src.ckpt_dir, "model.pt", src.index)
    if any(cat == "extra" or name == SPARSE_OPTIM for name, (cat, _) in won.items()):
        files["extra"] = torchio.load(src.storage, src.ckpt_dir, "extra.pt", src.index)
    return files


def _row_ranges(index: Dict[str, Any], tensor: str, rank: int, world: int) -> Optional[List[Tuple[int, int]]]:
    """Logical rows of `tensor` whose buckets rank `rank` of `world` owns (None: all rows)."""
    if world == 1:
        return None
    num_buckets = index["partition"]["num_buckets"]
    lo, hi = partition.bucket_range(rank, world, num_buckets)
    ranges = []
    for chunk in index["tensors"][tensor]["chunks"]:
        b = chunk.get("buckets")
        if b is None:
            raise ConfigError(f"{tensor}: chunk without bucket offsets cannot be resharded", key=tensor)
        first, starts = b["first"], b["row_starts"]
        a, z = max(lo, first), min(hi, first + len(starts) - 1)
        if a < z and starts[a - first] < starts[z - first]:
            ranges.append((chunk["rows"][0] + starts[a - first], chunk["rows"][0] + starts[z - first]))
    return ranges


def _apply_tables(saver: "Saver", tables, src: Source, plan: Plan, won: Dict[str, Tuple[str, str]],
                  rank: int, world: int, report: LoadReport, *, slots_only: bool) -> None:
    by_table: Dict[str, Dict[str, str]] = {}  # model table -> {model column: checkpoint tensor}
    for name, (cat, source) in won.items():
        if cat not in ("sparse", "sparse_opt") or name == SPARSE_OPTIM:
            continue
        table, _, slot = name.partition("@")
        src_table, _, src_slot = source.partition("@")
        by_table.setdefault(table, {})[slot or "embedding"] = f"{src_table}@{src_slot or 'embedding'}"
    for table_name, columns in sorted(by_table.items()):
        has_embedding = "embedding" in columns
        if has_embedding == slots_only:
            continue
        src_table = columns.get("embedding", next(iter(columns.values()))).partition("@")[0]
        id_tensor = f"{src_table}@id"
        ranges = _row_ranges(src.index, id_tensor, rank, world)
        wanted = [id_tensor] + list(columns.values())
        stats: Dict[str, int] = {}
        data = read_tensors(src.ckpt_dir, wanted, index=src.index, storage=src.storage,
                            concurrency=saver.concurrency, stats=stats,
                            rows=None if ranges is None else {t: ranges for t in wanted})
        ids = data[id_tensor]
        table = tables[table_name]
        if world > 1:
            table.set_partition(rank, world, src.index["partition"]["num_buckets"])
        slot_values = {c: data[t] for c, t in columns.items() if c != "embedding"}
        if has_embedding:
            table.load_rows(ids, data[columns["embedding"]], slot_values, clear=plan.conf.hashtable_clear)
            loaded_rows = ids.numel()
        else:
            loaded_rows = table.set_slot_rows(ids, slot_values)
        share = stats.get("bytes_read", 0) // max(len(columns), 1)
        for column, tensor in columns.items():
            model_name = table_name if column == "embedding" else f"{table_name}@{column}"
            report.loaded[model_name] = LoadedItem(won[model_name][0], src.ckpt_dir,
                                                   won[model_name][1], loaded_rows, share)
        report.rows_read += ids.numel()
        report.bytes_read += stats.get("bytes_read", 0)


def _apply_small(saver: "Saver", dense: Dict[str, torch.Tensor], src: Source,
                 won: Dict[str, Tuple[str, str]], files: Dict[str, Any], rank: int, world: int,
                 report: LoadReport) -> None:
    if "extra" in files:
        saver._extra_data.update(files["extra"])
    io_data = None
    for name, (cat, source) in sorted(won.items()):
        if cat == "dense":
            value = files["model"][source]
            with torch.no_grad():
                dense[name].copy_(value)
            item = LoadedItem(cat, src.ckpt_dir, source, 0, value.nbytes)
        elif cat == "extra" or name == SPARSE_OPTIM:
            saver._extras[name].load_state_dict(files["extra"][source])
            item = LoadedItem(cat, src.ckpt_dir, source)
        elif cat == "io_state":
            saved = src.index["meta"].get("io_state_count", src.index["world_size"])
            if io_data is None:
                ranks = range(saved) if saved != world else [rank]
                io_data = [torchio.load(src.storage, src.ckpt_dir, f"io_state_{r}.pt", src.index) for r in ranks]
            obj = saver._io_states[name]
            if saved != world:
                obj.load_io_states([d[source] for d in io_data], rank, world)
            else:
                obj.load_io_state(io_data[0][source])
            item = LoadedItem(cat, src.ckpt_dir, source)
        else:
            continue
        report.loaded[name] = item
        report.bytes_read += item.nbytes
