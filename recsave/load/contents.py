"""What a live model (with its Saver's registrations) holds, and what a checkpoint's index says it
holds, in the same vocabulary (loadconf.Contents), so configs resolve against both."""
from __future__ import annotations

from typing import AbstractSet, Any, Dict, Mapping, Tuple

import torch

from recsave.errors import UsageError
from recsave.format import checks
from recsave.format.records import DenseMeta, Index, Meta, TableMeta
from recsave.load.config import Contents, TableInfo
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
        tables={n: TableInfo(t.dim, t.dtype, t.slots, t.rows) for n, t in meta.tables.items()},
        dense={n: (d.shape, d.dtype) for n, d in meta.dense.items()},
        extras=set(meta.extras), io_states=set(meta.io_states))


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32", the name used in indexes and configs."""
    return str(dtype).replace("torch.", "")
