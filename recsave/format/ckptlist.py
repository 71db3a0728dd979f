"""The `checkpoint` file of an output directory: committed checkpoint ids, oldest first."""
from __future__ import annotations

import datetime
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

from recsave import _C, knobs
from recsave.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    OverLimitError,
    RecsaveError,
    UsageError,
)
from recsave.format import chain, seal
from recsave.format import index as index_mod
from recsave.format.checks import is_plain_name
from recsave.format.index import INDEX_FILE
from recsave.format.records import Index, Parent, is_newer_index, readable_version
from recsave.storage import Storage
from recsave.storage.lock import LOCK_FILE

LIST_FILE = "checkpoint"
# Where a save moves the directories its rotation prunes before deleting them off its critical
# path (save/pruning.py); whatever is inside is garbage (docs/FORMAT.md section 1). Not a plain
# name ('+'), so no checkpoint id of any release can be it: readers and rebuilds skip it as they
# skip every name that is not an id.
PRUNED_DIR = ".recsave+pruned"
MAX_LIST_BYTES = 16 << 20


def validate_id(ckpt_id: object) -> str:
    """A checkpoint id is a plain directory name (docs/FORMAT.md section 1)."""
    if not isinstance(ckpt_id, str) or not is_plain_name(ckpt_id) or ckpt_id in (LIST_FILE, LOCK_FILE) \
            or _OUTPUT_DIR_TEMP.match(ckpt_id):
        raise UsageError(f"checkpoint id {ckpt_id!r} is not usable: use letters, digits, '_', '.', '-' "
                         f"(no path separators, not '.', '..', {LIST_FILE!r}, {LOCK_FILE!r} or a temporary "
                         f"name of those, '<name>.tmp-<digits and ->'), e.g. 'ckpt_1000'")
    return ckpt_id


def read(storage: Storage, output_dir: str) -> List[str]:
    """Committed ids as the `checkpoint` file lists them, oldest first; [] when there is no such
    file. A garbled file raises CorruptCheckpointError (`committed` rebuilds it instead)."""
    path = storage.join(output_dir, LIST_FILE)
    if not storage.exists(path):
        return []
    ids, problem = _parse(storage.read_bytes(path, MAX_LIST_BYTES))
    if problem is not None:
        raise CorruptCheckpointError(f"{path}: {problem}; run `recsave repair {output_dir}` to rebuild it "
                                     f"from the checkpoints' indexes", path=path)
    return ids


def _parse(raw: bytes) -> Tuple[List[str], Optional[str]]:
    """(ids, None) for a well-formed list, else ([], what is wrong with it)."""
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return [], "is not UTF-8 text"
    ids: List[str] = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        if not is_plain_name(line) or line == LIST_FILE:  # '..' and paths are refused
            return [], f"line {n} {line!r} is not a checkpoint id"
        if line in ids:  # a repeated id counts where it appears last (the last line is the latest)
            ids.remove(line)
        ids.append(line)
    return ids, None


def write(storage: Storage, output_dir: str, ids: List[str]) -> None:
    """Replaces the `checkpoint` file atomically (temp + rename locally, one put remotely). A
    directory in its place (someone's, never recsave's) is a UsageError saying to move it."""
    path = storage.join(output_dir, LIST_FILE)
    try:
        storage.write_atomic(path, "".join(f"{i}\n" for i in ids).encode())
    except OSError:  # StorageError too; looked at only now: a save pays no extra request for it
        if storage.isdir(path):
            raise UsageError(f"{path} is a directory, where recsave keeps the list of committed checkpoints; "
                             f"move it away (nothing of it was changed), then save again or run `recsave "
                             f"repair {output_dir}`", path=path) from None
        raise


@dataclass(frozen=True)
class Listing:
    """The committed checkpoints of an output dir, as `committed` found them."""

    ids: List[str]  # oldest first
    found: bool  # a `checkpoint` file or a committed checkpoint directory exists: an output dir
    problem: Optional[str] = None  # what was wrong with the file; None: it was used as it is
    stale: List[str] = field(default_factory=list)  # listed ids left out: directory or index gone
    left_out: Dict[str, str] = field(default_factory=dict)  # directories with an invalid index -> why
    broken: Set[str] = field(default_factory=set)  # of left_out: deltas whose chain is proven broken (damage)
    rebuilt: bool = False  # `ids` come from the indexes, not from the file
    rewritten: bool = False  # the file was replaced by `ids`


def committed(storage: Storage, output_dir: str, *, rewrite: bool = False, warn: bool = True,
              warned: Optional[Set[str]] = None, being_written: Optional[str] = None) -> Listing:
    """The committed checkpoints of output_dir, oldest first (docs/FORMAT.md section 1).

    The `checkpoint` file says which they are, unless it is missing, empty, garbled (not UTF-8, a
    line that is no id), cut short (a last line without its newline naming nothing) or lists no id
    whose index exists while committed directories do: then the
    list is rebuilt from the indexes (`rebuild`). With `rewrite` (only for a caller that holds the
    writer lock: a save, gc, repair) the rebuilt list replaces the file, and listed ids whose
    directory or index is gone are dropped from it too, so that they never take a max_keep slot
    from a committed checkpoint; readers leave both to the fallback load. Every change is reported
    by one RuntimeWarning naming the file (with `warn`; a message already in `warned` is not
    repeated). `being_written`: the id a save is committing, which a rebuild does not count."""
    path = storage.join(output_dir, LIST_FILE)
    listed: List[str] = []
    raw = b""
    problem: Optional[str] = None
    garbled = False
    if not storage.exists(path):
        problem = "is missing"
    else:
        try:
            raw = storage.read_bytes(path, MAX_LIST_BYTES)
        except CorruptCheckpointError as exc:  # too big, not a file (a StorageError propagates: maybe transient)
            problem, garbled = f"cannot be read ({' '.join(str(exc).split())})", True
        else:
            listed, problem = _parse(raw)
            garbled = problem is not None
            if problem is None and not listed:
                problem = "is empty"
    stale = [i for i in listed if not storage.exists(storage.join(output_dir, i, INDEX_FILE))]
    if problem is None and stale and len(stale) == len(listed):
        problem = f"lists no checkpoint whose index exists: {', '.join(stale)}"
    if problem is None and listed and not raw.endswith(b"\n"):
        # Every line recsave writes ends in a newline: a last id without one is a file cut short
        # when it names nothing, or only the start of an unlisted directory's name (ckpt_10 cut to
        # ckpt_1). The ids after the cut may be the newest: trusting the rest would take an older
        # checkpoint for the latest and prune the newer ones.
        last = listed[-1]
        if stale and stale[-1] == last:
            problem = f"is cut short: its last line {last!r} has no newline and names no checkpoint"
        elif any(n != last and n.startswith(last) and n not in listed for n in storage.listdir(output_dir)):
            problem = (f"is cut short: its last line {last!r} has no newline and begins the name of a "
                       f"directory it does not list")
    if problem is None:
        if not stale or not rewrite:
            return Listing(listed, True)
        ids = [i for i in listed if i not in stale]
        write(storage, output_dir, ids)
        problem = f"lists checkpoints whose directory or index is gone: {', '.join(stale)}"
        _warn(f"{path}: {problem}; dropped them; rewrote the file", warn, None)
        return Listing(ids, True, problem, stale, rewritten=True)
    ids, left_out, broken = rebuild(storage, output_dir, skip=being_written)
    if not ids and not garbled:  # nothing to rebuild from
        found = bool(listed or left_out) or problem != "is missing"
        if not (rewrite and listed):  # the file stands (loads report what is missing)
            if left_out:  # not a fresh output dir: its checkpoints are damaged or unreadable here, never "none yet"
                _warn(f"{path}: {problem}; no checkpoint readable here to rebuild the list from" +
                      "".join(f"; left out {n} ({why})" for n, why in left_out.items()), warn,
                      None if rewrite else warned)
            return Listing(listed, found, problem if found else None, left_out=left_out, broken=broken)
        # Every listed id is gone: a writer drops them, as it drops some (max_keep slots).
        write(storage, output_dir, [])
        _warn(f"{path}: {problem}; dropped them; rewrote the file", warn, None)
        return Listing([], True, problem, list(listed), left_out, broken, rewritten=True)
    stale = [i for i in listed if i not in ids and i not in left_out]
    if rewrite:
        write(storage, output_dir, ids)
    _warn(f"{path}: {problem}; rebuilt the list of committed checkpoints from their indexes: "
          f"{', '.join(ids) or 'none'}" + "".join(f"; left out {n} ({why})" for n, why in left_out.items())
          + ("; rewrote the file" if rewrite else
             "; a directory is in its place: move it away (recsave never removes it)" if storage.isdir(path) else
             f"; the file is left as it is: run `recsave repair {output_dir}` to rewrite it"),
          warn, None if rewrite else warned)
    return Listing(ids, True, problem, stale, left_out, broken, rebuilt=True, rewritten=rewrite)


def _warn(message: str, warn: bool, warned: Optional[Set[str]]) -> None:
    if not warn or (warned is not None and message in warned):
        return
    if warned is not None:
        warned.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def rebuild(storage: Storage, output_dir: str,
            skip: Optional[str] = None) -> Tuple[List[str], Dict[str, str], Set[str]]:
    """The committed checkpoints of output_dir found by their indexes, the directories left out
    (name -> why) and which of those are deltas whose chain is proven broken. `skip`: a directory
    not to look at (the checkpoint a save is committing: its index was just written, parsing it
    back is wasted).

    A directory is committed when its `index` validates (section 3), or was written by a newer
    recsave (newer_format_version), unless it is a delta whose chain is proven broken
    (chain.broken_chains): listed again, it would be restored as the latest and fail, ranked by
    keep_best, and refuse a save of its id as "committed already". Order: the commit time
    (`created_at`; one that does not read as a UTC time before any), then `step` (none before
    any), then the id, then a delta's listed ancestors before it (_parents_first). Commit order,
    not step order: after a rewind (a restore of an older step, then saves) the abandoned
    branch's checkpoints have higher steps but committed earlier, and must not come back as the
    latest.
    Directories without an index (leftovers of crashed saves) and anything that is not a
    plain-named directory are skipped."""
    found: List[Tuple[Tuple[float, int, str], str]] = []
    left_out: Dict[str, str] = {}
    if not storage.isdir(output_dir, follow_links=True):
        return [], left_out, set()
    # What the chains need of each directory, from the index read here (absent: gone). The one
    # being committed (`skip`) is not read: unknown, which breaks no chain.
    states: Dict[str, chain.MemberState] = {skip: chain.MemberState(unread="being committed")} if skip else {}
    deltas: List[str] = []
    for name in storage.listdir(output_dir):
        if not is_plain_name(name) or name in (LIST_FILE, skip) or not storage.isdir(storage.join(output_dir, name)):
            continue
        state = _index_state(storage, storage.join(output_dir, name))
        if state.kind == "damaged":
            left_out[name] = state.why
        elif state.kind != "none":  # valid, or written by a newer recsave
            found.append(((commit_time(state.created_at), -1 if state.step is None else state.step, name), name))
            if state.parsed is not None and state.parsed.is_delta:
                deltas.append(name)
        if state.kind != "none":
            states[name] = _member_state(state)
    broken = chain.broken_chains(deltas, lambda name: states.get(name, chain.MemberState(problem=chain.GONE)))
    left_out.update(broken)
    ordered = [name for _, name in sorted(found) if name not in broken]
    return _parents_first(ordered, lambda name: _parent_id(states.get(name))), left_out, set(broken)


def _parent_id(state: Optional[chain.MemberState]) -> Optional[str]:
    return state.parent.id if state is not None and state.parent is not None else None


def _parents_first(ordered: List[str], parent_of: Callable[[str], Optional[str]]) -> List[str]:
    """`ordered` with each delta's listed ancestors that sort after it moved to just before it: a
    delta commits after its parent whatever their `created_at` say (hosts' clocks differ), and
    the latest and rotation's pruning (newest first) follow list order. The delta keeps its place
    (what sorted between it and its parent now follows the chain: after a rewind that is the new
    branch, stamped by the same clock as the delta); the others keep their order."""
    listed = set(ordered)
    out: List[str] = []
    placed: Set[str] = set()
    for name in ordered:
        pending: List[str] = []  # name, then its unplaced ancestors: placed oldest first
        while name in listed and name not in placed and name not in pending:  # (a loop ends it too)
            pending.append(name)
            name = parent_of(name) or ""
        for member in reversed(pending):
            placed.add(member)
            out.append(member)
    return out


def member_state(storage: Storage, output_dir: str, name: str) -> chain.MemberState:
    """What chain.broken_chains needs of checkpoint directory output_dir/name, from its index."""
    return _member_state(_index_state(storage, storage.join(output_dir, name), probe=False))


def member_lookup(storage: Storage, output_dir: str,
                  states: Dict[str, chain.MemberState]) -> Callable[[str], chain.MemberState]:
    """chain.broken_chains' `state_of` over output_dir: member_state of each name read once, kept in
    `states` (which may hold those the caller already has)."""
    def state_of(name: str) -> chain.MemberState:
        if name not in states:
            states[name] = member_state(storage, output_dir, name)
        return states[name]
    return state_of


def _member_state(state: "IndexState") -> chain.MemberState:
    if state.kind == "none":
        return chain.MemberState(problem=chain.GONE)
    if state.kind == "damaged":
        return chain.MemberState(problem=chain.DAMAGED) if state.proven else chain.MemberState(unread=state.why)
    if state.kind == "newer":
        parent, base = state.links
        return chain.MemberState(crc32c=state.crc32c, parent=parent, base=base, unread="written by a newer recsave")
    if state.parsed is None or state.crc32c is None:  # only its seal checked (rotation's question)
        return chain.MemberState(unread="not parsed")
    return chain.state_of_index(state.parsed, state.crc32c)


def commit_time(created_at: str) -> float:
    """Seconds since the epoch of an index's `created_at` (ISO-8601 UTC ending in Z, with or
    without a fraction of any length), -inf when it is not one: parsed, because `...:05Z` and
    `...:05.1Z` do not sort as strings (and datetime.fromisoformat takes only 3 or 6 fraction
    digits before Python 3.11)."""
    match = _UTC_TIME.fullmatch(created_at)
    if match is None:
        return float("-inf")
    try:
        year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
        when = datetime.datetime(year, month, day, hour, minute, second, tzinfo=datetime.timezone.utc)
    except ValueError:  # e.g. month 13
        return float("-inf")
    return when.timestamp() + float(f"0.{match.group(7) or 0}")


_UTC_TIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d+))?Z")


class IndexState(NamedTuple):
    """What a checkpoint directory's index says: `kind` is "none" (no index: a crash leftover),
    "valid", "newer" (written by a newer recsave: intact, only unreadable here) or "damaged"."""
    kind: str
    step: Optional[int] = None
    created_at: str = ""
    why: str = ""  # for "damaged"
    proven: bool = True  # for "damaged": False when the index was not read whole (over max_index_bytes)
    parsed: Optional[Index] = None  # for "valid": the index, when it was parsed (not only its seal checked)
    crc32c: Optional[int] = None  # "valid", "newer": the CRC32C of the index's bytes (a delta records its parent's)
    links: Tuple[Optional[Parent], Optional[str]] = (None, None)  # "newer": the parent and base it names


# An index opens with its magic and format_version (docs/FORMAT.md section 3), a delta's kind next:
# enough to tell a newer writer's.
_VERSION_PREFIX = re.compile(
    rb'\{(?:"magic":"recsave\.index",)?"format_version":([0-9]{1,9})(?:,"kind":"([a-z_]{1,32})"(?=[,}]))?[,}]')


def _reads_as_valid(data: bytes) -> bool:
    """Whether the leading format_version (and kind) of index bytes are ones this recsave reads,
    told without decoding them. A kind not right after the version (no recsave writes that, a
    newer one might) or not matched whole leaves the answer to a parse: False."""
    head = _VERSION_PREFIX.match(data)
    if head is None:
        return False
    kind = head.group(2)
    if kind is None and b'"kind"' in data:  # a kind elsewhere: let the parser judge it
        return False
    return readable_version(int(head.group(1)), (kind or b"full").decode())


def _index_state(storage: Storage, ckpt_dir: str, intact_is_valid: bool = False, probe: bool = True) -> IndexState:
    """The IndexState of ckpt_dir. An index is renamed into place whole, so one that exists but
    does not validate is damage, never a crash leftover. With `intact_is_valid` (what rotation asks:
    may this go?) an index whose seal matches its bytes, of a version this recsave reads, is
    "valid" without being parsed (step and created_at then unknown): the seal proves the bytes
    are the ones written, and parsing a large index costs seconds. Without `probe` the index is
    read at once, not looked for first (one request instead of three where most are there)."""
    path = storage.join(ckpt_dir, INDEX_FILE)
    if probe and not storage.exists(path):
        return IndexState("none")
    if probe and storage.isdir(path, follow_links=True):
        return IndexState("damaged", why=f"{path} is a directory")
    try:
        data = index_mod.read_bytes(storage, path)  # through a repair's ReadOnce, when it installed one
        if intact_is_valid and seal.intact(data) and _reads_as_valid(data):
            return IndexState("valid")
        index = index_mod.parse(data, path)
        return IndexState("valid", index.step, index.created_at, parsed=index, crc32c=int(_C.crc32c(data)))
    except FormatVersionError as exc:
        newer = _newer_order(data)
        if newer is None:
            return IndexState("damaged", why=str(exc))
        return IndexState("newer", *newer, crc32c=int(_C.crc32c(data)), links=chain.raw_links(data))
    except CheckpointNotFoundError:  # removed meanwhile (or, without `probe`, never there)
        if not probe and storage.isdir(path, follow_links=True):
            return IndexState("damaged", why=f"{path} is a directory")
        return IndexState("none")
    except CorruptCheckpointError as exc:
        return IndexState("damaged", why=str(exc), proven=not isinstance(exc, OverLimitError))


def holds_valid_index(storage: Storage, output_dir: str, name: str) -> bool:
    """Whether checkpoint directory output_dir/name holds an index that validates (or is sealed
    intact, as rotation asks: a large index is not parsed) or was written by a newer recsave."""
    return _index_state(storage, storage.join(output_dir, name), intact_is_valid=True).kind in ("valid", "newer")


def damaged(storage: Storage, output_dir: str, name: str) -> Optional[str]:
    """Why checkpoint directory output_dir/name holds a damaged index (one that exists but does not
    validate), else None. Such a directory is never deleted by rotation or gc (section 1)."""
    state = _index_state(storage, storage.join(output_dir, name))
    return state.why if state.kind == "damaged" else None


def proven_damaged(storage: Storage, output_dir: str, name: str) -> Optional[str]:
    """damaged(), where the index's bytes prove it (read whole, they do not parse or validate),
    else None: one over the knob max_index_bytes may be intact (a job that raised the knob)."""
    state = _index_state(storage, storage.join(output_dir, name))
    return state.why if state.kind == "damaged" and state.proven else None


def _newer_order(data: bytes) -> Optional[Tuple[Optional[int], str]]:
    """(step, created_at) of an index written by a newer recsave, else None."""
    try:
        index = json.loads(data.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        return None
    if not is_newer_index(index):
        return None
    step, created = index.get("step"), index.get("created_at")
    return (step if type(step) is int else None), (created if isinstance(created, str) else "")


# Files a recsave checkpoint directory may hold (temporary names of interrupted writes included).
_OWN_FILE = re.compile(r"(index|model\.pt|extra\.pt|io_state_count|io_state_\d+\.pt|"
                       r"sparse-\d+-\d+\.safetensors)(\.tmp-[0-9-]+)?\Z")
# Of those, the ones only recsave writes: every save writes one before its model.pt (the shards and
# io states of each rank come first), while a lone model.pt / extra.pt may be anyone's torch.save.
_RECSAVE_ONLY = re.compile(r"index|io_state_count|io_state_\d+\.pt|sparse-\d+-\d+\.safetensors|.*\.tmp-[0-9-]+\Z")


def looks_like_checkpoint(storage: Storage, output_dir: str, name: str, *, own_id: bool = False) -> bool:
    """Whether output_dir/name is a recsave checkpoint directory (committed or a crash leftover):
    a valid id holding only files recsave writes, one of them a name only recsave writes (a
    shard, an io state, the index, a temporary name). Anything else — other files, a folder of
    torch.save files named model.pt, empty directories — is left alone.

    `own_id`: for a writer about to write checkpoint `name` itself, which replaces a leftover of
    recsave's names alone (a deletion killed part way may leave only model.pt / extra.pt, and a
    save of the id must not be refused for it); a scan of the output dir (gc) passes False."""
    if not is_plain_name(name) or name == LIST_FILE:
        return False
    path = storage.join(output_dir, name)
    if not storage.isdir(path):
        return False
    files = storage.listdir(path)
    return bool(files) and all(_OWN_FILE.match(f) for f in files) \
        and (own_id or any(_RECSAVE_ONLY.match(f) for f in files))


# Names of a checkpoint's files that anyone's may have too (a torch.save export's model.pt).
_COMMON_NAMES = ("index", "model.pt", "extra.pt")


def writes_there(storage: Storage, output_dir: str, checkpoints: Collection[str] = ()
                 ) -> Callable[[Sequence[str]], List[str]]:
    """Of paths relative to output_dir (e.g. its unfinished uploads), those recsave's writers
    make: a checkpoint's file `<id>/<file>`, or the list's or the writer lock's. A name only
    recsave writes (a shard, an io state) counts as it is; `index`, `model.pt` and `extra.pt`
    only in a directory that looks_like_checkpoint, is one of `checkpoints` (e.g. those gc just
    removed as leftovers), or has a path of a name only recsave writes among those given. What gc
    may abort an unfinished upload of: not another program's file there (a model exported next to
    the checkpoints), nor one of an output dir nested below."""
    def split(relative: str) -> Optional[Tuple[str, str]]:
        parts = relative.split("/")
        if len(parts) != 2 or not is_plain_name(parts[0]) or not _OWN_FILE.match(parts[1]):
            return None
        return parts[0], parts[1]

    def ours(paths: Sequence[str]) -> List[str]:
        named = [(p, split(p)) for p in paths]
        beside = {s[0] for _, s in named if s is not None and s[1] not in _COMMON_NAMES}
        checkpoint_like: Dict[str, bool] = {name: True for name in [*checkpoints, *beside]}
        out = []
        for path, s in named:
            if s is None:
                if "/" not in path and (path in (LIST_FILE, LOCK_FILE) or _OUTPUT_DIR_TEMP.match(path)):
                    out.append(path)
                continue
            if s[0] not in checkpoint_like:
                checkpoint_like[s[0]] = looks_like_checkpoint(storage, output_dir, s[0])
            if s[1] not in _COMMON_NAMES or checkpoint_like[s[0]]:
                out.append(path)
        return out
    return ours


def holds_foreign_files(storage: Storage, output_dir: str, name: str, *, own_dir: bool = True) -> bool:
    """Whether output_dir/name (which exists) is a file or holds files recsave did not write: what
    a writer of checkpoint `name` (a save, a compaction) must not remove. Not when it is an empty
    directory or holds recsave's names alone (a leftover it replaces). `own_dir`: output_dir is
    the writer's own (a Saver's), where a lone model.pt / extra.pt is a leftover of a deletion cut
    short (looks_like_checkpoint's own_id); a tool writing into a directory it was pointed at
    (compact, convert, export-serving) passes False: there a lone model.pt may be anyone's."""
    path = storage.join(output_dir, name)
    if not storage.isdir(path):
        return True
    return bool(storage.listdir(path)) and not looks_like_checkpoint(storage, output_dir, name, own_id=own_dir)


def newer_format_version(storage: Storage, output_dir: str, name: str) -> Optional[int]:
    """The format_version of checkpoint output_dir/name when a newer recsave wrote it (higher than
    the one this recsave reads), else None (also when it has no readable index). Such a checkpoint
    is intact, only unreadable here: it is never deleted, replaced or treated as damaged."""
    path = storage.join(output_dir, name, INDEX_FILE)
    try:
        if not storage.exists(path):
            return None
        data = storage.read_bytes(path, knobs.get("max_index_bytes"))
        if _reads_as_valid(data):  # the usual answer, without decoding a large index
            return None
        index = json.loads(data.decode("utf-8"))
    except (RecsaveError, OSError, ValueError):  # unreadable: not newer
        return None
    return index["format_version"] if is_newer_index(index) else None


def collect_garbage(storage: Storage, output_dir: str, keep: List[str],
                    parents_of: Optional[Callable[[str], Iterable[str]]] = None,
                    remove: Optional[Callable[[str], None]] = None, pruned: Collection[str] = (), *,
                    remove_broken: bool = False, kept_broken: Optional[Dict[str, str]] = None) -> List[str]:
    """Removes checkpoint directories of output_dir not in `keep` (pruned ones and leftovers of
    crashed saves) through `remove` (default storage.remove_tree); returns their names. Other
    files and directories, checkpoints written by a newer recsave (newer_format_version) and
    directories holding a damaged index (damaged: the user decides what to do with them, e.g.
    after `recsave repair` named them) are never touched, nor are the chain members a kept delta
    checkpoint needs (format/chain.py; `parents_of` as in chain.needed_by). A PRUNED_DIR left by a
    process that died while deleting goes first (named among the removed). The caller holds the
    writer lock.

    `pruned`: the ids the list held that retention dropped, in list order (a set: no order), which
    go newest first. Their indexes validated when they
    were listed, so one sealed intact goes without a parse (a large index costs seconds); any
    other directory's index is parsed in full first: sealed is not valid (an index a newer
    writer or a faulty one wrote, left out of a rebuilt list as damaged).

    An unlisted delta (not in `pruned`) whose own index validates but whose chain does not resolve
    (a member gone, damaged or saved again: what `recsave repair` leaves a delta out for; here
    also one only unreadable here, chain.broken_chains' `unknown_breaks`) stays,
    unless `remove_broken`: it is not damaged itself, and a member put back (a damaged index
    replaced from a backup) makes it loadable again. `kept_broken` (a dict) receives those kept,
    id -> why. Every decision is made before the first removal, so that removing one directory
    never makes another look broken."""
    remove = remove or storage.remove_tree
    names = storage.listdir(output_dir)
    removed = []
    if PRUNED_DIR in names and storage.isdir(storage.join(output_dir, PRUNED_DIR)):
        storage.remove_tree(storage.join(output_dir, PRUNED_DIR))
        removed.append(PRUNED_DIR)
    candidates = [n for n in names if n not in keep and looks_like_checkpoint(storage, output_dir, n)]
    if not candidates:
        return removed
    needed = chain.needed_by(storage, output_dir, keep, parents_of)
    doomed = []
    states: Dict[str, chain.MemberState] = {}  # chain members read once across the candidates
    state_of = member_lookup(storage, output_dir, states)
    for name in candidates:
        if name in needed:
            continue
        state = _index_state(storage, storage.join(output_dir, name), intact_is_valid=name in pruned)
        if state.kind not in ("none", "valid"):  # a damaged or newer index stays
            continue
        why = None
        if not remove_broken and name not in pruned and state.parsed is not None and state.parsed.is_delta:
            states[name] = _member_state(state)
            why = chain.broken_chains([name], state_of, unknown_breaks=True).get(name)
        if why is not None:
            if kept_broken is not None:
                kept_broken[name] = why
            continue
        doomed.append(name)
    # The pruned newest first (`pruned` in list order: commit order): a delta commits after its
    # parent, so a process killed part way never leaves a delta whose parent went first (an
    # unlisted broken delta, which gc would keep); leftovers of crashed saves before them.
    newest = {name: k for k, name in enumerate(pruned)} if isinstance(pruned, Sequence) else {}
    doomed.sort(key=lambda name: -newest.get(name, len(newest)))
    for name in doomed:
        remove(storage.join(output_dir, name))
        removed.append(name)
    return removed


def writers_files_in(storage: Storage, output_dir: str) -> bool:
    """Whether output_dir holds the `checkpoint` list or a writer lock (or a temporary name of
    either): a dir some rank 0 writes into. A rank other than 0 whose own output dir holds
    neither has a dir of its own (per-rank local disks, docs/API.md), where only it writes."""
    return any(n in (LIST_FILE, LOCK_FILE) or _OUTPUT_DIR_TEMP.match(n) for n in storage.listdir(output_dir))


def remove_rank_copies(storage: Storage, output_dir: str, names: Iterable[str],
                       remove: Optional[Callable[[str], None]] = None) -> List[str]:
    """On a rank other than 0 with an output dir of its own (writers_files_in is False there; the
    caller checks): removes, through `remove` (default storage.remove_tree), its directories of
    `names`, the checkpoints rank 0's rotation just removed from rank 0's dir; returns their
    names. As collect_garbage would: only a directory that looks_like_checkpoint (recsave's
    files alone) whose index is absent (this rank's shards and io state) or valid; one holding
    a damaged index, or written by a newer recsave, stays."""
    remove = remove or storage.remove_tree
    removed = []
    for name in names:
        if looks_like_checkpoint(storage, output_dir, name) and \
                _index_state(storage, storage.join(output_dir, name)).kind in ("none", "valid"):
            remove(storage.join(output_dir, name))
            removed.append(name)
    return removed


# Temporary names recsave's writers leave when a process dies mid-write: Storage.open_write's
# ``<file>.tmp-<pid>-<thread>`` (the `checkpoint` list, the writer lock's renewal, index, .pt files) and the
# engine's ``<shard>.tmp-<pid>-<n>``.
_OUTPUT_DIR_TEMP = re.compile(rf"({LIST_FILE}|{re.escape(LOCK_FILE)})\.tmp-[0-9-]+\Z")
_TEMP_SUFFIX = re.compile(r"\.tmp-[0-9-]+\Z")


def remove_temp_files(storage: Storage, output_dir: str) -> List[str]:
    """Removes the temporary files of interrupted writes from output_dir and from its checkpoint
    directories (looks_like_checkpoint: only recsave's files inside); returns their paths relative
    to output_dir. Committed files, other files and checkpoints written by a newer recsave are never
    touched. The caller must hold the writer lock: a save in progress has such files too."""
    removed = []
    for name in storage.listdir(output_dir):
        if _OUTPUT_DIR_TEMP.match(name) and not storage.isdir(storage.join(output_dir, name)):
            storage.remove_file(storage.join(output_dir, name))
            removed.append(name)
        elif looks_like_checkpoint(storage, output_dir, name) \
                and newer_format_version(storage, output_dir, name) is None:
            ckpt_dir = storage.join(output_dir, name)
            for fname in storage.listdir(ckpt_dir):
                if _TEMP_SUFFIX.search(fname) and _OWN_FILE.match(fname):
                    storage.remove_file(storage.join(ckpt_dir, fname))
                    removed.append(f"{name}/{fname}")
    return sorted(removed)
