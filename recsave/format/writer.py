"""Writes named tensors into shard files through the C++ engine and describes them in an index part."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import _C, knobs
from ..errors import UsageError
from . import header
from .dtypes import DType, from_torch
from .index import FORMAT_VERSION, new_part


def shard_file_name(prefix: str, rank: int, part: int) -> str:
    return f"{prefix}-{rank}-{part}.safetensors"


def _prepare(name: Any, tensor: Any) -> Tuple[str, torch.Tensor, DType]:
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise UsageError(f"tensor name {name!r} is not usable: names are non-empty strings other "
                         f"than '__metadata__'", key=str(name))
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor", key=name)
    dtype = from_torch(tensor.dtype, key=name)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return name, t.contiguous(), dtype


def _group(items: List[Tuple[str, torch.Tensor, DType]], max_bytes: int) -> List[List[Tuple[str, torch.Tensor, DType]]]:
    """Consecutive tensors into files of at most max_bytes (a larger tensor gets a file of its own)."""
    groups: List[List[Tuple[str, torch.Tensor, DType]]] = [[]]
    size = 0
    for item in items:
        nbytes = item[1].nbytes
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups if groups[0] else []


def write_shards(directory: str, tensors: Mapping[str, torch.Tensor], *, rank: int = 0,
                 prefix: str = "sparse", concurrency: Optional[int] = None,
                 max_shard_bytes: Optional[int] = None, segment_bytes: Optional[int] = None,
                 durable: Optional[bool] = None,
                 chunk_meta: Optional[Mapping[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """Writes `tensors` into `<directory>/<prefix>-<rank>-<part>.safetensors` files and returns the
    index part describing them (docs/FORMAT.md section 3). Each file appears atomically; if anything
    fails, every file this call created is removed before the error propagates.

    `chunk_meta` adds extra keys (e.g. ``buckets``) to a tensor's chunk entry.
    """
    concurrency = concurrency or knobs.get("concurrency")
    max_shard_bytes = max_shard_bytes or knobs.get("max_shard_bytes")
    segment_bytes = segment_bytes or knobs.get("segment_bytes")
    durable = knobs.get("fsync") if durable is None else durable
    if segment_bytes < 1:
        raise UsageError(f"segment_bytes must be >= 1, got {segment_bytes}")
    items = [_prepare(n, t) for n, t in tensors.items()]
    part = new_part(rank)
    written: List[str] = []
    try:
        for part_no, group in enumerate(_group(items, max_shard_bytes)):
            fname = shard_file_name(prefix, rank, part_no)
            path = os.path.join(directory, fname)
            size = _write_file(path, group, part, fname, concurrency, segment_bytes, durable)
            written.append(path)
            part["files"][fname] = {"size": size, "rank": rank}
    except BaseException:
        for path in written:
            try:
                os.remove(path)
            except OSError:
                pass
        raise
    for name, extra in (chunk_meta or {}).items():
        for chunk in part["tensors"][name]["chunks"]:
            chunk.update(extra)
    return part


def _write_file(path: str, group: Sequence[Tuple[str, torch.Tensor, DType]], part: Dict[str, Any],
                fname: str, concurrency: int, segment_bytes: int, durable: bool) -> int:
    head, starts = header.build([(n, d, tuple(t.shape)) for n, t, d in group], FORMAT_VERSION)
    size = len(head) + sum(t.nbytes for _, t, _ in group)
    offsets: List[int] = []
    addresses: List[int] = []
    lengths: List[int] = []
    owners: List[Tuple[int, int]] = []  # (tensor index, number of segments)
    for i, (_name, t, _d) in enumerate(group):
        nbytes, base = t.nbytes, t.data_ptr()
        bounds = range(0, nbytes, segment_bytes) if nbytes else [0]
        for b in bounds:
            offsets.append(starts[i] + b)
            addresses.append(base + b)
            lengths.append(min(segment_bytes, nbytes - b))
        owners.append((i, len(bounds)))

    writer = _C.ShardWriter(path, durable)
    try:
        writer.reserve(size)
        writer.write_bytes(0, head)
        crcs = writer.write(np.asarray(offsets, dtype=np.uint64), np.asarray(addresses, dtype=np.uint64),
                            np.asarray(lengths, dtype=np.uint64), concurrency)
        writer.commit()
    except BaseException:
        writer.abort()
        raise

    k = 0
    for i, count in owners:
        name, t, dtype = group[i]
        chunk: Dict[str, Any] = {"file": fname, "offset": starts[i], "length": t.nbytes,
                                 "crc32c": [int(c) for c in crcs[k:k + count]],
                                 "segment_bytes": segment_bytes}
        k += count
        if t.dim():
            chunk["rows"] = [0, t.shape[0]]
        if name in part["tensors"]:
            raise UsageError(f"tensor {name!r} given twice", key=name)
        part["tensors"][name] = {"dtype": dtype.name, "shape": list(t.shape), "chunks": [chunk]}
    return size
