"""Where a load reads from: a recsave checkpoint (index + shard files) or a Parquet export. Both
answer the same questions — what they hold, how much a read costs, and the read itself — so
configs, plans and loads treat them alike."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from recsave import _C
from recsave.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, UsageError
from recsave.format import chain, ckptlist, plainstate, torchio
from recsave.format import index as index_mod
from recsave.format.quant import dequantize_rows
from recsave.format.reader import CheckedHeader, bytes_to_read, read_tensors
from recsave.format.records import Index
from recsave.load import contents, merge
from recsave.load.config import Contents
from recsave.storage import Storage, get_storage
from recsave.tables import partition
from recsave.tables.rows import META_COLUMNS


class CheckpointSource:
    """A committed recsave checkpoint."""

    kind = "checkpoint"

    def __init__(self, storage: Storage, ckpt_dir: str, index: Index, index_crc: Optional[int] = None):
        self.storage = storage
        self.ckpt_dir = ckpt_dir
        self.index = index
        self.index_crc = index_crc  # CRC32C of the index bytes parsed (None: not known)
        self.contents: Contents = contents.of_index(index, ckpt_dir)
        self._checked: Dict[str, CheckedHeader] = {}  # shard files checked once for all reads

    @property
    def path(self) -> str:
        return self.ckpt_dir

    @property
    def version(self) -> str:
        """Identifies the data: a newer committed checkpoint has another directory."""
        return f"{self.ckpt_dir}@{self.index.created_at}"

    @property
    def step(self) -> Optional[int]:
        return self.index.step

    @property
    def io_state_count(self) -> int:
        return self.index.io_state_count

    @property
    def num_buckets(self) -> int:
        """Buckets of the checkpoint's partition (needed to read it with several ranks)."""
        if self.index.partition is None:
            raise ConfigError(f"{self.ckpt_dir}: the checkpoint has no partition, so it cannot be loaded "
                              f"by several ranks", path=self.ckpt_dir)
        return self.index.partition.num_buckets

    def meta_columns(self, table: str) -> List[str]:
        """The row metadata columns (last_step, count) the checkpoint holds for `table`: none when
        written before recsave saved them (the rows then get 0s)."""
        return [m for m in META_COLUMNS if f"{table}@{m}" in self.index.tensors]

    def table_step(self, table: str) -> Optional[int]:
        """The table step the index records for `table`, if any."""
        info = self.index.meta.tables.get(table) if self.index.meta is not None else None
        return info.step if info is not None else None

    def id_count(self, table: str, rank: int, world: int) -> int:
        """How many ids of the table rank `rank` of `world` reads (what read_table returns)."""
        ranges = self.row_ranges(table, rank, world)
        if ranges is None:
            return self.index.tensor(f"{table}@id").shape[0]
        return sum(stop - start for start, stop in ranges)

    def row_ranges(self, table: str, rank: int, world: int) -> Optional[List[Tuple[int, int]]]:
        """Logical rows of the table whose buckets rank `rank` of `world` owns (None: all rows)."""
        if world == 1:
            return None
        tensor = f"{table}@id"
        lo, hi = partition.bucket_range(rank, world, self.num_buckets)
        ranges = []
        for chunk in self.index.tensor(tensor).chunks:
            if chunk.buckets is None:
                raise ConfigError(f"{self.ckpt_dir}: {tensor} has no bucket offsets, so it cannot be "
                                  f"loaded by {world} ranks", path=self.ckpt_dir, key=tensor)
            rows = chunk.buckets.rows_of(lo, hi)
            if rows is not None:
                ranges.append((chunk.first_row + rows[0], chunk.first_row + rows[1]))
        return ranges

    def table_cost(self, table: str, columns: Sequence[str], rank: int, world: int) -> Tuple[int, Dict[str, int]]:
        """(rows, bytes per column incl. the ids under 'id') a read_table would fetch."""
        ranges = self.row_ranges(table, rank, world)
        rows = self.contents.tables[table].rows if ranges is None else sum(b - a for a, b in ranges)
        cost = {c: sum(bytes_to_read(self.index, t, ranges) for t in self._stored(table, c))
                for c in ["id", *columns]}
        return rows, cost

    def _quantised(self, table: str) -> bool:
        meta = self.index.meta
        return meta is not None and table in meta.tables and meta.tables[table].quant is not None

    def _stored(self, table: str, column: str) -> List[str]:
        """The tensors holding a column: an int8 table's embedding is its codes, scale and offset."""
        if column == "embedding" and self._quantised(table):
            return [f"{table}@embedding", f"{table}@scale", f"{table}@offset"]
        return [f"{table}@{column}"]

    def read_table(self, table: str, columns: Sequence[str], rank: int, world: int, concurrency: int,
                   out: Optional[Dict[str, torch.Tensor]] = None, with_ids: bool = True,
                   part: Optional[Tuple[int, int]] = None) -> Tuple[Optional[torch.Tensor], Dict[str, torch.Tensor]]:
        """The table's ids (those rank `rank` of `world` owns; None when not `with_ids`) and the
        given columns; `out` maps columns to destination tensors to read into (e.g. the table's
        storage). `part` = (a, b) reads only rows [a, b) of those, so a large table can be read
        in blocks (a CUDA table's restore, through bounded pinned buffers)."""
        ranges = self.row_ranges(table, rank, world)
        if part is not None:
            whole = [(0, self.index.tensor(f"{table}@id").shape[0])] if ranges is None else ranges
            ranges = sub_ranges(whole, *part)
        names = ([f"{table}@id"] if with_ids else []) + [t for c in columns for t in self._stored(table, c)]
        quantised = "embedding" in columns and self._quantised(table)
        dest = {f"{table}@{c}": t for c, t in (out or {}).items() if not (quantised and c == "embedding")}
        data = read_tensors(self.ckpt_dir, names, index=self.index, storage=self.storage,
                            concurrency=concurrency, rows=None if ranges is None else {n: ranges for n in names},
                            out=dest, checked=self._checked)
        if quantised:  # int8 codes -> float32 rows, exactly as docs/FORMAT.md section 8 defines them
            rows = dequantize_rows(*(data.pop(f"{table}@{s}") for s in ("embedding", "scale", "offset")))
            given = (out or {}).get("embedding")
            data[f"{table}@embedding"] = rows if given is None else given.copy_(rows)
        ids = data.get(f"{table}@id")
        if ids is not None and ids.dtype != torch.int64:  # another writer's int32 ids: every caller takes int64
            ids = ids.to(torch.int64)
        if ids is not None and world > 1:  # bucket offsets must agree with the ids they delimit
            lo, hi = partition.bucket_range(rank, world, self.num_buckets)
            buckets = partition.bucket_of(ids, self.num_buckets)
            if bool(((buckets < lo) | (buckets >= hi)).any()):
                raise CorruptCheckpointError(
                    f"{self.ckpt_dir}: the bucket offsets of table {table!r} in the index disagree with its "
                    f"ids (rank {rank} of {world} read ids of other buckets); the index is damaged — "
                    f"restore from another checkpoint", path=self.ckpt_dir, key=table)
        return ids, {c: data[f"{table}@{c}"] for c in columns}

    def read_tables_into(self, outs: Mapping[str, Mapping[str, torch.Tensor]], rank: int, world: int,
                         concurrency: int) -> None:
        """Reads columns of several tables straight into `outs[table][column]` (as read_table's
        `out`, without the ids) in one read_tensors call: its threads go from one table's file to
        the next without a pause for the caller."""
        names: List[str] = []
        rows: Dict[str, List[Tuple[int, int]]] = {}
        dest: Dict[str, torch.Tensor] = {}
        for table, columns in outs.items():
            if "embedding" in columns and self._quantised(table):  # decoded after its read
                self.read_table(table, list(columns), rank, world, concurrency, out=dict(columns), with_ids=False)
                continue
            ranges = self.row_ranges(table, rank, world)
            for column, tensor in columns.items():
                name = f"{table}@{column}"
                names.append(name)
                dest[name] = tensor
                if ranges is not None:
                    rows[name] = ranges
        if names:
            read_tensors(self.ckpt_dir, names, index=self.index, storage=self.storage, concurrency=concurrency,
                         rows=rows or None, out=dest, checked=self._checked)

    def read_pt(self, fname: str) -> Any:
        """A verified .pt file of the checkpoint, with numpy values restored (format/plainstate.py)."""
        return self.decode_pt(fname, self.read_pt_bytes(fname))

    def read_pt_bytes(self, fname: str) -> bytes:
        """A .pt file's bytes, checked against the index (presence, size, CRC32C)."""
        return torchio.read_bytes(self.storage, self.ckpt_dir, fname, self.index)

    def pt_matches(self, fname: str, data: bytes) -> bool:
        """Whether `data` (e.g. read by another rank) are this checkpoint's `fname`, by the index."""
        return torchio.matches(self.index, fname, data)

    def decode_pt(self, fname: str, data: bytes) -> Any:
        """read_pt of bytes already checked (read_pt_bytes, pt_matches)."""
        return plainstate.decode(torchio.decode(data, self.storage.join(self.ckpt_dir, fname)))

    def pt_size(self, fname: str) -> int:
        return self.index.file(fname).size


def chain_dirs(src: Any) -> List[str]:
    """A delta source's chain members, base first (itself last); [] for any other source."""
    return [m.ckpt_dir for m in src.members] if isinstance(src, ChainSource) else []


def sub_ranges(ranges: Sequence[Tuple[int, int]], a: int, b: int) -> List[Tuple[int, int]]:
    """Rows [a, b) of the concatenation of `ranges`, as ranges of the same rows."""
    out, pos = [], 0
    for start, stop in ranges:
        lo, hi = max(a - pos, 0), min(b - pos, stop - start)
        if lo < hi:
            out.append((start + lo, start + hi))
        pos += stop - start
    return out


class ChainSource(CheckpointSource):
    """A delta checkpoint: reads give the merged rows of its whole chain; each chain member's byte
    ranges are read once per read_table. Opening it checks the chain (CorruptCheckpointError naming
    a missing or damaged member, or a parent whose index changed)."""

    kind = "chain"

    def __init__(self, storage: Storage, ckpt_dir: str, index: Index, index_crc: Optional[int] = None):
        super().__init__(storage, ckpt_dir, index, index_crc)
        self.members = chain.resolve(storage, ckpt_dir, index)

    @property
    def chain_ids(self) -> List[str]:
        return [m.ckpt_id for m in self.members]

    def member_source(self, m: chain.Member) -> CheckpointSource:
        return self if m.ckpt_dir == self.ckpt_dir else CheckpointSource(self.storage, m.ckpt_dir, m.index)

    def table_cost(self, table: str, columns: Sequence[str], rank: int, world: int) -> Tuple[int, Dict[str, int]]:
        """Rows of the merged table (exact with one rank, else the owned share of them) and the bytes
        every chain member contributes per column ('id' includes the tombstones)."""
        rows = self.contents.tables[table].rows
        if world > 1:
            lo, hi = partition.bucket_range(rank, world, self.num_buckets)
            rows = rows * (hi - lo) // self.num_buckets
        cost = {c: 0 for c in ["id", *columns]}
        for m in self.members:
            src = self.member_source(m)
            if f"{table}@id" not in m.index.tensors:
                continue
            ranges = src.row_ranges(table, rank, world)
            for c in cost:
                if f"{table}@{c}" in m.index.tensors:
                    cost[c] += bytes_to_read(m.index, f"{table}@{c}", ranges)
            if f"{table}@tombstone" in m.index.tensors:
                cost["id"] += bytes_to_read(m.index, f"{table}@tombstone", merge.tomb_ranges(src, table, rank, world))
        return rows, cost

    def read_table(self, table: str, columns: Sequence[str], rank: int, world: int, concurrency: int,
                   out: Optional[Dict[str, torch.Tensor]] = None, with_ids: bool = True,
                   part: Optional[Tuple[int, int]] = None) -> Tuple[Optional[torch.Tensor], Dict[str, torch.Tensor]]:
        ids, data = merge.merged_table(self, table, list(columns), rank, world, concurrency)
        if part is not None:  # the merged rows are built whole per call: a part is a slice of them
            # (reading a chain in k parts merges it k times; the block-wise restore never does)
            ids = ids[part[0]:part[1]]
            data = {c: t[part[0]:part[1]] for c, t in data.items()}
        if out:
            for c, dest in out.items():
                dest.copy_(data[c])
                data[c] = dest
        return (ids if with_ids else None), data


_KIND_WORDS = {"parquet": "a Parquet export", "torch_save": "a torch.save file",
               "dcp": "a torch.distributed.checkpoint directory", "torch": "a PyTorch state"}


def require_checkpoint(src: Any, path: str, tool: str) -> None:
    """UsageError unless `src` (from open_source) is a recsave checkpoint (full, delta, serving):
    what other source kinds are, said by name (a torch.save file is not "a Parquet export")."""
    kind = getattr(src, "kind", "checkpoint")
    if kind not in ("checkpoint", "chain"):
        raise UsageError(f"{path} is {_KIND_WORDS.get(kind, kind)}, not a recsave checkpoint; {tool} takes "
                         f"a checkpoint directory or an output dir", path=path)


class ParquetBankSource:
    """A Parquet export (recsave.export.to_parquet) or any Parquet with `id` + `embedding` columns:
    tables only."""

    kind = "parquet"

    def __init__(self, path: str):
        from recsave.load.parquet import ParquetSource

        self._pq = ParquetSource(path)
        self.ckpt_dir = path
        self.contents = Contents(tables=self._pq.tables())
        self.index: Optional[Index] = None  # tables only: no recsave index

    @property
    def path(self) -> str:
        return self.ckpt_dir

    @property
    def version(self) -> str:
        return self._pq.version

    @property
    def step(self) -> Optional[int]:
        return self._pq.step

    def optimizer_steps(self) -> Optional[Dict[str, int]]:
        """The exported checkpoint's sparse optimizer step count per table (its manifest), if recorded."""
        return self._pq.optimizer_steps

    def meta_columns(self, table: str) -> List[str]:
        return []  # an export holds no row metadata

    def table_step(self, table: str) -> Optional[int]:
        return None

    io_state_count = 1
    num_buckets = partition.DEFAULT_NUM_BUCKETS

    def table_cost(self, table: str, columns: Sequence[str], rank: int, world: int) -> Tuple[int, Dict[str, int]]:
        """Rows and decoded bytes per column (Parquet is compressed: the bytes fetched may be fewer).
        With several ranks each gets about 1/world of the ids (the hash spreads them evenly)."""
        rows = self.contents.tables[table].rows
        if world > 1:
            rows = rows // world
        dim = self.contents.tables[table].dim
        cost = {"id": rows * 8}
        for c in columns:
            cost[c] = rows * dim * getattr(torch, self.contents.tables[table].dtype).itemsize
        return rows, cost

    def read_table(self, table: str, columns: Sequence[str], rank: int, world: int,
                   concurrency: int) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        return self._pq.read_table(table, list(columns), rank, world, self.num_buckets)


def open_source(path: str, ckpt_id: Optional[str] = None, direct_path: bool = False):
    """A checkpoint directory (it has an index), an output dir (its latest committed checkpoint, or
    `ckpt_id`), a Parquet export / file, a torch.save file or a DCP directory
    (load/torch_sources.py)."""
    storage = get_storage(path)
    if ckpt_id is not None:
        ckpt_dir = storage.join(path, ckptlist.validate_id(ckpt_id))
    elif storage.exists(storage.join(path, index_mod.INDEX_FILE)):
        ckpt_dir = path
    elif direct_path:
        # The path is the checkpoint itself: an export or a torch / DCP file may be one too; else
        # it is a recsave checkpoint whose index is missing, which reading it says.
        other = _other_source(storage, path)
        if other is not None:
            return other
        ckpt_dir = path
    elif (listing := ckptlist.committed(storage, path)).found:  # rebuilt when the list is lost or garbled
        ids = listing.ids
        if not ids:
            raise CheckpointNotFoundError(f"{path}: the 'checkpoint' file lists no committed checkpoint",
                                          path=path)
        ckpt_dir = storage.join(path, ids[-1])
    else:
        from recsave.load.arrow import DELTA_MANIFEST

        other = _other_source(storage, path)
        if other is not None:
            return other
        if storage.exists(storage.join(path, DELTA_MANIFEST)):
            raise UsageError(f"{path} is an export_delta feed (upserts and deletes since another checkpoint), "
                             f"not a checkpoint or a table; load the checkpoint itself or a to_parquet export "
                             f"of it", path=path)
        raise CheckpointNotFoundError(
            f"{path}: no committed checkpoint here (no 'checkpoint' file, no index, no Parquet, no "
            f"torch.save file, no DCP .metadata); check the path, or save a checkpoint first", path=path)
    data, index_path = index_mod.read_raw(ckpt_dir, storage)
    index, crc = index_mod.parse(data, index_path), int(_C.crc32c(data))
    if index.is_delta:
        return ChainSource(storage, ckpt_dir, index, crc)
    return CheckpointSource(storage, ckpt_dir, index, crc)


def _other_source(storage: Storage, path: str) -> Any:
    """A Parquet export or file, a torch.save file or a DCP directory at `path`; None if neither."""
    from recsave.load.parquet import is_parquet_source
    from recsave.load.torch_sources import open_torch_source

    if is_parquet_source(path):
        return ParquetBankSource(path)
    return open_torch_source(storage, path)
