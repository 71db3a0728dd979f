"""Rank / world size of this process, and the few collectives a save needs.

Defaults follow DESIGN.md: torch.distributed when initialised, else the RANK / WORLD_SIZE
environment variables, else a single process (0 / 1).
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

import torch.distributed as torch_dist

from .errors import UsageError


def initialized() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def resolve(shard_id: Optional[int] = None, shard_num: Optional[int] = None) -> Tuple[int, int]:
    """(rank, world_size) from the arguments, torch.distributed or the environment."""
    if initialized():
        rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    rank = rank if shard_id is None else shard_id
    world = world if shard_num is None else shard_num
    if not isinstance(rank, int) or not isinstance(world, int) or world < 1 or not 0 <= rank < world:
        raise UsageError(f"shard_id {rank!r} / shard_num {world!r} do not describe a rank of a world; "
                         f"need 0 <= shard_id < shard_num")
    return rank, world


def collective(world_size: int) -> bool:
    """Whether collectives are to be used: torch.distributed is up with this many ranks."""
    return world_size > 1 and initialized() and torch_dist.get_world_size() == world_size


def barrier(world_size: int) -> None:
    if collective(world_size):
        torch_dist.barrier()


def gather_objects(obj: Any, world_size: int) -> List[Any]:
    """Every rank's `obj`, in rank order (a list of one without collectives)."""
    if not collective(world_size):
        return [obj]
    out: List[Any] = [None] * world_size
    torch_dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, world_size: int, src: int = 0) -> Any:
    if not collective(world_size):
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src)
    return box[0]
