"""Which rank owns an id (docs/FORMAT.md section 3: `partition` and chunk `buckets`).

``bucket = mix64(id) % num_buckets``, with mix64 the splitmix64 finaliser::

    z = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
    z = (z ^ (z >> 27)) * 0x94d049bb133111eb
    mix64(x) = z ^ (z >> 31)        (64-bit unsigned arithmetic)

Rank r of W owns the contiguous bucket range ``[r * B // W, (r + 1) * B // W)``. The training job
routes ids with the same functions, so a table on rank r holds only its ids, and a checkpoint written
by N ranks can be loaded by M: each reads the byte ranges of the buckets it owns.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from recsave import _C, knobs
from recsave.errors import UsageError

DEFAULT_NUM_BUCKETS = 4096
SCHEME = "mix64"


def mix64(ids: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser of int64 ids, as int64 (the bit pattern of the unsigned result)."""
    flat = _ids(ids)
    out = torch.empty_like(flat)
    x = flat.numpy().view("uint64").copy()  # numpy's uint64 arithmetic wraps like the C++ one
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9
    x ^= x >> 27
    x *= 0x94D049BB133111EB
    x ^= x >> 31
    out.numpy().view("uint64")[:] = x
    return out.view(ids.shape)


def bucket_of(ids: torch.Tensor, num_buckets: int = DEFAULT_NUM_BUCKETS) -> torch.Tensor:
    """mix64(id) % num_buckets for every id (int64, same shape)."""
    if num_buckets < 1:
        raise UsageError(f"num_buckets must be >= 1, got {num_buckets}")
    flat = _ids(ids)
    out = torch.empty_like(flat)
    _C.bucket_of(flat.data_ptr(), flat.numel(), num_buckets, out.data_ptr(), knobs.get("concurrency"))
    return out.view(ids.shape)


def stable_order(keys: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Stable argsort of keys in [0, num_keys) (e.g. buckets)."""
    return bucket_order(keys, num_keys)[0]


_COUNTING_MAX_KEYS = 1 << 24  # a counting sort's table of counts stays small


def bucket_order(keys: torch.Tensor, num_keys: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the stable argsort of `keys` in [0, num_keys), how many keys equal each value): a save's
    rows in bucket order and each bucket's row count. CPU keys go through a counting sort in the
    engine (a pass to count, one to place: about 3 ms for 1M keys, against 10-20 ms for a sort);
    others through a sort of the narrowest integer type that holds them."""
    if num_keys < 1:
        raise UsageError(f"num_keys must be >= 1, got {num_keys}")
    flat = keys.reshape(-1)
    if flat.device.type == "cpu" and num_keys <= _COUNTING_MAX_KEYS:
        flat = flat.to(torch.int64).contiguous()
        order = torch.empty(flat.numel(), dtype=torch.int64)
        counts = torch.empty(num_keys, dtype=torch.int64)
        _C.counting_order(flat.data_ptr(), flat.numel(), num_keys, order.data_ptr(), counts.data_ptr())
        return order, counts
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_keys):
        raise UsageError(f"keys must lie in [0, {num_keys})")
    dtype = torch.int16 if num_keys <= 1 << 15 else torch.int32 if num_keys <= 1 << 31 else torch.int64
    return torch.sort(flat.to(dtype), stable=True).indices, torch.bincount(flat, minlength=num_keys)


class OwnedBuckets(NamedTuple):
    """A rank's ids in bucket order (owned_bucket_order)."""
    order: torch.Tensor   # int64 positions into the ids, stable within a bucket
    counts: torch.Tensor  # int64, ids per owned bucket
    ids: torch.Tensor     # the ids in that order: ids[order]


def owned_bucket_order(ids: torch.Tensor, num_buckets: int, first: int, stop: int) -> Optional[OwnedBuckets]:
    """bucket_order of `ids` by bucket - first for a rank that owns buckets [first, stop): the stable
    order, each owned bucket's count and the ids in that order, or None when an id lies in a bucket
    outside the range (another rank's id). What a save's layout needs, in one engine call that
    hashes the ids on the `concurrency` knob's threads without writing their buckets out as a
    tensor, and places the ids while it places their positions."""
    if num_buckets < 1 or not 0 <= first < stop <= num_buckets:
        raise UsageError(f"bucket range [{first}, {stop}) is not a range of {num_buckets} buckets")
    flat = _ids(ids)
    order = torch.empty(flat.numel(), dtype=torch.int64)
    counts = torch.empty(stop - first, dtype=torch.int64)
    in_order = torch.empty(flat.numel(), dtype=torch.int64)
    ok = _C.bucket_order_of_ids(flat.data_ptr(), flat.numel(), num_buckets, first, stop - first, order.data_ptr(),
                                counts.data_ptr(), in_order.data_ptr(), knobs.get("concurrency"))
    return OwnedBuckets(order, counts, in_order) if ok else None


def bucket_range(rank: int, world_size: int, num_buckets: int = DEFAULT_NUM_BUCKETS) -> Tuple[int, int]:
    """[first, stop) buckets owned by `rank` of `world_size`."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} is not in a world of {world_size}")
    if world_size > num_buckets:
        raise UsageError(f"{world_size} ranks need at least as many buckets (have {num_buckets})")
    return rank * num_buckets // world_size, (rank + 1) * num_buckets // world_size


def owner_of(ids: torch.Tensor, world_size: int, num_buckets: int = DEFAULT_NUM_BUCKETS) -> torch.Tensor:
    """Rank owning each id: the r with bucket in bucket_range(r, world_size)."""
    if world_size < 1 or world_size > num_buckets:
        raise UsageError(f"world_size must be in [1, {num_buckets}], got {world_size}")
    buckets = bucket_of(ids, num_buckets)
    # The owner is the last rank whose first bucket is <= the id's bucket.
    starts = torch.tensor([r * num_buckets // world_size for r in range(world_size)], dtype=torch.int64)
    return torch.searchsorted(starts, buckets.reshape(-1), right=True).sub_(1).view(buckets.shape)


def _ids(ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
        raise UsageError(f"ids must be an int64 tensor, got {getattr(ids, 'dtype', type(ids))}")
    return ids.detach().reshape(-1).cpu().contiguous()


def route(ids: torch.Tensor, world_size: int, num_buckets: int = DEFAULT_NUM_BUCKETS) -> Tuple[torch.Tensor, List[int]]:
    """Groups a batch's ids by owner: returns (order, counts) such that ``ids.reshape(-1)[order]``
    lists rank 0's ids first, then rank 1's, ... with ``counts[r]`` ids for rank r (ready for
    torch.distributed.all_to_all_single). ``order.argsort()`` puts results back in batch order."""
    owners = owner_of(ids, world_size, num_buckets).reshape(-1)
    order = torch.argsort(owners, stable=True)
    counts = torch.bincount(owners, minlength=world_size).tolist()
    return order, counts


def first_foreign(ids: torch.Tensor, part: Tuple[int, int, int]) -> Optional[Tuple[int, int, int]]:
    """(position of the first id rank `part[0]` of `part[1]` (with `part[2]` buckets) does not own,
    that id's owner, how many such ids), or None when it owns every one."""
    rank, world, num_buckets = part
    owners = owner_of(ids, world, num_buckets)
    foreign = owners != rank
    if not bool(foreign.any()):  # (a lookup's path: one pass when every id is owned)
        return None
    where = foreign.nonzero()
    i = int(where[0])
    return i, int(owners[i]), int(where.numel())


def check_owned(ids: torch.Tensor, part: Tuple[int, int, int], table_name: Optional[str]) -> None:
    """UsageError naming the table unless rank `part[0]` of `part[1]` (with `part[2]` buckets)
    owns every id."""
    found = first_foreign(ids, part)
    if found is not None:
        i, owner, _ = found
        raise UsageError(
            f"table {table_name!r} is the shard of rank {part[0]} of {part[1]}, but id {int(ids[i])} belongs "
            f"to rank {owner}; route ids to their owners with recsave.partition.route / "
            f"owner_of before the lookup", key=table_name)
