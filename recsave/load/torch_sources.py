"""PyTorch files as model-bank sources: a ``torch.save`` file of a state dict, or a
torch.distributed.checkpoint (DCP) directory (docs/API.md, "Load / model-bank config").

Both hold named tensors; this module reads them as a recsave source (the questions
load/sources.py's sources answer). The names become tables and dense entries:

- a 2-D ``<name>.weight`` tensor ``[N, dim]`` (nn.Embedding, EmbeddingBag, TorchRec, and what
  ``recsave convert --to torch`` writes) is table ``<name>``, with ids ``<name>.ids`` (1-D int64,
  N of them) when present, else 0..N-1; ``<name>.<slot>`` tensors of the same shape are its slots
  (a slot name with '.' only beside ids: _slot_name_ok);
  with a ``<name>.bias`` and no ids beside it, it is an nn.Linear's: not a table;
- to_dcp_state_dict's form (``<key>.ids``, ``<key>.embedding``, ``<key>.slot.<slot>``) is table
  ``<module path of key>`` (``emb.user.table`` -> ``emb.user``);
- in both forms, beside ``<base>.ids``, int64 ``<base>.last_step`` / ``<base>.count`` of N values
  are the table's row metadata and a 0-d int64 ``<base>.step`` its table step (``<base>``:
  ``<name>`` or ``<key>``);
- the count entries `convert` writes (STEP_COUNT_PREFIX, GLOBAL_STEP_KEY) are the sparse
  optimizer's step counts and the source's (global) step, not dense entries;
- any other 2-D floating tensor is also a table named by its key (ids 0..N-1);
- every tensor is also a dense entry under its key, so an nn.Embedding model loads its weight.
Nested dicts (``{"model": state_dict}``), lists and int keys are flattened with '.' (use ``oname``
to map the prefix); values that are not tensors are listed in ``not_tensors``, never loaded.
"""
from __future__ import annotations

import abc
import contextlib
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from recsave.errors import ConfigError, CorruptCheckpointError
from recsave.load.config import Contents, TableInfo
from recsave.load.contents import dtype_name
from recsave.load.opened import OpenedFiles
from recsave.storage import Storage
from recsave.tables import partition, tablestate
from recsave.tables.rows import META_COLUMNS

DCP_METADATA = ".metadata"
ACCEPTED = ("a recsave checkpoint directory, an output dir, a Parquet export or file, a torch.save "
            "file of a state dict (loadable with weights_only=True), or a torch.distributed.checkpoint "
            "directory (with a .metadata file)")
Meta = Dict[str, Tuple[Tuple[int, ...], torch.dtype]]  # key -> (shape, dtype)
_RESERVED_SLOTS = ("id", "ids", "embedding", "weight")


@dataclass
class TableKeys:
    """Where a table's columns are in the source: the embedding key, the ids key (None: 0..N-1)
    and slot -> key."""
    weight: str
    ids: Optional[str]
    rows: int
    dim: int
    dtype: torch.dtype
    slots: Dict[str, str] = field(default_factory=dict)
    meta: Dict[str, str] = field(default_factory=dict)  # row metadata column (last_step, count) -> key
    step: Optional[str] = None  # key of the table step (a 0-d int64 tensor)

    def keys(self) -> List[str]:
        """Every key of the source this table reads."""
        return [k for k in (self.weight, self.ids, *self.slots.values(), *self.meta.values(), self.step) if k]


def _is_table_weight(shape: Tuple[int, ...], dtype: torch.dtype) -> bool:
    return len(shape) == 2 and dtype.is_floating_point and shape[1] > 0


def tables_of(path: str, meta: Meta) -> Dict[str, TableKeys]:
    """The tables the named tensors form (rules in the module docstring); ConfigError when a
    table's ids tensor is not 1-D int64 with one id per row."""
    tables: Dict[str, TableKeys] = {}
    used: set = set()
    for key, (shape, dtype) in sorted(meta.items()):
        form = _table_form(key, meta) if _is_table_weight(shape, dtype) else None
        if form is None:
            continue
        base, name, slot_prefix = form
        ids_key = f"{base}.ids"
        if ids_key in meta:
            ids_shape, ids_dtype = meta[ids_key]
            if ids_dtype != torch.int64 or tuple(ids_shape) != (shape[0],):
                raise ConfigError(f"{path}: {ids_key} must be a 1-D int64 tensor of {shape[0]} ids (one per "
                                  f"row of {key}), got {ids_dtype} {list(ids_shape)}; fix or drop it",
                                  path=path, key=ids_key)
            used.add(ids_key)
        slots = {}
        for other, (oshape, odtype) in meta.items():
            slot = other[len(base) + len(slot_prefix):] if other.startswith(base + slot_prefix) else ""
            if (slot and "@" not in slot and slot not in _RESERVED_SLOTS and tuple(oshape) == tuple(shape)
                    and odtype.is_floating_point and _slot_name_ok(slot, other, ids_key in meta, meta)):
                slots[slot] = other
                used.add(other)
        # Row metadata and the step only beside ids (what recsave writes): a plain nn.Embedding's
        # own buffer named `step` or `count` stays a dense entry.
        row_meta = {m: k for m in META_COLUMNS if ids_key in meta and (k := f"{base}.{m}") in meta
                    and meta[k][1] == torch.int64 and tuple(meta[k][0]) in ((shape[0],), (shape[0], 1))}
        step = f"{base}.step" if ids_key in meta and meta.get(f"{base}.step", ((0,), None)) == ((), torch.int64) \
            else None
        tables[name] = TableKeys(key, ids_key if ids_key in meta else None, shape[0], shape[1], dtype, slots,
                                 row_meta, step)
        used.update([key, *row_meta.values(), *([step] if step else [])])
    for key, (shape, dtype) in sorted(meta.items()):  # bare [N, dim] tensors: {"user": weight}
        if key not in used and key not in tables and "@" not in key and _is_table_weight(shape, dtype) \
                and not key.endswith((".weight", ".embedding")):
            tables[key] = TableKeys(key, None, shape[0], shape[1], dtype)
    return tables


def _table_form(key: str, meta: Meta) -> Optional[Tuple[str, str, str]]:
    """(base, table name, slot prefix) of a table's embedding key, else None (module docstring)."""
    if key.endswith(".weight"):
        base, name, slot_prefix = key[: -len(".weight")], key[: -len(".weight")], "."
    elif key.endswith(".embedding") and f"{key[: -len('.embedding')]}.ids" in meta:
        base = key[: -len(".embedding")]
        name, slot_prefix = tablestate.module_path(base), ".slot."
    else:
        return None
    if not name or "@" in name or (f"{base}.bias" in meta and f"{base}.ids" not in meta):  # nn.Linear
        return None
    return base, name, slot_prefix


def _slot_name_ok(slot: str, key: str, has_ids: bool, meta: Meta) -> bool:
    """Whether `slot` (of `key`) may name a slot. A slot name with '.' is taken only beside
    `<base>.ids` (recsave's own layout: HashTable.add_slot accepts such names, and convert writes
    them as `<name>.<slot>`), and only when every tensor beside `key` under its parent is one of
    the same shape and kind (another such slot) and its last part names no table column:
    `<name>.<sub>.weight` (beside a `.bias` or `.ids`, or alone) is a submodule's or another
    table's tensor, not a slot."""
    if "." not in slot:
        return True
    parent, last = key.rsplit(".", 1)
    shape = meta[key][0]
    return has_ids and last not in _RESERVED_SLOTS and all(
        m[0] == shape and m[1].is_floating_point for k, m in meta.items() if k.startswith(parent + "."))


class _LazyDense(Mapping):
    """The dense entries of a source, read when looked up: the first lookup of a tensor that is no
    table's reads all such tensors at once (they are small); a table's tensors are read one at a
    time (a model with nn.Embedding loads one as dense)."""

    def __init__(self, src: "TorchStateSource"):
        self._src = src
        in_tables = {k for t in src.tables.values() for k in t.keys()}
        self._small = [k for k in src.meta if k not in in_tables]
        self._cache: Optional[Dict[str, torch.Tensor]] = None

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._src.meta:
            raise KeyError(key)
        if key not in self._small:
            return self._src.read_tensors([key])[key]
        if self._cache is None:
            self._cache = self._src.read_tensors(self._small)
        return self._cache[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._src.meta)

    def __len__(self) -> int:
        return len(self._src.meta)


class TorchStateSource(abc.ABC):
    """Named tensors as a source; subclasses say how to list and read them."""

    kind = "torch"
    index = None  # no recsave index
    # {key: type name} of the entries that are not tensors (never loaded or converted; `convert`
    # warns of them). Set by each subclass.
    not_tensors: Dict[str, str]
    io_state_count = 1
    num_buckets = partition.DEFAULT_NUM_BUCKETS

    def __init__(self, path: str, meta: Meta, version: str):
        self.ckpt_dir = path
        self.meta = meta
        self.version = version
        self.tables = tables_of(path, meta)
        aliases: Dict[str, Tuple[str, ...]] = {}
        for name, t in self.tables.items():
            keys = tuple(k for k in t.keys() if k not in t.slots.values())
            aliases[name] = keys
            for k in keys:
                aliases[k] = aliases.get(k, ()) + (name,)
            for slot, k in t.slots.items():
                aliases[f"{name}@{slot}"] = (k,)
                aliases[k] = aliases.get(k, ()) + (name, f"{name}@{slot}")
        self.contents = Contents(
            tables={n: TableInfo(t.dim, dtype_name(t.dtype), tuple(sorted(t.slots)), t.rows,
                                 {s: dtype_name(meta[k][1]) for s, k in t.slots.items()})
                    for n, t in self.tables.items()},
            dense={k: (tuple(s), dtype_name(d)) for k, (s, d) in meta.items()},
            aliases=aliases)

    @property
    def path(self) -> str:
        return self.ckpt_dir

    @property
    def step(self) -> Optional[int]:
        """The global step the file records where `convert` writes a CheckpointManager's
        (GLOBAL_STEP_KEY: an int, or a 0-d integer tensor); None when it records none."""
        return None

    @abc.abstractmethod
    def read_tensors(self, keys: Sequence[str]) -> Dict[str, torch.Tensor]:
        """The tensors of `keys` as stored (each subclass reads its own kind of file)."""

    def optimizer_steps(self) -> Optional[Dict[str, int]]:
        """The sparse optimizer's step count per table where the file records them, as recsave's
        `convert` writes them (`STEP_COUNT_PREFIX<table>`: an int, or a 0-d integer tensor);
        None when it records none."""
        return None

    def _column_key(self, table: str, column: str) -> str:
        t = self.tables[table]
        return t.weight if column == "embedding" else t.meta[column] if column in t.meta else t.slots[column]

    def meta_columns(self, table: str) -> List[str]:
        """The row metadata columns (last_step, count) the source holds for `table`."""
        return sorted(self.tables[table].meta)

    def table_step(self, table: str) -> Optional[int]:
        """The table's `<base>.step`, when the source holds one."""
        key = self.tables[table].step
        return int(self.read_tensors([key])[key]) if key is not None else None

    def table_cost(self, table: str, columns: Sequence[str], rank: int, world: int) -> Tuple[int, Dict[str, int]]:
        """Rows (about 1/world of them with several ranks: the hash spreads ids evenly) and bytes
        per column; every rank reads whole tensors and keeps the ids it owns."""
        t = self.tables[table]
        cost = {"id": t.rows * 8 if t.ids else 0}
        for c in columns:
            shape, dtype = self.meta[self._column_key(table, c)]
            cost[c] = int(torch.Size(shape).numel()) * dtype.itemsize
        return (t.rows // world if world > 1 else t.rows), cost

    def read_table(self, table: str, columns: Sequence[str], rank: int, world: int,
                   concurrency: int = 1) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """(ids, {column: [n, dim] values}) of the rows whose ids rank `rank` of `world` owns."""
        t = self.tables[table]
        keys = {c: self._column_key(table, c) for c in columns}
        data = self.read_tensors(list(keys.values()) + ([t.ids] if t.ids else []))
        ids = data[t.ids] if t.ids else torch.arange(t.rows, dtype=torch.int64)
        values = {c: data[k].reshape(-1, 1) if c in t.meta else data[k] for c, k in keys.items()}  # as a checkpoint's
        if world > 1:
            keep = partition.owner_of(ids, world, self.num_buckets) == rank
            ids = ids[keep]
            values = {c: v[keep] for c, v in values.items()}
        return ids, values

    def read_pt(self, fname: str) -> Any:
        """model.pt's equivalent: the dense entries, each read when looked up."""
        if fname != "model.pt":
            raise ConfigError(f"{self.ckpt_dir}: a PyTorch source holds tensors only (no {fname})",
                              path=self.ckpt_dir)
        return _LazyDense(self)

    def pt_size(self, fname: str) -> int:
        return 0


class TorchSaveSource(TorchStateSource):
    """A torch.save file of a state dict (nested dicts flattened), read with weights_only=True,
    memory-mapped when the file allows it."""

    kind = "torch_save"

    def __init__(self, storage: Storage, path: str):
        self._opened = OpenedFiles(storage)
        ukey = self._opened.record(path)  # before the read: a change during it shows at the first check
        obj, mapped = load_torch_file(path)
        state, others = _flatten(obj, path)
        items = [*state.items(), *others.items()]
        self._steps, self._step = _step_counts(items), _global_step(items)
        read = _read_keys(items)
        # Entries read as counts are no dense entries (a load would report them unexpected), nor
        # values left out.
        self.not_tensors = {k: type(v).__name__ for k, v in sorted(others.items()) if k not in read}
        state = {k: v for k, v in state.items() if k not in read}
        meta = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        # A mapped file is mapped again for each read: the pages a read touches are released with
        # the tensors it returns, instead of the whole file staying resident. A file that could not
        # be mapped is in memory already: keep it.
        self._state: Optional[Dict[str, torch.Tensor]] = None if mapped else state
        del obj, state
        super().__init__(path, meta, f"{path}@{ukey}")

    def read_tensors(self, keys: Sequence[str]) -> Dict[str, torch.Tensor]:
        state = self._state
        if state is None:
            state = _flatten(load_torch_file(self.ckpt_dir)[0], self.ckpt_dir)[0]
            # Read again by path: a file replaced or rewritten since the open (a job saving it
            # anew) would give this table the new file's rows and the others the old one's.
            self._opened.check()
        missing = [k for k in keys if k not in state]
        if missing:
            raise ConfigError(f"{self.ckpt_dir}: {missing[:5]} are gone; the file changed since it was "
                              f"opened: plan the load again", path=self.ckpt_dir, key=missing[0])
        return {k: state[k] for k in keys}

    def optimizer_steps(self) -> Optional[Dict[str, int]]:
        return self._steps

    @property
    def step(self) -> Optional[int]:
        return self._step


class DcpSource(TorchStateSource):
    """A torch.distributed.checkpoint directory, read in one process (no process group needed);
    each read loads only the tensors asked for."""

    kind = "dcp"

    def __init__(self, storage: Storage, path: str):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        local = storage.local_path(path)
        if local is None:  # DCP's FileSystemReader reads local files only
            raise ConfigError(f"{path}: a DCP checkpoint is read from local disk (a path or file://); copy it "
                              f"to a local directory first", path=path)
        self.local_dir = local
        try:
            md = FileSystemReader(local).read_metadata()
        except Exception as exc:  # a damaged .metadata: say what it is
            raise ConfigError(f"{path}: {DCP_METADATA} cannot be read as DCP metadata ({type(exc).__name__}: "
                              f"{exc}); accepted sources: {ACCEPTED}", path=path) from exc
        meta: Meta = {k: (tuple(m.size), m.properties.dtype) for k, m in md.state_dict_metadata.items()
                      if isinstance(m, TensorStorageMetadata)}
        # Step counts and the global step are small objects beside the tensors (or 0-d tensors):
        # read once, when asked for.
        self._step_keys = [k for k in md.state_dict_metadata if (k.startswith(STEP_COUNT_PREFIX)
                                                                 or k == GLOBAL_STEP_KEY)
                           and (k not in meta or meta[k][0] == ())]
        self._step_values: Optional[List[Tuple[str, Any]]] = None
        # 0-d count tensors are no dense entries (a load would report them unexpected).
        self._count_meta = {k: meta.pop(k) for k in self._step_keys if k in meta}
        self.not_tensors = {k: "object" for k in sorted(md.state_dict_metadata)
                            if k not in meta and k not in self._step_keys}
        self._opened = OpenedFiles(storage)
        ukey = self._opened.record(storage.join(path, DCP_METADATA))
        # and its data files: a save writes them before .metadata, so a load caught between the two
        # would read new rows under the old .metadata's ukey (one missing is damage, named by the read)
        data = sorted({str(s.relative_path) for s in (getattr(md, "storage_data", None) or {}).values()
                       if getattr(s, "relative_path", None)})
        for name in data:
            self._opened.record(storage.join(path, name), may_be_missing=True)
        super().__init__(path, meta, f"{path}@{ukey}")

    def optimizer_steps(self) -> Optional[Dict[str, int]]:
        return _step_counts(self._read_steps())

    @property
    def step(self) -> Optional[int]:
        return _global_step(self._read_steps())

    def _read_steps(self) -> List[Tuple[str, Any]]:
        """(key, value) of the step count and global step entries, read on first use; [] when
        there are none, or they cannot be read: unreadable counts cost the counts (the load
        warns), not the load."""
        if self._step_values is None:
            self._step_values = []
            if self._step_keys:
                out: Dict[str, Any] = {k: torch.empty((), dtype=self._count_meta[k][1]) if k in self._count_meta
                                       else None for k in self._step_keys}
                planner = _weights_only_planner()()
                with contextlib.suppress(CorruptCheckpointError):
                    self._load(out, planner)
                    self._step_values = [*((k, v) for k, v in out.items() if k in self._count_meta),
                                         *planner.objects.items()]
        return self._step_values

    def read_tensors(self, keys: Sequence[str]) -> Dict[str, torch.Tensor]:
        out = {k: torch.empty(self.meta[k][0], dtype=self.meta[k][1]) for k in dict.fromkeys(keys)}
        self._load(out)
        return out

    def _load(self, out: Dict[str, Any], planner: Any = None) -> None:
        """dcp.load of `out`'s keys in this process; CorruptCheckpointError when it fails."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent here
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            try:
                dcp.load(out, storage_reader=dcp.FileSystemReader(self.local_dir), planner=planner, no_dist=True)
            except (Exception, CheckpointException) as exc:  # (a BaseException) wraps e.g. a data file gone
                raise CorruptCheckpointError(f"{self.ckpt_dir}: reading the DCP checkpoint failed "
                                             f"({' '.join(str(exc).split())[:300]}); it is incomplete or "
                                             f"damaged", path=self.ckpt_dir) from exc
        # A DCP directory saved again since the open (data files, then .metadata) mixes versions.
        self._opened.check()


@functools.lru_cache(maxsize=None)
def _weights_only_planner() -> Any:
    """The class of a DCP load planner whose non-tensor entries are unpickled with
    weights_only=True into `objects` (the default planner's torch.load runs any pickle, and a DCP
    directory is a file from elsewhere). Made on first use: DCP is imported late."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__()
            self.objects: Dict[str, Any] = {}

        def load_bytes(self, read_item: Any, value: Any) -> None:
            self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
    return WeightsOnlyPlanner


# Where recsave's `convert` keeps the sparse optimizer's step counts in a torch.save / DCP state
# dict: the extra `sparse_optim`'s key path `steps.<table>` (tools/convert.py, EXTRA_PREFIX); and
# a CheckpointManager's global step: its extra `global_step`'s key `global_step` (manager.py).
STEP_COUNT_PREFIX = "_recsave.extra.sparse_optim.steps."
GLOBAL_STEP_KEY = "_recsave.extra.global_step.global_step"


def _count(value: Any) -> Optional[int]:
    """`value` as a count: an int in [0, 2**63), or a 0-d integer tensor of one; else None."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value)
    return value if type(value) is int and 0 <= value < 1 << 63 else None


def _step_counts(items: Any) -> Optional[Dict[str, int]]:
    """{table: count} of the STEP_COUNT_PREFIX entries among (key, value) `items` that hold a
    count (_count); None when there are none."""
    counts = {key[len(STEP_COUNT_PREFIX):]: c for key, value in items
              if isinstance(key, str) and key.startswith(STEP_COUNT_PREFIX) and (c := _count(value)) is not None}
    return counts or None


def _global_step(items: Any) -> Optional[int]:
    """The count (_count) of the GLOBAL_STEP_KEY entry among (key, value) `items`; None without one."""
    return next((c for key, value in items if key == GLOBAL_STEP_KEY and (c := _count(value)) is not None), None)


def _read_keys(items: Any) -> Set[str]:
    """The keys of (key, value) `items` read as counts (_step_counts, _global_step)."""
    return {key for key, value in items if isinstance(key, str) and _count(value) is not None
            and (key.startswith(STEP_COUNT_PREFIX) or key == GLOBAL_STEP_KEY)}


def load_torch_file(path: str) -> Tuple[Any, bool]:
    """(torch.load(path, weights_only=True), whether it is memory-mapped: where the file allows);
    ConfigError naming the path and the accepted kinds when it is no such file."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True), True
        except RuntimeError as exc:
            if "mmap" not in str(exc):  # a legacy (non-zip) file cannot be mapped: read it
                raise
            return torch.load(path, map_location="cpu", weights_only=True), False
    except OSError:  # the file could not be read: an I/O error, not its content
        raise
    except Exception as exc:  # torch's unpickler also raises KeyError / IndexError on other files
        raise ConfigError(f"{path}: not a loadable source ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); "
                          f"accepted: {ACCEPTED}", path=path) from exc


def _flatten(obj: Any, path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """(tensors, other values) of a torch.save'd state dict under dotted keys: nested dicts joined
    with '.', as are list / tuple positions and int keys (a torch optimizer's `state`: {0: ...}),
    as DCP names them. ConfigError when the file holds no dict, or two entries reach one key."""
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{path}: holds a {type(obj).__name__}, not a state dict (a dict of named tensors, "
                          f"as model.state_dict() gives); accepted: {ACCEPTED}", path=path)
    tensors: Dict[str, torch.Tensor] = {}
    others: Dict[str, Any] = {}

    def put(key: str, value: Any, named: bool = True) -> None:
        tensor = named and isinstance(value, torch.Tensor)
        if key in tensors or (key in others and tensor):
            # A tensor would be loaded under a key that two entries reach: which one is arbitrary.
            raise ConfigError(f"{path}: two entries flatten to the key {key!r} (a dotted key beside a nested "
                              f"one: nested dicts are joined with '.'); rename one in the file", path=path, key=key)
        if key in others:  # two values that are never loaded (hyper-parameters, metadata): both reported
            key = f"{key} (again)"
            while key in others:
                key += " (again)"
        (tensors if tensor else others)[key] = value

    def walk(value: Any, key: str) -> None:
        if isinstance(value, Mapping):
            items: Iterator[Tuple[Any, Any]] = iter(value.items())
        elif isinstance(value, (list, tuple)):
            items = iter(enumerate(value))
        else:
            put(key, value)
            return
        for k, v in items:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                put(f"{key}.{k!r}" if key else repr(k), v, named=False)  # no name for it: reported, never read
            else:
                walk(v, f"{key}.{k}" if key else str(k))

    walk(obj, "")
    return tensors, others


def open_torch_source(storage: Storage, path: str) -> Optional[TorchStateSource]:
    """A DCP directory or a torch.save file at `path`; None when `path` is neither a file nor a
    directory with DCP metadata."""
    if storage.exists(storage.join(path, DCP_METADATA)):
        return DcpSource(storage, path)
    if storage.exists(path) and storage.regular_file_size(path) is not None:
        return TorchSaveSource(storage, path)
    return None
