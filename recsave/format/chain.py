"""Chains of delta checkpoints (docs/FORMAT.md section 10): a delta names its parent, a checkpoint
in the same output dir, and the CRC32C of the parent's index bytes; following parents ends at the
chain's base, a full checkpoint. A missing or damaged member, or a parent whose index bytes changed,
is a CorruptCheckpointError naming it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from recsave import _C
from recsave.errors import CheckpointNotFoundError, CorruptCheckpointError, OverLimitError
from recsave.format import index as index_mod
from recsave.format.checks import is_plain_name
from recsave.format.records import KIND_FULL, Index, Parent
from recsave.storage import Storage, get_storage

MAX_CHAIN = 100_000  # a cycle of parents is damage, never followed for ever


@dataclass(frozen=True)
class IndexIdentity:
    """What a delta records of its parent's index: the CRC32C of its bytes and its chain's base
    (the checkpoint's own id for a full one). A load reports it of each index it read, and a writer
    keeps it of each it committed: while the bytes on disk still have that CRC, a delta save takes
    these instead of parsing the parent's index again (a few ms a save at 4096 buckets a table)."""
    crc32c: int
    base: str


@dataclass(frozen=True)
class Member:
    """One checkpoint of a chain: its directory, id and index."""
    ckpt_dir: str
    ckpt_id: str
    index: Index


def index_crc(storage: Storage, ckpt_dir: str) -> int:
    """CRC32C of the index bytes of `ckpt_dir` (what a delta records of its parent), without
    parsing them; CheckpointNotFoundError when there is no index."""
    path = storage.join(ckpt_dir, index_mod.INDEX_FILE)
    return int(_C.crc32c(index_mod.read_bytes(storage, path)))


def read_with_crc(storage: Storage, ckpt_dir: str) -> Tuple[Index, int]:
    """The index of `ckpt_dir` and the CRC32C of its bytes, from one read (so both describe the
    same bytes)."""
    path = storage.join(ckpt_dir, index_mod.INDEX_FILE)
    data = index_mod.read_bytes(storage, path)
    return index_mod.parse(data, path), int(_C.crc32c(data))


def resolve(storage: Storage, ckpt_dir: str, index: Optional[Index] = None) -> List[Member]:
    """The chain of checkpoint `ckpt_dir`, base first, each parent's index checked against the CRC32C
    its child recorded. A full checkpoint is its own chain."""
    if index is None:
        index = index_mod.read(ckpt_dir, storage)
    out_dir, ckpt_id = storage.split(ckpt_dir)
    chain = [Member(ckpt_dir, ckpt_id, index)]
    seen: Set[str] = {ckpt_id}
    while chain[-1].index.is_delta:
        child = chain[-1]
        parent = child.index.parent
        assert parent is not None  # validated with the delta's index
        parent_dir = storage.join(out_dir, parent.id)
        if parent.id in seen or len(chain) > MAX_CHAIN:
            raise CorruptCheckpointError(f"{child.ckpt_dir}: its chain of parents loops back to "
                                         f"{parent_dir}; the index is damaged", path=child.ckpt_dir)
        try:
            parent_index, crc = read_with_crc(storage, parent_dir)
        except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
            missing = isinstance(exc, CheckpointNotFoundError)
            raise CorruptCheckpointError(
                f"{parent_dir}: the parent of delta checkpoint {child.ckpt_dir} is "
                f"{'missing' if missing else 'damaged'} ({exc}); the delta cannot be restored without "
                f"its whole chain: restore another checkpoint", path=parent_dir) from exc
        if crc != parent.crc32c:
            raise CorruptCheckpointError(
                f"{parent_dir}: the index of this parent of delta checkpoint {child.ckpt_dir} is not the "
                f"one the delta was saved against (CRC32C {crc:#010x}, recorded "
                f"{parent.crc32c:#010x}): it was rewritten; restore another checkpoint", path=parent_dir)
        seen.add(parent.id)
        chain.append(Member(parent_dir, parent.id, parent_index))
    chain.reverse()
    if chain[0].index.kind != KIND_FULL:
        raise CorruptCheckpointError(f"{chain[0].ckpt_dir}: the chain of {ckpt_dir} starts at a checkpoint of kind "
                                     f"{chain[0].index.kind!r}; a chain's base must be a full checkpoint",
                                     path=chain[0].ckpt_dir)
    if chain[-1].index.base is not None and chain[0].ckpt_id != chain[-1].index.base:
        raise CorruptCheckpointError(f"{ckpt_dir}: the chain's base is {chain[0].ckpt_id!r} but the index "
                                     f"names {chain[-1].index.base!r}; the index is damaged", path=ckpt_dir)
    return chain


def members(storage: Storage, output_dir: str, ckpt_id: str) -> List[str]:
    """Ids of the chain of checkpoint `ckpt_id` of output_dir, base first (itself last); CorruptCheckpointError
    when a member is missing or damaged. A full checkpoint's chain is [ckpt_id]."""
    return [m.ckpt_id for m in resolve(storage, storage.join(output_dir, ckpt_id))]


def needed_by(storage: Storage, output_dir: str, ids: Iterable[str],
              parents_of: Optional[Callable[[str], Iterable[str]]] = None) -> Set[str]:
    """The checkpoints that the given ones need (their chain members, themselves included), as far
    as the chains can be followed: a broken chain keeps what it reaches (retention never deletes a
    checkpoint because another one is damaged; each delta also names its chain's base, kept even
    when a member between them cannot be read). `parents_of` (id -> what it needs directly;
    default parent_ids) lets a writer that remembers them skip reading the indexes again."""
    parents = parents_of or (lambda i: parent_ids(storage, output_dir, i))
    needed: Set[str] = set()
    for ckpt_id in ids:
        needed.add(ckpt_id)
        needed.update(_reachable(parents, ckpt_id))
    return needed


def parent_ids(storage: Storage, output_dir: str, ckpt_id: str) -> List[str]:
    """The checkpoints `ckpt_id` depends on directly: for a delta its parent and its chain's base
    (the base too, so that a member between them whose index cannot be read does not cut the base
    loose), [] otherwise (the `depends_on` hook of format/retention.py, which follows it
    transitively)."""
    return _needs(storage, storage.join(output_dir, ckpt_id))


def needs_of(index: Index) -> List[str]:
    """parent_ids of a checkpoint whose parsed index is at hand (a writer's just committed one)."""
    return _dependencies(index.parent.id if index.parent is not None else None, index.base)


def _reachable(parents_of: Callable[[str], Iterable[str]], ckpt_id: str) -> List[str]:
    out: List[str] = []
    todo = [ckpt_id]
    while todo and len(out) <= MAX_CHAIN:
        current = todo.pop()
        if current in out:
            continue
        out.append(current)
        todo.extend(parents_of(current))
    return out


def _needs(storage: Storage, ckpt_dir: str) -> List[str]:
    """The `parent.id` and `base` of ckpt_dir's index, read as plain JSON (retention errs on
    keeping: what an index that does not validate names is kept too); [] when there is none: no
    index, or one that is not JSON. A read that fails otherwise (StorageError: a network error, a
    timeout; OverLimitError: an index over the knob max_index_bytes here, maybe intact) is no answer
    and propagates: taken as "no parent", it would let rotation delete it."""
    try:
        data = index_mod.read_bytes(storage, storage.join(ckpt_dir, index_mod.INDEX_FILE))
    except OverLimitError:
        raise
    except (CheckpointNotFoundError, CorruptCheckpointError):  # absent, or damaged (kept as such)
        return []
    raw = _raw_json(data)
    parent = raw.get("parent")
    return _dependencies(parent.get("id") if isinstance(parent, dict) else None, raw.get("base"))


def _raw_json(data: bytes) -> Dict[str, Any]:
    """Index bytes as a JSON object, {} when they are not one."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        return {}
    return raw if isinstance(raw, dict) else {}


def _dependencies(parent: Any, base: Any) -> List[str]:
    """[parent, base] as far as they are checkpoint ids, each once (a delta of the base names it
    twice)."""
    out: List[str] = []
    for ckpt in (parent, base):
        if isinstance(ckpt, str) and is_plain_name(ckpt) and ckpt not in out:
            out.append(ckpt)
    return out


GONE = "whose directory or index is gone"
DAMAGED = "whose index is damaged"


@dataclass(frozen=True)
class MemberState:
    """What broken_chains() needs of one checkpoint, from whatever its caller already read of the
    index: `problem` (GONE, or DAMAGED where the bytes prove it) when it cannot be a chain's member;
    else the CRC32C of the index's bytes when they were read, and what they name: a delta's parent
    and its chain's base, and the checkpoint's `kind` when it validated. `unread` (why: over the
    knob max_index_bytes, written by a newer recsave) when this recsave cannot read it whole: a
    newer recsave's bytes still name a parent, read as plain JSON (raw_links)."""
    problem: Optional[str] = None
    crc32c: Optional[int] = None
    parent: Optional[Parent] = None
    base: Optional[str] = None
    kind: Optional[str] = None
    unread: str = ""


def state_of_index(index: Index, crc32c: int) -> MemberState:
    """The MemberState of a checkpoint whose index was read whole and validated."""
    return MemberState(crc32c=crc32c, parent=index.parent, base=index.base, kind=index.kind)


def raw_links(data: bytes) -> Tuple[Optional[Parent], Optional[str]]:
    """(parent, base) that index bytes name, read as plain JSON without validating them (an index
    of a newer recsave); None for what is absent or not well formed."""
    raw = _raw_json(data)
    parent, base = raw.get("parent"), raw.get("base")
    pid, pcrc = (parent.get("id"), parent.get("crc32c")) if isinstance(parent, dict) else (None, None)
    link = Parent(pid, pcrc) if isinstance(pid, str) and is_plain_name(pid) and isinstance(pcrc, int) \
        and not isinstance(pcrc, bool) and 0 <= pcrc <= 0xFFFFFFFF else None
    return link, base if isinstance(base, str) and is_plain_name(base) else None


def read_state(storage: Storage, ckpt_dir: str) -> Tuple[Index, MemberState]:
    """index.read(ckpt_dir) (and its errors) with the checkpoint's MemberState, from one read."""
    data, path = index_mod.read_raw(ckpt_dir, storage)
    index = index_mod.parse(data, path)
    return index, state_of_index(index, int(_C.crc32c(data)))


def broken_chains(ids: Iterable[str], state_of: Callable[[str], MemberState], *,
                  unknown_breaks: bool = False) -> Dict[str, str]:
    """The deltas among `ids` whose chain is proven broken -> why (broken_why): following parents
    from the delta, a member gone or damaged, one whose index is not the one its child was saved
    against (saved again since), a loop of parents, a chain that does not end at the base the
    delta names, or that base gone or damaged, as resolve() finds it when a restore reads the
    chain, or a base that is not a full checkpoint. A member only unreadable here
    (MemberState.unread) breaks nothing: leaving the delta out of the list would roll the job back
    (a newer recsave's member is followed by the parent its bytes name; the walk ends at one whose
    bytes were not read, the base the delta names still checked); with `unknown_breaks` (may gc
    delete this?) it counts as broken, which errs toward keeping. Full checkpoints, and ids
    unreadable themselves, are never broken. The one rule of ckptlist.rebuild, `recsave ls` /
    `repair` and collect_garbage."""
    broken = {}
    for delta in ids:
        lost = _lost_members(delta, state_of, unknown_breaks)
        if lost:
            broken[delta] = broken_why(delta, lost)
    return broken


def _lost_members(delta: str, state_of: Callable[[str], MemberState], unknown_breaks: bool) -> List[str]:
    """What broken_chains() finds missing from the chain of `delta`, each "<id>, <why>"; []: none."""
    own = state_of(delta)
    if own.parent is None or own.unread:
        return []
    child, at, walked = delta, own, {delta}
    while at.parent is not None:
        parent = at.parent
        if parent.id in walked or len(walked) > MAX_CHAIN:
            return [f"{parent.id}, whose chain of parents loops back to it"]
        walked.add(parent.id)
        got = state_of(parent.id)
        if got.problem is not None:
            return [f"{parent.id}, {got.problem}"]
        if got.crc32c is not None and got.crc32c != parent.crc32c:
            return [f"{parent.id}, whose index is not the one {child} was saved against (saved again since)"]
        if got.unread:
            if unknown_breaks:
                return [f"{parent.id}, whose index cannot be read here ({got.unread})"]
            # Its bytes not read, or naming no parent this recsave reads (none, or one in a newer
            # form: it may be the base or not): the walk ends here (the named base is checked below).
            if got.crc32c is None or got.parent is None:
                break
        child, at = parent.id, got  # a newer recsave's member: followed by the parent its bytes name
    else:  # the walk reached a checkpoint without a parent: the chain's base
        if own.base is not None and child != own.base:
            return [f"{own.base}, which its index names as its chain's base, where its parents end at {child}"]
        if at.kind is not None and at.kind != KIND_FULL:
            return [f"{child}, a checkpoint of kind {at.kind!r} where a chain's base must be a full checkpoint"]
        return []
    if own.base is not None and own.base not in walked:
        base = state_of(own.base)
        if base.problem is not None:
            return [f"{own.base}, {base.problem}"]
    return []


def broken_why(delta: str, lost: Sequence[str]) -> str:
    """Why delta checkpoint `delta` is left out of the list: the members of its chain it lacks
    (each "<id>, <why>")."""
    return (f"delta checkpoint {delta} needs {'; '.join(lost)}: it cannot be restored without its whole chain; "
            f"restore another checkpoint (its directory stays: `recsave gc` keeps it, `recsave gc "
            f"--remove-broken` removes it)")


def open_chain(ckpt_dir: str, storage: Optional[Storage] = None) -> List[Member]:
    """resolve() with the storage of ckpt_dir."""
    return resolve(storage or get_storage(ckpt_dir), ckpt_dir)
