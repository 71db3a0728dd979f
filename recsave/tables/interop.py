"""A model's state as plain tensors, for torch.distributed.checkpoint (DCP) and for
``torch.load(weights_only=True)`` (docs/API.md, "PyTorch interop").

Each table (state_dict key ``<path>.table``) becomes ``<path>.table.ids``,
``<path>.table.embedding``, ``<path>.table.slot.<slot>``, its row metadata
``<path>.table.last_step`` / ``<path>.table.count`` and its table step ``<path>.table.step``; every
other state_dict entry is kept under its key.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Tuple

import torch

from recsave.argcheck import check
from recsave.errors import UsageError
from recsave.tables import tablestate
from recsave.tables.hashtable import HashTable
from recsave.tables.modes import outside_inference_mode
from recsave.tables.rows import META_COLUMNS


class IncompatibleKeys(NamedTuple):
    """What from_dcp_state_dict did not find (tables by state_dict key) or did not use."""

    missing_keys: List[str]
    unexpected_keys: List[str]


def to_dcp_state_dict(model: torch.nn.Module, metadata: Any = None, *, replicated: bool = False) -> Dict[str, Any]:
    """The model's state_dict with every table replaced by plain tensors (CPU copies of its ids,
    embedding rows and slots, in row order). Dense entries are the model's own (detached) tensors,
    so DCP loads them in place.

    For ``dcp.load``, pass the checkpoint's metadata (``dcp.FileSystemReader(path).read_metadata()``):
    table entries are then empty tensors of the saved sizes for DCP to fill (a table's row count
    is not known before reading), and from_dcp_state_dict loads them into the tables.

    With a process group of several ranks, DCP takes a plain tensor that every rank passes under
    one key as replicated and keeps one rank's copy: tables sharded across the ranks would lose
    every other rank's rows (and ids and rows could come from different ranks). That is refused
    (UsageError) unless `replicated` says every rank holds the same tables."""
    check(model, torch.nn.Module, "model", "to_dcp_state_dict", expected="a torch.nn.Module")
    check(replicated, bool, "replicated", "to_dcp_state_dict")
    _refuse_sharded(model, replicated)
    out: Dict[str, Any] = {}
    saved = getattr(metadata, "state_dict_metadata", None) if metadata is not None else None
    if metadata is not None and saved is None:
        raise UsageError("to_dcp_state_dict: metadata must be a DCP Metadata (from "
                         "FileSystemReader(path).read_metadata()), with state_dict_metadata")
    for key, value in model.state_dict().items():
        if not isinstance(value, HashTable):
            out[key] = value
        elif saved is None:
            out.update(tablestate.plain_entries(key, value))
        else:
            for name, meta in saved.items():
                if tablestate.is_plain_entry(key, name):
                    out[name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return out


def _refuse_sharded(model: torch.nn.Module, replicated: bool) -> None:
    """UsageError when a process group of several ranks runs, the model has tables, and the caller
    did not say they are replicated (to_dcp_state_dict's docstring says why)."""
    dist = torch.distributed
    if replicated or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return
    tables = sorted(k for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, HashTable))
    if tables:
        raise UsageError(
            f"to_dcp_state_dict: a process group of {dist.get_world_size()} ranks runs, and DCP keeps one "
            f"rank's copy of each plain tensor; the tables {tables[:3]}{' ...' if len(tables) > 3 else ''} "
            f"would keep one rank's rows only if the ranks hold different ids. Save sharded tables with "
            f"recsave.Saver (its checkpoints load on any number of ranks), or pass replicated=True when "
            f"every rank holds the same tables", key="replicated")


@outside_inference_mode
def from_dcp_state_dict(model: torch.nn.Module, state: Dict[str, Any], strict: bool = True) -> IncompatibleKeys:
    """Loads to_dcp_state_dict()'s form back into the model: ids, rows and slots of every table
    (all or nothing per table, like load_state_dict), dense entries with load_state_dict.

    With `strict`, a table or dense entry absent from `state`, or an entry nothing uses, is a
    UsageError naming it and nothing is loaded; otherwise they are returned. A table whose
    `.ids` / `.embedding` pair is incomplete or has the wrong shape is always an error."""
    check(model, torch.nn.Module, "model", "from_dcp_state_dict", expected="a torch.nn.Module")
    check(state, dict, "state", "from_dcp_state_dict")
    check(strict, bool, "strict", "from_dcp_state_dict")
    live = model.state_dict(keep_vars=True)
    staged: List[Tuple[HashTable, HashTable]] = []
    missing: List[str] = []
    used = set()
    for key, table in live.items():
        if not isinstance(table, HashTable):
            continue
        names = [n for n in state if tablestate.is_plain_entry(key, n)]
        if not names:
            missing.append(key)
            continue
        used.update(names)
        staged.append((table, _stage(table, key, state, names)))
    dense = {k: v for k, v in state.items() if k not in used}
    expected = {k for k, v in live.items() if not isinstance(v, HashTable)}
    missing += sorted(expected - set(dense))
    unexpected = sorted(set(dense) - expected)
    if strict and (missing or unexpected):
        raise UsageError(f"from_dcp_state_dict: missing {missing}, unexpected {unexpected}; pass strict=False "
                         f"to load the rest")
    model.load_state_dict({k: v for k, v in dense.items() if k in expected}, strict=False)
    for table, rows in staged:
        table.swap_contents(rows)
    return IncompatibleKeys(missing, unexpected)


def _stage(table: HashTable, key: str, state: Dict[str, Any], names: List[str]) -> HashTable:
    """A new_like() copy of `table` holding the rows of `state`'s entries for `key`."""
    def entry(name: str) -> torch.Tensor:
        value = state.get(name)
        if not isinstance(value, torch.Tensor):
            raise UsageError(f"from_dcp_state_dict: {name} is missing or not a tensor (table {key}); "
                             f"the state must hold {key}.ids and {key}.embedding", key=name)
        return value

    ids, values = entry(f"{key}.ids"), entry(f"{key}.embedding")
    prefix = f"{key}.slot."
    slots: Dict[str, torch.Tensor] = {n[len(prefix):]: entry(n) for n in names if n.startswith(prefix)}
    # As load_state_dict and a Saver's dtype_policy="error": a cast would silently round (float64
    # 1e300 -> inf in float32), so another dtype is the caller's decision, made before this call.
    for name, column in [(f"{key}.embedding", values)] + [(prefix + s, v) for s, v in sorted(slots.items())]:
        if column.dtype != table.dtype:
            raise UsageError(f"from_dcp_state_dict: {name} is {str(column.dtype).replace('torch.', '')}; "
                             f"table {key} is {str(table.dtype).replace('torch.', '')}; convert the state's "
                             f"tensors (.to(dtype)) or construct the table with that dtype", key=name)
    meta = {m: entry(f"{key}.{m}") for m in META_COLUMNS if f"{key}.{m}" in names}
    rows = table.new_like()
    for slot in sorted(slots):
        if slot not in rows.slot_names():
            rows.add_slot(slot)
    # A state without a step (written before recsave kept one) leaves the table's own: its rows then
    # get that step as last_step (age 0), never another job's count.
    rows.step = int(entry(f"{key}.step")) if f"{key}.step" in names else table.step
    rows.load_rows(ids, values, slots, clear=True, meta=meta)
    if len(rows) != ids.numel():  # an id twice: one of its rows would be dropped (the model is untouched yet)
        raise UsageError(f"from_dcp_state_dict: {key}.ids repeats ids ({ids.numel()} ids, {len(rows)} distinct); "
                         f"each id must appear once, with its one row", key=f"{key}.ids")
    return rows

