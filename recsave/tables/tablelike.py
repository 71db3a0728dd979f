"""TableLike: what the save and load paths use of a table (docs/API.md, "TableLike"). HashTable
is one; a module of another kind that provides these members is saved, resharded and loaded from
model banks like a HashTable.

A model's tables are its HashTables (they put themselves in ``state_dict``) and every other
submodule that sets ``__recsave_table__ = True`` or satisfies the protocol; such a module's own
``state_dict`` entries are then not saved as dense state.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Protocol, Tuple, runtime_checkable

import torch

from recsave.errors import UsageError
from recsave.tables import tablestate
from recsave.tables.hashtable import HashTable


@runtime_checkable
class TableLike(Protocol):
    """The members recsave's save and load paths use on a table.

    Saving reads `embedding_dim`, `dtype`, `slot_names()`, `id_rows()` (ids and the row of each,
    CPU int64, row order) and `columns()` (``"embedding"`` and every slot: tensors indexed by
    those rows); a save with several ranks first calls `set_partition`. Loading stages rows in
    ``new_like()`` (same configuration and slots, no rows; with `copy_rows`, a copy of them),
    fills it with `load_rows` / `set_slot_rows` (creating slots with `add_slot`), and commits with
    `swap_contents` (which a rollback calls again). `initial_rows` and `slot_init` give the values
    of padded columns (``dim_policy="pad"``). ``len(table)`` is its number of ids.

    `columns()` returns the storage tensors themselves, the same objects until a load or
    `swap_contents` replaces them: a rollback tells by identity whether the staged contents were
    swapped in. A save holds no lock: the table must not change during a synchronous save (as for
    a HashTable); `async_save` copies the columns and what `id_rows()` returns at the call, so
    training may go on at once. `prepare_load` (HashTable's in-place restore) is optional: without it a load
    stages the rows with `load_rows`."""

    embedding_dim: int
    table_name: Optional[str]

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def partition(self) -> Optional[Tuple[int, int, int]]: ...

    def __len__(self) -> int: ...

    def slot_names(self) -> List[str]: ...

    def add_slot(self, slot: str, init: float = 0.0) -> None: ...

    def slot_init(self, slot: str) -> float: ...

    def id_rows(self) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def columns(self) -> Dict[str, torch.Tensor]: ...

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor: ...

    def set_partition(self, rank: int, world_size: int, num_buckets: int = ...) -> None: ...

    def new_like(self, copy_rows: bool = False) -> Any: ...

    def swap_contents(self, other: Any) -> None: ...

    def load_rows(self, ids: torch.Tensor, values: torch.Tensor, slots: Optional[Dict[str, torch.Tensor]] = None,
                  *, clear: bool = True) -> None: ...

    def set_slot_rows(self, ids: torch.Tensor, slots: Dict[str, torch.Tensor]) -> int: ...


REQUIRED = ("embedding_dim", "table_name", "dtype", "partition", "__len__", "slot_names", "add_slot",
            "slot_init", "id_rows", "columns", "initial_rows", "set_partition", "new_like",
            "swap_contents", "load_rows", "set_slot_rows")


def is_table(module: Any) -> bool:
    """Whether `module` is a table to recsave: a HashTable, a module flagged
    ``__recsave_table__ = True`` (UsageError naming what it lacks when it is not TableLike), or one
    that satisfies TableLike."""
    if isinstance(module, HashTable):
        return True
    if getattr(type(module), "__recsave_table__", False) is True:
        missing = [m for m in REQUIRED if not hasattr(module, m)]
        if missing:
            raise UsageError(f"{type(module).__name__} sets __recsave_table__ but lacks {missing} of the "
                             f"TableLike protocol (docs/API.md)")
        return True
    # The cheap test first: a model has many modules and the protocol check looks at every member.
    return callable(getattr(module, "swap_contents", None)) and isinstance(module, TableLike)


def split_model(model: torch.nn.Module) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(tables by checkpoint name, the rest of the state_dict): HashTables as
    split_sparse_dense_state_dict finds them, plus every other TableLike submodule (named by its
    `table_name`, else its module path), whose own state_dict entries are left out of the rest."""
    tables, rest = tablestate.split(model.state_dict(keep_vars=True), HashTable)
    found: Dict[str, str] = {}
    for path, module in model.named_modules():
        if isinstance(module, HashTable) or any(path.startswith(p + ".") for p in found.values()) \
                or not is_table(module):
            continue
        name = getattr(module, "table_name", None) or path
        if not name or "@" in name:
            raise UsageError(f"table module {path or type(module).__name__!r} needs a table_name without "
                             f"'@' (a root module has no path to name it by)", key=path)
        if name in tables and tables[name] is not module:
            raise UsageError(f"two tables are both named {name!r}; give each its own table_name", key=name)
        tables[name] = module
        found[name] = path
        prefix = f"{path}." if path else ""
        rest = {k: v for k, v in rest.items() if not k.startswith(prefix)}
    return tables, rest


def refuse_meta_tensors(dense: Mapping[str, Any], where: str) -> None:
    """UsageError naming the dense tensors on the meta device: they hold no values to write, and a
    load's copy into one is a no-op that would leave the model unloaded while reporting it loaded."""
    meta = sorted(n for n, t in dense.items() if isinstance(t, torch.Tensor) and t.is_meta)
    if meta:
        shown = ", ".join(repr(n) for n in meta[:5]) + (f" and {len(meta) - 5} more" if len(meta) > 5 else "")
        raise UsageError(f"{where}: the model's {shown} {'is' if len(meta) == 1 else 'are'} on the meta device "
                         f"(no storage, no values); materialize the model first, e.g. "
                         f"model.to_empty(device='cpu') (then initialise or load it)", key=meta[0])
