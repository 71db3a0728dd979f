"""What a live model (with its Saver's registrations) holds, and what a checkpoint's index says it
holds, in the same vocabulary (loadconf.Contents), so configs resolve against both."""
from __future__ import annotations

from typing import AbstractSet, Any, Dict, Mapping, Tuple

import torch

from recsave.errors import UsageError
from recsave.format import checks
from recsave.tables.hashtable import HashTable, split_sparse_dense_state_dict
from recsave.load.config import Contents, TableInfo


def model_state(model: torch.nn.Module) -> Tuple[Dict[str, HashTable], Dict[str, torch.Tensor]]:
    """(tables, dense tensors) of the model's state_dict."""
    sparse, dense = split_sparse_dense_state_dict(model.state_dict(keep_vars=True))
    bad = [k for k, v in dense.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise UsageError(f"model state entries {bad[:5]} are neither tensors nor HashTables; register "
                         f"such state with Saver.register_for_checkpointing instead")
    return sparse, dense


def of_model(tables: Mapping[str, HashTable], dense: Mapping[str, torch.Tensor],
             extras: Mapping[str, Any], io_states: Mapping[str, Any],
             optional: AbstractSet[str] = frozenset()) -> Contents:
    return Contents(
        tables={n: TableInfo(t.embedding_dim, dtype_name(t.dtype), tuple(t.slot_names()), len(t))
                for n, t in tables.items()},
        dense={n: (tuple(v.shape), dtype_name(v.dtype)) for n, v in dense.items()},
        extras=set(extras), io_states=set(io_states), optional=set(optional))


def index_meta(tables: Mapping[str, Any], dense: Mapping[str, torch.Tensor],
               extras: Mapping[str, Any], io_states: Mapping[str, Any], world_size: int,
               rows: Mapping[str, int]) -> Dict[str, Any]:
    """The `meta` object of the index: what the checkpoint holds, readable without its data."""
    return {
        "tables": {n: {"dim": t.embedding_dim, "dtype": dtype_name(t.dtype), "slots": t.slot_names(),
                       "rows": int(rows.get(n, 0))} for n, t in tables.items()},
        "dense": {n: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for n, v in dense.items()},
        "extras": sorted(extras),
        "io_states": sorted(io_states),
        "io_state_count": world_size,
    }


def of_index(index: Dict[str, Any], path: str) -> Contents:
    """Contents from an index's meta; CorruptCheckpointError when it is malformed."""
    meta = index.get("meta")
    try:
        tables = {str(n): TableInfo(int(t["dim"]), str(t["dtype"]), tuple(str(s) for s in t["slots"]),
                                    int(t.get("rows", 0)))
                  for n, t in meta["tables"].items()}
        dense = {str(n): (tuple(int(d) for d in v["shape"]), str(v["dtype"])) for n, v in meta["dense"].items()}
        extras = {str(e) for e in meta["extras"]}
        io_states = {str(e) for e in meta["io_states"]}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise checks.corrupt(path, f"index meta does not describe tables / dense / extras ({exc!r})") from None
    for name, info in tables.items():
        for suffix in ["id", "embedding"] + list(info.slots):
            if f"{name}@{suffix}" not in index["tensors"]:
                raise checks.corrupt(path, f"table {name!r} lacks its tensor {name}@{suffix}")
    return Contents(tables=tables, dense=dense, extras=extras, io_states=io_states)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32", the name used in indexes and configs."""
    return str(dtype).replace("torch.", "")
