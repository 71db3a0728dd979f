"""`recsave.convert` / ``recsave convert``: a recsave checkpoint to a torch.save state dict or a DCP
directory, and those back to a recsave checkpoint (docs/API.md, "PyTorch interop"; the layout
is in docs/FORMAT.md section 9).

Every source is opened through the load path (load/sources.py), so whatever a model bank can read
converts, and tables are read one at a time through it. The torch.save output (written entry by
entry, tools/torchzip.py) and the DCP output hold one table in memory at a time; the recsave
output at most two (the checkpoint writer orders the next table while writing one).
"""
from __future__ import annotations

import contextlib
import dataclasses
import numbers
import pickle
import warnings
from typing import IO, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from recsave.argcheck import check
from recsave.errors import ConfigError, UsageError
from recsave.format import ckptlist, plainstate
from recsave.load.sources import CheckpointSource, ParquetBankSource, open_source
from recsave.load.torch_sources import TorchStateSource
from recsave.save.pipeline import CheckpointWriter, step_of_id
from recsave.save.snapshot import SaveState, TableState
from recsave.storage import Storage, get_storage
from recsave.tables import partition
from recsave.tables.rows import META_COLUMNS
from recsave.tools import toolargs
from recsave.tools.torchzip import StreamingTorchSave

TARGETS = ("recsave", "torch", "dcp")
EXTRA_PREFIX = "_recsave.extra."  # <prefix><extra name>.<key path>: tensors and numbers of the extras
DEFAULT_CKPT_ID = "converted"


def convert(src: str, dst: str, to: str, *, tables: Optional[Sequence[str]] = None,
            ckpt_id: Optional[str] = None, concurrency: int = 4) -> str:
    """Converts `src` (a recsave checkpoint or output dir: its latest; a torch.save file; a DCP
    directory; a Parquet export) into `dst` as `to`:

    - ``"torch"``: a torch.save file of a flat state dict ``{<table>.ids, <table>.weight,
      <table>.<slot>, dense entries, _recsave.extra.<name>.<path>}``, loadable with
      ``torch.load(weights_only=True)``;
    - ``"dcp"``: a torch.distributed.checkpoint directory with the same keys;
    - ``"recsave"``: a checkpoint `ckpt_id` (default ``converted``) committed in output dir `dst`,
      recording the source's step (unless the id names one, ``ckpt_<N>``) and a recsave source's
      extras.

    For a torch.save / DCP source, `tables` names the tables to convert (default: every table the
    model bank sees there but bare 2-D tensors: ``<name>.weight`` with ``<name>.ids`` beside it or
    without a ``<name>.bias``, i.e. nn.Embedding yes, nn.Linear no; only those with ids where some
    table has them: recsave's layout, whose dense nn.Embedding stays dense); the rest is dense. Returns the
    path written (for ``recsave``, the checkpoint directory)."""
    check(src, str, "src", "convert")
    check(dst, str, "dst", "convert")
    check(to, str, "to", "convert")
    check(tables, (list, tuple), "tables", "convert", optional=True, expected="a list of table names")
    check(ckpt_id, str, "ckpt_id", "convert", optional=True)
    check(concurrency, int, "concurrency", "convert")
    if concurrency < 1:
        raise UsageError(f"convert: concurrency must be >= 1, got {concurrency}", key="concurrency")
    if to not in TARGETS:
        raise UsageError(f"convert: `to` must be one of {list(TARGETS)}, got {to!r}")
    if not dst:
        raise UsageError("convert: dst must be a non-empty path")
    source = open_source(src)
    names, dense = _split(source, tables)
    if isinstance(source, TorchStateSource):
        _warn_left_out(source, src, to)
    elif isinstance(source, ParquetBankSource) and source.optimizer_steps():
        # An export records them per table, but a recsave extra needs the optimizer's name and
        # hyper-parameters too, and the torch.save / DCP layouts keep them in that extra.
        warnings.warn(f"convert: {src}: the sparse optimizer's step counts of table(s) "
                      f"{sorted(source.optimizer_steps() or {})} the export recorded are not converted (a "
                      f"converted checkpoint holds its tables; load the export itself where a warm start "
                      f"needs them)", UserWarning, stacklevel=2)
    storage = get_storage(dst)
    if isinstance(source, CheckpointSource):
        toolargs.refuse_source_dirs(source, storage, dst, "convert", "the converted checkpoint" if to == "recsave"
                                    else "the conversion", output_dir=to == "recsave")
    if to == "recsave":
        return _to_recsave(source, names, dense, dst, ckpt_id or DEFAULT_CKPT_ID, concurrency)
    if to == "torch" and storage.isdir(dst):
        raise UsageError(f"convert: {dst} is a directory; --to torch writes one file: name a file path "
                         f"that does not exist (nothing was written)", path=dst)
    if storage.exists(dst) and (not storage.isdir(dst) or storage.listdir(dst)):
        raise UsageError(f"convert: {dst} exists; convert into a new path (nothing was written)", path=dst)
    if to == "torch":
        def produce(f: IO[bytes]) -> None:  # may run again (a retried remote upload): parts are re-read
            writer = StreamingTorchSave(f)
            state: Dict[str, Any] = {}
            try:
                for part in _parts(source, names, dense, concurrency):
                    _add(state, {k: writer.add(v) if isinstance(v, torch.Tensor) else v for k, v in part.items()},
                         dst)
                    del part  # before the next table is read
                writer.finish(state)
            except BaseException:  # the upload is dropped; close the zip now, not in its __del__
                with contextlib.suppress(Exception):
                    writer.abort()
                raise

        parents = _missing_parents(storage, dst)
        if parents:
            storage.makedirs(parents[-1])  # as every other tool makes its destination's parents
        try:
            storage.write_stream(dst, produce)
        except BaseException:
            toolargs.undo_writes(storage, [], parents)
            raise
    else:
        created = not storage.exists(dst)
        parents = _missing_parents(storage, dst)
        try:
            write_dcp(dst, _parts(source, names, dense, concurrency))
        except BaseException:  # leave dst as it was: absent, or the empty directory it was
            with contextlib.suppress(Exception):
                if created:
                    storage.remove_tree(dst)
                else:
                    for entry in storage.listdir(dst):
                        path = storage.join(dst, entry)
                        storage.remove_tree(path) if storage.isdir(path) else storage.remove_file(path)
            toolargs.undo_writes(storage, [], parents)
            raise
    return dst


def _warn_left_out(source: TorchStateSource, src: str, to: str) -> None:
    """Warns of a PyTorch source's entries the conversion into `to` does not carry, instead of
    dropping them silently: values that are not tensors (a training file's epoch, hyper-parameters),
    recsave's own extras (`_recsave.extra.<extra>.*`, never restored by a conversion), the sparse
    optimizer's step counts among them, and (but into a recsave checkpoint, whose index records it)
    the global step."""
    dropped = {k: t for k, t in source.not_tensors.items() if not k.startswith(EXTRA_PREFIX)}
    extras: Dict[str, int] = {}  # extra name -> its entries
    for k in sorted((*source.not_tensors, *source.meta)):
        if k.startswith(EXTRA_PREFIX):
            name = k[len(EXTRA_PREFIX):].split(".", 1)[0]
            extras[name] = extras.get(name, 0) + 1
    counts = source.optimizer_steps()
    step = source.step if to != "recsave" else None
    if not dropped and not extras and counts is None and step is None:
        return
    parts = []
    if dropped:
        one = len(dropped) == 1
        shown = ", ".join(f"{k!r} ({t})" for k, t in list(dropped.items())[:5])
        parts.append(f"{len(dropped)} {'entry is not a tensor' if one else 'entries are not tensors'} and "
                     f"{'is' if one else 'are'} not converted: {shown}{' ...' if len(dropped) > 5 else ''}")
    if extras:
        shown = ", ".join(f"{n!r} ({c} entr{'y' if c == 1 else 'ies'})" for n, c in extras.items())
        parts.append(f"the extra{'s' if len(extras) > 1 else ''} {shown} ({EXTRA_PREFIX}<extra>.*) "
                     f"{'are' if len(extras) > 1 else 'is'} not restored by a conversion")
    if counts is not None:
        parts.append(f"the sparse optimizer's step counts of table(s) {sorted(counts)} are not converted")
    if step is not None:
        parts.append(f"the global step {step} is not converted")
    carried = "tables, dense tensors and the global step" if to == "recsave" else "tables and dense tensors"
    warnings.warn(f"convert: {src}: {'; '.join(parts)} (a converted checkpoint holds {carried})",
                  UserWarning, stacklevel=3)


def _missing_parents(storage: Storage, dst: str) -> List[str]:
    """The parents of `dst` that do not exist yet, outermost first: made by the write, removed again
    (when empty) if it fails."""
    parent = storage.split(dst.rstrip("/"))[0]
    return toolargs.missing_dirs(storage, parent) if parent else []


def _split(source: Any, tables: Optional[Sequence[str]]) -> Tuple[List[str], List[str]]:
    """(table names, dense names) to convert."""
    if not isinstance(source, TorchStateSource):
        if tables is not None:
            unknown = sorted(set(tables) - set(source.contents.tables))
            if unknown:
                raise ConfigError(f"{source.ckpt_dir}: no table(s) {unknown}; it has "
                                  f"{sorted(source.contents.tables)}", path=source.ckpt_dir)
        # `[]` is no table (as from a PyTorch source), not every one
        return sorted(source.contents.tables if tables is None else tables), sorted(source.contents.dense)
    found = source.tables
    if tables is None:
        # Where some table has ids, the file is recsave's layout (convert, to_dcp_state_dict): every
        # table of it has them, and a `<name>.weight` without is a dense layer's (nn.Embedding),
        # which the round trip must give back as dense. Else: every table but bare 2-D tensors.
        tables = [n for n, t in found.items() if t.ids is not None] or \
            [n for n, t in found.items() if t.weight != n]
    unknown = sorted(set(tables) - set(found))
    if unknown:
        raise ConfigError(f"{source.ckpt_dir}: {unknown} are not tables (2-D <name>.weight tensors); tables "
                          f"found: {sorted(found)}", path=source.ckpt_dir)
    used = {k for n in tables for k in found[n].keys()}
    dense = [k for k in sorted(source.meta) if k not in used and not k.startswith(EXTRA_PREFIX)]
    return sorted(tables), dense


def _parts(source: Any, tables: Sequence[str], dense: Sequence[str], concurrency: int
           ) -> Iterator[Dict[str, Any]]:
    """The flat state, one table per part, then the dense entries and the extras."""
    for name in tables:
        meta = source.meta_columns(name)
        ids, columns = _read_table(source, name, concurrency, meta)
        part = {f"{name}.ids": ids, f"{name}.weight": columns.pop("embedding")}
        part.update({f"{name}.{m}": columns.pop(m).reshape(-1) for m in meta})  # [N] int64
        step = source.table_step(name)
        if step is not None:
            part[f"{name}.step"] = torch.tensor(step, dtype=torch.int64)
        taken = sorted(set(columns) & {"ids", "weight", "step", *META_COLUMNS})
        if taken:  # a slot so named (refused by recsave since; older checkpoints) would overwrite them
            raise UsageError(f"{source.ckpt_dir}: table {name!r} has slot(s) {taken}, which the flat state "
                             f"would write over {name}.ids / .weight / .step / row metadata; convert it with "
                             f"tables=[...] leaving {name!r} out, or load it and rename the slot")
        part.update({f"{name}.{slot}": v for slot, v in sorted(columns.items())})
        yield part
        del ids, columns, part
    rest: Dict[str, Any] = {}
    if dense:
        model = source.read_pt("model.pt")
        rest.update({k: model[k] for k in dense})
    if source.contents.extras:
        for name, state in source.read_pt("extra.pt").items():
            _flatten_plain(state, f"{EXTRA_PREFIX}{name}", rest)
    if rest:
        yield rest


def _read_table(source: Any, name: str, concurrency: int, meta: Sequence[str] = ()
                ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    slots = list(source.contents.tables[name].slots)
    ids, columns = source.read_table(name, ["embedding"] + slots + list(meta), 0, 1, concurrency)
    return ids, dict(columns)


def _flatten_plain(obj: Any, prefix: str, out: Dict[str, Any]) -> None:
    """Tensors and numbers of a nested state under dotted keys; strings, None and the like are left out.
    Two values reaching one key (`{"a.b": x}` beside `{"a": {"b": y}}`, or a dense key spelled like an
    extra's) are a UsageError, not one value written over the other."""
    if isinstance(obj, (np.number, np.bool_)):
        obj = obj.item()  # a plain number: torch.load(weights_only=True) refuses numpy's pickles
    if isinstance(obj, (torch.Tensor, bool, numbers.Number)):
        if prefix in out:
            raise UsageError(f"convert: two values flatten to the key {prefix!r} (a dotted key beside a nested "
                             f"one, or a dense name spelled like an extra's); rename one", key=prefix)
        out[prefix] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten_plain(v, f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten_plain(v, f"{prefix}.{i}", out)


def _add(state: Dict[str, Any], part: Mapping[str, Any], where: str) -> None:
    clash = sorted(set(part) & set(state))
    if clash:
        raise UsageError(f"convert {where}: key(s) {clash[:5]} come from two entries (a table's "
                         f"<table>.<column> and a dense name); rename one", key=clash[0])
    state.update(part)


def write_dcp(dst: str, parts: Iterator[Dict[str, Any]]) -> None:
    """A DCP directory holding the union of `parts`, written one part at a time (each by dcp.save
    into `part_<k>/`), then one `.metadata` naming every part's files, so only one part is in
    memory at once. dcp.load and dcp_to_torch_save read it like any DCP checkpoint."""
    import torch.distributed.checkpoint as dcp

    storage = get_storage(dst)
    local = storage.local_path(dst)
    if local is None:  # DCP's FileSystemWriter writes local files only
        raise UsageError(f"convert: {dst}: a DCP checkpoint is written to local disk (a path or file://); "
                         f"convert to a local directory and copy it (nothing was written)", path=dst)
    dst, storage = local, get_storage(local)
    storage.makedirs(dst)
    merged: Any = None
    keys: Dict[str, Any] = {}
    for k, part in enumerate(parts):
        _add(keys, dict.fromkeys(part), dst)
        sub = f"part_{k}"
        path = storage.join(dst, sub)
        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent here
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.save(part, storage_writer=dcp.FileSystemWriter(path, thread_count=1), no_dist=True)
        md = dcp.FileSystemReader(path).read_metadata()
        storage.remove_file(storage.join(path, ".metadata"))
        data = {i: dataclasses.replace(info, relative_path=f"{sub}/{info.relative_path}")
                for i, info in md.storage_data.items()}
        if merged is None:
            merged = md
            merged.storage_data = data
        else:
            merged.state_dict_metadata.update(md.state_dict_metadata)
            merged.storage_data.update(data)
            if isinstance(merged.planner_data, dict) and isinstance(md.planner_data, dict):
                merged.planner_data.update(md.planner_data)
        del part  # before the next table is read
    if merged is None:
        raise UsageError(f"convert {dst}: the source holds nothing to convert")
    merged.storage_meta = None  # the load id of the last part's reader: not part of the checkpoint
    storage.write_atomic(storage.join(dst, ".metadata"), pickle.dumps(merged))


# ----------------------------------------------------------------------------- -> recsave
class _Tables:
    """Reads tables for the checkpoint writer on demand, in its (sorted) order, keeping at most the
    two it works on (it orders the next table while writing one)."""

    def __init__(self, source: Any, names: Sequence[str], concurrency: int):
        self.source, self.names, self.concurrency = source, list(names), concurrency
        self.cache: Dict[str, Tuple[torch.Tensor, Dict[str, torch.Tensor]]] = {}

    def get(self, name: str) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        if name not in self.cache:
            k = self.names.index(name)
            for old in [n for n in self.cache if self.names.index(n) < k - 1]:
                del self.cache[old]
            meta = self.source.meta_columns(name)
            ids, columns = _read_table(self.source, name, self.concurrency, meta)
            if torch.unique(ids).numel() != ids.numel():
                raise ConfigError(f"{self.source.ckpt_dir}: table {name!r} has repeated ids; each id must "
                                  f"appear once", path=self.source.ckpt_dir, key=name)
            # slots are the embedding's dtype (_to_recsave refused others); row metadata stays int64
            dtype = columns["embedding"].dtype
            self.cache[name] = (ids.contiguous(), {c: v.contiguous() if c in meta else v.to(dtype).contiguous()
                                                   for c, v in columns.items()})
        return self.cache[name]


class _LazyTable:
    def __init__(self, tables: _Tables, name: str):
        self.tables, self.name = tables, name

    def id_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        ids = self.tables.get(self.name)[0]
        return ids, torch.arange(ids.numel(), dtype=torch.int64)


class _LazyColumns(Mapping):
    def __init__(self, tables: _Tables, name: str, columns: Sequence[str]):
        self.tables, self.name, self.names = tables, name, list(columns)

    def __getitem__(self, column: str) -> torch.Tensor:
        if column not in self.names:
            raise KeyError(column)
        return self.tables.get(self.name)[1][column]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _to_recsave(source: Any, names: Sequence[str], dense: Sequence[str], dst: str, ckpt_id: str,
                concurrency: int) -> str:
    ckptlist.validate_id(ckpt_id)
    tables = _Tables(source, names, concurrency)
    states: Dict[str, TableState] = {}
    for name in names:
        info = source.contents.tables[name]
        if "@" in name:
            raise UsageError(f"table name {name!r} cannot be a recsave table name (it has '@')", key=name)
        if info.slot_dtypes:  # a recsave table's slots share its dtype: a cast would round silently
            raise ConfigError(f"{source.ckpt_dir}: table {name!r} is {info.dtype} but its slot(s) "
                              f"{info.slot_dtypes} are not; cast them to {info.dtype} in the source (or "
                              f"load it into a model with dtype_policy='cast' and save that)",
                              path=source.ckpt_dir, key=name)
        columns = _LazyColumns(tables, name, ["embedding", *info.slots])
        # a recsave source's row metadata and table step go along (others have none: 0s on load)
        meta = _LazyColumns(tables, name, source.meta_columns(name))
        states[name] = TableState(info.dim, getattr(torch, info.dtype), columns,  # type: ignore[arg-type]
                                  table=_LazyTable(tables, name),  # type: ignore[arg-type]
                                  meta=meta, step=source.table_step(name))  # type: ignore[arg-type]
    model = source.read_pt("model.pt") if dense else {}
    # A recsave source's extras (the sparse optimizer's step counts, a manager's global step among
    # them) go along as a save writes them; a PyTorch source's are not written (_warn_left_out says
    # so): their strings are not in the file. Io states are per rank of the source's job: not carried.
    extras = {n: plainstate.encode(v, "extra", n, "state_dict", "load_state_dict")
              for n, v in source.read_pt("extra.pt").items()} if source.contents.extras else {}
    state = SaveState(states, {k: model[k] for k in dense}, extras, {})
    # The source's step, unless the id names one (ckpt_<N>: step N, as a save records it). Another
    # step than the source's would restore a manager at N with the state (and the carried
    # global_step) of the source's step.
    step = step_of_id(ckpt_id)
    if step is not None and source.step is not None and step != source.step:
        raise UsageError(f"ckpt_id {ckpt_id!r} names step {step}, but {source.ckpt_dir} holds the state of step "
                         f"{source.step}: name the converted checkpoint ckpt_{source.step}, or give it an id "
                         f"without a step (it then records step {source.step})", key="ckpt_id")
    storage = get_storage(dst)
    made = toolargs.missing_dirs(storage, dst)  # the output dir and its parents this write makes
    writer = CheckpointWriter(storage, dst, None, concurrency, partition.DEFAULT_NUM_BUCKETS, own_dir=False)
    try:
        try:
            return writer.write(ckpt_id, state, 0, 1, step=source.step if step is None else step)
        finally:
            writer.close()
    except BaseException:  # the writer removed its checkpoint directory; the output dir it made goes too
        # (only when empty, in one step: never files another writer put there meanwhile)
        toolargs.undo_writes(storage, [], made)
        raise
