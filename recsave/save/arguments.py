"""Argument checks of the Saver facade (save/saver.py) that go beyond one type check: a save's id
and shard arguments, names and objects to register, a plan's `only` names. Each raises before
anything is written or changed (ArgumentTypeError for a wrong type, UsageError for a wrong value).
"""
from __future__ import annotations

from typing import Any, Collection, Mapping, Optional, Set, Tuple

import torch

from recsave.argcheck import check
from recsave.argcheck import fail as type_error
from recsave.errors import UsageError
from recsave.format import ckptlist
from recsave.load import contents
from recsave.save.snapshot import ids_by_row
from recsave.storage import dist
from recsave.tables import partition


def save_args(where: str, ckpt_id: Any, shard_id: Any, shard_num: Any) -> Tuple[int, int]:
    """Checks a save's arguments; returns (rank, world)."""
    check(ckpt_id, str, "ckpt_id", where)
    check(shard_id, int, "shard_id", where, optional=True)
    check(shard_num, int, "shard_num", where, optional=True)
    ckptlist.validate_id(ckpt_id)
    rank, world = dist.resolve(shard_id, shard_num)
    dist.require_group_for_save(rank, world)
    return rank, world


def load_alone(where: str, shard_id: Any, shard_num: Any) -> bool:
    """Checks a load's `shard_num`: None (the world is the process group's, or RANK / WORLD_SIZE)
    or 1, this process loading alone: whole tables (every bucket), no collective, so that each
    rank of a group can restore replicated tables, e.g. a checkpoint one rank saved alone."""
    check(shard_num, int, "shard_num", where, optional=True)
    if shard_num is None:
        return False
    if shard_num != 1:
        raise UsageError(f"{where}: shard_num={shard_num!r}; a load takes its world size from the process "
                         f"group (or RANK / WORLD_SIZE): pass shard_num=1 to load whole tables in this "
                         f"process alone, or no shard_num", key="shard_num")
    if shard_id not in (None, 0):
        raise UsageError(f"{where}: shard_id={shard_id!r} with shard_num=1; a process loading alone is "
                         f"rank 0 of 1: pass shard_id=0 or none", key="shard_id")
    return True


def registered_name(name: Any, model: torch.nn.Module, taken: Collection[str]) -> None:
    """`name` may be registered: a non-empty str without '@', not in `taken` (the names registered
    already) and not a table or parameter name of `model`."""
    check(name, str, "name", "register")
    if not name or "@" in name:
        raise UsageError(f"registered name {name!r} must be a non-empty string without '@'")
    if name in taken:
        raise UsageError(f"{name!r} is registered already; pick another name", key=name)
    tables, dense = contents.model_state(model)
    if name in tables or name in dense:
        raise UsageError(f"{name!r} is already a table or parameter name of the model", key=name)


def stateful(arg: str, obj: Any, where: str) -> None:
    """`obj` has state_dict() and load_state_dict() methods."""
    if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
        raise type_error(where, arg, "an object with state_dict() and load_state_dict() methods", obj)


def io_stateful(name: str, obj: Any) -> None:
    """`obj` has dump_io_state() and load_io_state(state) methods."""
    if not callable(getattr(obj, "dump_io_state", None)) or not callable(getattr(obj, "load_io_state", None)):
        raise type_error(f"register_io_state({name!r})", "obj",
                         "an object with dump_io_state() and load_io_state(state) methods", obj)


def only_names(only: Any, planned: Collection[str]) -> Optional[Set[str]]:
    """execute_plan's `only`: None, or a collection of model names the plan loads (returned as a set)."""
    check(only, (set, frozenset, list, tuple), "only", "execute_plan", optional=True,
          expected="a set of model names")
    if only is None:
        return None
    names = set(only)
    odd = sorted(repr(n) for n in names if not isinstance(n, str) or n not in planned)
    if odd:
        raise UsageError(f"execute_plan: only names {', '.join(odd)} that the plan does not load; it "
                         f"loads {sorted(planned)}", key="only")
    return names


_SHARE_MIN_IDS = 64  # fewer ids may all fall in one rank's buckets by chance (2 ranks: 2^-64 at 64)


def refuse_rank_shares(tables: Mapping[str, Any], num_buckets: int) -> None:
    """For a save of world 1 by a process of a torch.distributed group of several ranks (one
    process saving a model it holds whole, e.g. replicated tables; the other ranks take no part):
    UsageError for a table that is evidently this rank's share of a sharded model, which would be
    committed as the whole table (and rotation would prune the last full checkpoint): one a
    multi-rank save or load partitioned, or one of at least 64 ids all in the buckets this group
    rank owns."""
    rank, world = dist.group()
    if world <= 1:
        return
    for name, table in tables.items():
        part = getattr(table, "partition", None)
        why = f"it is partitioned as rank {part[0]} of {part[1]}" if isinstance(part, tuple) and part[1] > 1 else None
        if why is None and _all_owned(ids_by_row(table)[0].reshape(-1), rank, world, num_buckets):
            why = f"its ids are all rank {rank}'s"
        if why is not None:
            raise UsageError(
                f"table {name!r} is this rank's share of a model sharded over the {world} ranks of the "
                f"process group ({why}), and a save with shard_num=1 would commit "
                f"it as the whole table; save from every rank with shard_num={world} or none. A model "
                f"each rank holds whole (replicated tables) may be saved by one rank with shard_num=1",
                key=name)


def _all_owned(ids: torch.Tensor, rank: int, world: int, num_buckets: int) -> bool:
    """Whether at least _SHARE_MIN_IDS ids are all `rank`'s, looked at in growing slices that stop
    at the first id of another rank: a table every rank holds whole costs a look at 64 ids (and a
    device table copies only the slices it looks at)."""
    if ids.numel() < _SHARE_MIN_IDS:
        return False
    begin, size = 0, _SHARE_MIN_IDS
    while begin < ids.numel():
        part = ids[begin:begin + size].cpu()
        if not bool((partition.owner_of(part, world, num_buckets) == rank).all()):
            return False
        begin, size = begin + size, min(size * 8, 1 << 20)
    return True
