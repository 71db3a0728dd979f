"""Rank / world size of this process, and the few collectives a save needs.

Defaults (docs/API.md section 3): torch.distributed when initialised, else the RANK / WORLD_SIZE
environment variables, else a single process (0 / 1). Collectives run on a gloo group of recsave's
own with a timeout (knob ``collective_timeout_s``), so a rank that died or hangs makes the others
raise instead of waiting forever; filesystem polling is never used for coordination.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import weakref
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch
import torch.distributed as torch_dist

from recsave import gcpause, knobs
from recsave.errors import RankFailedError, RecsaveError, UsageError

T = TypeVar("T")
# Held weakly: torch.distributed owns the groups (new_group registers them) and
# destroy_process_group() must free them. A strong reference here kept their gloo threads
# (pt_gloo_runloop, gloo_tcp_loop) running past destroy_process_group() until the interpreter tore
# this module down at exit, where tearing them down intermittently aborted the process with
# "terminate called without an active exception".
_groups: "weakref.WeakValueDictionary[Any, Any]" = weakref.WeakValueDictionary()


def initialized() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not an int; set it to this process's "
                         f"{'rank' if name == 'RANK' else 'number of ranks'}, or unset it for a single "
                         f"process") from None


def resolve(shard_id: Optional[int] = None, shard_num: Optional[int] = None) -> Tuple[int, int]:
    """(rank, world_size) from the arguments, torch.distributed or the environment."""
    if initialized():
        rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
        source = "torch.distributed"
    else:
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        source = "the environment (RANK / WORLD_SIZE)"
    rank = rank if shard_id is None else shard_id
    world = world if shard_num is None else shard_num
    if not isinstance(rank, int) or not isinstance(world, int) or world < 1 or not 0 <= rank < world:
        given = "shard_id / shard_num" if shard_id is not None and shard_num is not None else \
            f"shard_id / shard_num and {source}"
        raise UsageError(f"rank {rank!r} of world size {world!r} (from {given}) is not a rank of a world; "
                         f"need 0 <= rank < world size: pass shard_id and shard_num together, or set "
                         f"RANK and WORLD_SIZE together")
    return rank, world


def require_own_rank(shard_id: Optional[int], where: str) -> None:
    """Inside a process group of several ranks each process is its group rank: a `shard_id` naming
    another would have two processes take the same share and none the other's (UsageError)."""
    if shard_id is not None and initialized() and torch_dist.get_world_size() > 1 \
            and shard_id != torch_dist.get_rank():
        raise UsageError(f"{where}: shard_id={shard_id}, but this process is rank {torch_dist.get_rank()} of "
                         f"the torch.distributed process group of {torch_dist.get_world_size()}; pass "
                         f"shard_id={torch_dist.get_rank()} or none")


def require_group_for_save(rank: int, world_size: int) -> None:
    """A save by one of several ranks needs the process group: without it each rank would gather
    only its own part and rank 0 would commit an index missing the others. (A save of world 1
    inside a larger group is one process saving alone: arguments.refuse_rank_shares.) Loads do
    not need the group (a rank reads its own buckets)."""
    if world_size > 1 and not collective(world_size):
        group = (f"the torch.distributed process group has {torch_dist.get_world_size()} rank(s)"
                 if initialized() else "no torch.distributed process group is initialised")
        raise UsageError(
            f"cannot save as rank {rank} of {world_size}: {group}, so the ranks cannot gather their "
            f"parts into one index; initialise torch.distributed (torch.distributed.init_process_group) "
            f"with {world_size} ranks before saving, or unset RANK/WORLD_SIZE (and pass no shard_id / "
            f"shard_num) for a single-process save")
    if collective(world_size) and rank != torch_dist.get_rank():
        # Two ranks saving as the same one: no rank or two ranks 0 would commit.
        raise UsageError(
            f"cannot save as rank {rank} of {world_size}: this process is rank {torch_dist.get_rank()} "
            f"of the torch.distributed process group; pass shard_id={torch_dist.get_rank()} or no shard_id")


def collective(world_size: int) -> bool:
    """Whether collectives are to be used: torch.distributed is up with this many ranks."""
    return world_size > 1 and initialized() and torch_dist.get_world_size() == world_size


def recsave_group(purpose: str = "save"):
    """recsave's gloo group (CPU object collectives even when the default backend is NCCL).
    Each `purpose` gets a group of its own: an async save's background thread runs collectives on
    the "save" group while the training thread's CheckpointManager.step() uses "step".
    torch.distributed owns the groups: torch.distributed.destroy_process_group() frees them (and
    their threads) with the default group; the next init gets new ones."""
    timeout = datetime.timedelta(seconds=float(knobs.get("collective_timeout_s")))
    key = (purpose, id(torch_dist.group.WORLD), timeout)  # the default group: a new init gets a new group
    group = _groups.get(key)  # gone once destroy_process_group() has run (held weakly, see above)
    if group is None:
        # Creating it is itself a collective: a rank that never comes fails it like any other.
        group = _guard("creating recsave's gloo group",
                       lambda: torch_dist.new_group(backend="gloo", timeout=timeout))
        _groups[key] = group
    return group


def _guard(what: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except RecsaveError:
        raise
    except Exception as exc:  # gloo reports a dead peer or a timeout as RuntimeError / DistBackendError
        err = RankFailedError(
            f"{what} failed: another rank died, failed or did not answer within "
            f"{knobs.get('collective_timeout_s')} s ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})")
        err.collective_failed = True  # the group cannot be used for clean-up
        raise err from exc


def max_over_ranks(values: List[int], world_size: int, what: str) -> List[int]:
    """The element-wise maximum of every rank's `values` (as many on each rank): one all_reduce on
    the "step" group; `values` itself without collectives. RankFailedError when a rank died or did
    not answer within the knob collective_timeout_s."""
    if not collective(world_size):
        return list(values)
    group = recsave_group("step")
    tensor = torch.tensor(values, dtype=torch.int64)

    def run():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX, group=group)
        return [int(v) for v in tensor.tolist()]
    return _guard(what, run)


def barrier(world_size: int) -> None:
    if collective(world_size):
        group = recsave_group()
        _guard("barrier", lambda: torch_dist.monitored_barrier(group=group, wait_all_ranks=True))


def gather_objects(obj: Any, world_size: int) -> List[Any]:
    """Every rank's `obj`, in rank order (a list of one without collectives)."""
    if not collective(world_size):
        return [obj]
    group = recsave_group()
    out: List[Any] = [None] * world_size

    def run():
        torch_dist.all_gather_object(out, obj, group=group)
        return out
    return _guard("all_gather", run)


def gather_to_rank0(obj: Any, world_size: int, rank: int) -> Optional[List[Any]]:
    """Every rank's `obj` in rank order on rank 0 (None on the others; a list of one without
    collectives). Only rank 0 receives: W objects in all, where gather_objects sends every rank
    all W (W^2 in all, which at a thousand ranks is most of a save's coordination)."""
    if not collective(world_size):
        return [obj]
    group = recsave_group()
    out: Optional[List[Any]] = [None] * world_size if rank == 0 else None

    def run() -> Optional[List[Any]]:
        with gcpause.paused():  # rank 0 unpickles W parts of many small records
            torch_dist.gather_object(obj, out, dst=0, group=group)
        return out
    return _guard("gather", run)


def group_rank() -> int:
    """This process's rank in torch.distributed's default group (0 without one)."""
    return torch_dist.get_rank() if initialized() else 0


def group() -> Tuple[int, int]:
    """(rank, world size) of this process in torch.distributed's default group; (0, 1) without one
    (the environment's RANK / WORLD_SIZE do not count: no collective can run without a group)."""
    return (torch_dist.get_rank(), torch_dist.get_world_size()) if initialized() else (0, 1)


def resolve_for_exchange(shard_id: Optional[int]) -> Tuple[int, int]:
    """(rank, world size) an exchange runs with: the process group's when one is up (a shard_id
    this rank is refused, checked inside the exchange, must not keep it from meeting the others),
    else resolve(shard_id) (no collectives run)."""
    return group() if initialized() else resolve(shard_id, None)


def broadcast_from_rank0(obj: Any, world_size: int) -> Any:
    """Rank 0's `obj` on every rank (`obj` itself without collectives); the root is the group's
    rank 0 whatever shard_id a caller passed. One broadcast over recsave's group: gloo's is a
    binomial tree, log2 W steps, the root sending one copy a step."""
    if not collective(world_size):
        return obj
    group = recsave_group()
    box = [obj if group_rank() == 0 else None]

    def run() -> Any:
        torch_dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
    return _guard("broadcast", run)


def run_everywhere(what: str, fn: Callable[[], T], world_size: int, *, only_rank0: bool = False,
                   rank: int = 0, agree: Optional[Tuple[str, Any]] = None,
                   agree_on_result: Optional[str] = None, rank0_result: bool = False) -> Optional[T]:
    """Runs `fn` (on every rank, or on rank 0 only), then lets every rank know whether it succeeded
    on all of them: a failure anywhere raises on every rank (the failing rank re-raises its own
    error, the others RankFailedError naming it; both carry `rank_failures`, rank -> the class
    names of its error, the same on every rank). Returns fn's result on this rank.

    `agree`: (what it is, value) that every rank must pass equal, checked in the same exchange (no
    extra collective round); when no rank failed and they differ, every rank raises UsageError
    naming the values. `agree_on_result` (what it is) does the same with fn's result as the value.
    `rank0_result`: every rank returns rank 0's result (a small object, sent in the same exchange)."""
    if agree_on_result is not None:
        if agree is not None:
            raise ValueError("run_everywhere: give agree or agree_on_result, not both")
        if only_rank0:
            raise ValueError("run_everywhere: agree_on_result needs fn run on every rank")
    result: Optional[T] = None
    error: Optional[BaseException] = None
    if not only_rank0 or rank == 0:
        try:
            result = fn()
        except BaseException as exc:  # reported to the other ranks, then re-raised below
            error = exc
    if world_size > 1 and collective(world_size):
        summary = None if error is None else f"{type(error).__name__}: {error}"
        kinds = None if error is None else [c.__name__ for c in type(error).__mro__]
        if agree_on_result is not None:
            agree = (agree_on_result, result)
        shared = result if rank0_result and rank == 0 else None
        gathered = gather_objects((summary, kinds, None if agree is None else agree[1], shared), world_size)
        failed = [(r, msg) for r, (msg, _, _, _) in enumerate(gathered) if msg is not None]
        if failed:
            # Every rank learns every rank's failure, so that a decision taken on it (a fallback
            # load skipping a damaged checkpoint) is the same on all of them.
            failures = {r: tuple(k or ()) for r, (msg, k, _, _) in enumerate(gathered) if msg is not None}
            if error is None:
                r, msg = failed[0]
                error = RankFailedError(f"{what} failed on rank {r}: {msg}")
            with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__
                error.rank_failures = failures  # type: ignore[attr-defined]
        elif agree is not None:  # a failing rank's value means nothing: failures first
            values = [value for _, _, value, _ in gathered]
            differ = [(r, v) for r, v in enumerate(values) if v != values[0]]
            if differ:
                r, v = differ[0]
                raise UsageError(f"{what}: the ranks disagree on {agree[0]}: rank 0 has {values[0]!r}, rank {r} "
                                 f"{v!r} ({len(differ)} rank(s) differ from rank 0); every rank must pass the "
                                 f"same")
        if rank0_result:
            result = gathered[0][3]
    if error is not None:
        raise error
    return result


def failed_only_with(exc: BaseException, kinds: Tuple[type, ...]) -> bool:
    """Whether `exc`, as raised by run_everywhere, and the failures of every other rank it records
    (`rank_failures`: rank -> the class names of its error) are all of `kinds`."""
    names = {k.__name__ for k in kinds}
    recorded = getattr(exc, "rank_failures", None)
    if not recorded:
        return isinstance(exc, kinds)
    return all(names.intersection(mro) for mro in recorded.values())


def failed_anywhere_with(exc: BaseException, kinds: Tuple[type, ...]) -> bool:
    """Whether `exc` is of `kinds`, or (as raised by run_everywhere) records a failure of that kind
    on some rank (`rank_failures`)."""
    if isinstance(exc, kinds):
        return True
    names = {k.__name__ for k in kinds}
    recorded = getattr(exc, "rank_failures", None) or {}
    return any(names.intersection(mro) for mro in recorded.values())
