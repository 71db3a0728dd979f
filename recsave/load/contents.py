"""What a live model (with its Saver's registrations) holds, and what a checkpoint's index says it
holds, in the same vocabulary (loadconf.Contents), so configs resolve against both."""
from __future__ import annotations

from typing import AbstractSet, Any, Dict, List, Mapping, Sequence, Tuple

import torch

from recsave.errors import UsageError
from recsave.format import checks
from recsave.format.records import DenseMeta, Index, Meta, TableMeta
from recsave.load.config import Contents, TableInfo
from recsave.tables.rows import RESERVED_COLUMNS
from recsave.tables.tablelike import TableLike, split_model


def model_state(model: torch.nn.Module) -> Tuple[Dict[str, TableLike], Dict[str, torch.Tensor]]:
    """(tables, dense tensors) of the model: its HashTables and other TableLike modules
    (tables/tablelike.py), and the rest of its state_dict."""
    sparse, dense = split_model(model)
    bad = [k for k, v in dense.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise UsageError(f"model state entries {bad[:5]} are neither tensors nor HashTables; register "
                         f"such state with Saver.register_for_checkpointing instead")
    return sparse, dense


def check_names(tables: Mapping[str, TableLike], dense: Mapping[str, Any], extras: AbstractSet[str],
                io_states: AbstractSet[str], where: str) -> None:
    """UsageError unless every name a save writes and a load resolves stands for one thing: a table,
    a slot `<table>@<slot>`, a dense state_dict key, an extra or an io state (Contents.categories
    keys them all by name, and the index lists `<table>@<column>` tensors). Refused: a name in two
    categories, a table name with '@' (e.g. the module path of an unnamed table), a slot named like
    a checkpoint column (tables/rows.py RESERVED_COLUMNS), and any other name `<table>@...` of an
    existing table. Without this, one of two such things would be skipped silently on load."""
    problems: List[str] = []
    owner: Dict[str, str] = {}
    named = [(n, "table") for n in tables] + [(n, "dense state_dict key") for n in dense]
    named += [(n, "registered extra") for n in sorted(extras)] + [(n, "io state") for n in sorted(io_states)]
    for name, what in named:
        if name in owner:
            problems.append(f"{name!r} is both a {owner[name]} and {'an' if what[0] in 'aeiou' else 'a'} {what}")
        owner.setdefault(name, what)
    for name, table in tables.items():
        if "@" in name:
            problems.append(f"table name {name!r} contains '@' (a checkpoint names its columns <table>@<column>); "
                            f"give the table a name (HashTable(name=...)) without '@'")
        bad = [s for s in table.slot_names() if s in RESERVED_COLUMNS or "@" in s or not s]
        if bad:
            problems.append(f"table {name!r} has slot(s) {bad} named like a checkpoint column; reserved: "
                            f"{list(RESERVED_COLUMNS)}, and no '@'")
    for name, what in named:
        if what != "table" and "@" in name and name.split("@", 1)[0] in tables:
            problems.append(f"{what} {name!r} is named like a column of table {name.split('@', 1)[0]!r}")
    if problems:
        raise UsageError(f"{where}: names that would overwrite or shadow each other in a checkpoint: "
                         + "; ".join(problems[:5]) + ("" if len(problems) <= 5 else f" (+{len(problems) - 5} more)")
                         + ". Rename one of each pair.")


def of_model(tables: Mapping[str, TableLike], dense: Mapping[str, torch.Tensor],
             extras: Mapping[str, Any], io_states: Mapping[str, Any],
             optional: AbstractSet[str] = frozenset()) -> Contents:
    return Contents(
        tables={n: TableInfo(t.embedding_dim, dtype_name(t.dtype), tuple(t.slot_names()), len(t))
                for n, t in tables.items()},
        dense={n: (tuple(v.shape), dtype_name(v.dtype)) for n, v in dense.items()},
        extras=set(extras), io_states=set(io_states), optional=set(optional))


def index_meta(tables: Mapping[str, Any], dense: Mapping[str, torch.Tensor],
               extras: Mapping[str, Any], io_states: Mapping[str, Any], world_size: int,
               rows: Mapping[str, int]) -> Meta:
    """The `meta` of the index: what the checkpoint holds, readable without its data."""
    return Meta(
        tables={n: TableMeta(t.embedding_dim, dtype_name(t.dtype), tuple(t.slot_names()), int(rows.get(n, 0)))
                for n, t in tables.items()},
        dense={n: DenseMeta(tuple(v.shape), dtype_name(v.dtype)) for n, v in dense.items()},
        extras=tuple(sorted(extras)),
        io_states=tuple(sorted(io_states)),
        io_state_count=world_size,
    )


def of_index(index: Index, path: str) -> Contents:
    """Contents from an index's (already validated) meta; CorruptCheckpointError when the index has
    none, i.e. was not written by a Saver."""
    meta = index.meta
    if meta is None:
        raise checks.corrupt(path, "index meta does not describe tables / dense / extras (it is empty)")
    return Contents(
        tables={n: TableInfo(t.dim, t.dtype, t.slots, t.rows, _slot_dtypes(index, n, t.slots))
                for n, t in meta.tables.items()},
        dense={n: (d.shape, d.dtype) for n, d in meta.dense.items()},
        extras=set(meta.extras), io_states=set(meta.io_states))


def _slot_dtypes(index: Index, table: str, slots: Sequence[str]) -> Dict[str, str]:
    """The slots' dtypes as the index records their tensors."""
    entries = (index.tensors.get(f"{table}@{s}") for s in slots)
    return {s: e.dtype for s, e in zip(slots, entries) if e is not None}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32", the name used in indexes and configs."""
    return str(dtype).replace("torch.", "")
