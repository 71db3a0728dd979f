"""A HashTable's state for PyTorch's own machinery (docs/API.md, "PyTorch interop"): its entry in
``state_dict`` / ``load_state_dict`` and the form it pickles to (torch.save, copy.deepcopy).

Functions here take a table and use its public methods only; HashTable's hooks call them.
"""
from __future__ import annotations

from typing import Any, Collection, Dict, List, Optional, Tuple

import torch

from recsave.errors import RecsaveError, UsageError
from recsave.tables.rows import META_COLUMNS

# A table's state_dict entry is `<module path>.table` (just `table` for a table that is the root
# module): torch hands load_state_dict entries to a module only under its own prefix.
STATE_KEY = "table"


def state_key(prefix: str) -> str:
    """The state_dict key of a table whose module prefix is `prefix` ('emb.user.' -> 'emb.user.table')."""
    return prefix + STATE_KEY


def module_path(key: str) -> str:
    """The module path of a table's state_dict key ('emb.user.table' -> 'emb.user'); a key of
    another form (a hand-built dict) is its own path."""
    if key == STATE_KEY:
        return ""
    suffix = "." + STATE_KEY
    return key[: -len(suffix)] if key.endswith(suffix) else key


def pack(table: Any) -> Dict[str, Any]:
    """The rows of a pickled table: ids (row order), embedding rows, every slot, slot init values,
    row metadata and the table step; CPU tensors, no free rows."""
    ids, rows = table.id_rows()
    values, slots = table.gather_rows(rows)
    return {"ids": ids, "embedding": values, "slots": slots, "meta": table.row_meta(rows), "step": table.step,
            "slot_init": {s: table.slot_init(s) for s in table.slot_names()}}


def unpack(table: Any, packed: Dict[str, Any]) -> None:
    """Fills an empty, unpartitioned table from pack()'s output."""
    for slot, init in packed["slot_init"].items():
        table.add_slot(slot, init)
    # (older pickles have no metadata / step)
    table.load_rows(packed["ids"], packed["embedding"], packed["slots"], clear=True, meta=packed.get("meta"))
    table.step = packed.get("step", 0)


def mismatch(table: Any, other: Any) -> Optional[str]:
    """Why `other`'s rows cannot be loaded into `table` (dim or dtype), or None."""
    def kind(t: Any) -> Tuple[int, str]:
        return t.embedding_dim, str(t.dtype).replace("torch.", "")
    if kind(other) == kind(table):
        return None
    return ("the state holds a table of dim {}, {}; this table is dim {}, {}"
            .format(*kind(other), *kind(table)))


def copy_from(table: Any, other: Any) -> None:
    """Replaces `table`'s ids, rows and slots with copies of `other`'s, all or nothing: staged in a
    new_like() table, then swapped in. Slots only `other` has are added with its init values;
    slots only `table` has take their init values; `table`'s partition applies to the ids."""
    staged = table.new_like()
    for slot in other.slot_names():
        if slot not in staged.slot_names():
            staged.add_slot(slot, other.slot_init(slot))
    copy_rows(other, staged)
    table.swap_contents(staged)


def copy_rows(src: Any, dst: Any) -> None:
    """Gives the empty table `dst` (which has every slot of `src`) copies of `src`'s ids, rows,
    slots and row metadata, and its table step."""
    if len(src):
        ids, rows = src.id_rows()
        values, slots = src.gather_rows(rows)
        dst.load_rows(ids, values, slots, clear=True, meta=src.row_meta(rows))
    dst.step = src.step


def load_entry(table: Any, table_type: type, state_dict: Dict[str, Any], prefix: str, missing_keys: List[str],
               unexpected_keys: List[str], error_msgs: List[str], owned: Collection[str] = ()) -> None:
    """HashTable._load_from_state_dict: loads the entry `<prefix>table` (a `table_type`) into
    `table`, reporting a missing entry, other keys under `prefix` and mismatches torch's way
    (strict or not). Keys whose first name under `prefix` is in `owned` (a subclass's own
    submodules, parameters and buffers, which torch loads) are not the table's to report."""
    key = state_key(prefix)
    extra_state = prefix + "_extra_state"
    unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in (key, extra_state)
                           and k[len(prefix):].split(".", 1)[0] not in owned and k not in unexpected_keys)
    if key not in state_dict:
        missing_keys.append(key)
        return
    other = state_dict[key]
    if not isinstance(other, table_type):
        error_msgs.append(f"{key}: expected a HashTable, got {type(other).__name__}")
        return
    if other is table:
        return
    problem = mismatch(table, other)
    if problem is None:
        try:
            copy_from(table, other)
        except RecsaveError as exc:
            problem = str(exc)
    if problem is not None:
        error_msgs.append(f"{key}: {problem}")


def split(state_dict: Dict[str, Any], table_type: type) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """split_sparse_dense_state_dict for tables of `table_type`."""
    sparse: Dict[str, Any] = {}
    keys: Dict[str, str] = {}
    dense: Dict[str, Any] = {}
    for key, value in state_dict.items():
        if not isinstance(value, table_type):
            dense[key] = value
            continue
        name = getattr(value, "table_name", None) or module_path(key)
        if name in sparse and sparse[name] is not value:
            raise UsageError(f"two tables are both named {name!r} (state_dict keys {keys[name]!r} and {key!r}); "
                             f"give each HashTable its own name", key=name)
        sparse[name], keys[name] = value, key
    return sparse, dense


def plain_entries(key: str, table: Any) -> Dict[str, torch.Tensor]:
    """A HashTable as plain tensors: `<key>.ids`, `<key>.embedding`, `<key>.slot.<slot>`, its row
    metadata `<key>.last_step` / `<key>.count` ([N] int64) and its table step `<key>.step` (0-d)."""
    ids, rows = table.id_rows()
    values, slots = table.gather_rows(rows)
    out = {f"{key}.ids": ids, f"{key}.embedding": values}
    out.update({f"{key}.slot.{s}": slots[s] for s in sorted(slots)})
    out.update({f"{key}.{m}": v.reshape(-1) for m, v in sorted(table.row_meta(rows).items())})
    out[f"{key}.step"] = torch.tensor(int(table.step), dtype=torch.int64)
    return out


def is_plain_entry(key: str, name: str) -> bool:
    """Whether `name` is one of plain_entries(key, ...)'s names."""
    return name in (f"{key}.ids", f"{key}.embedding", f"{key}.step", *(f"{key}.{m}" for m in META_COLUMNS)) \
        or name.startswith(f"{key}.slot.")
