"""Reads tensors of a checkpoint through the C++ engine: ranged, parallel, checksum-verified."""
from __future__ import annotations

import os
import stat
from typing import Any, Dict, Iterable, List, Optional

import numpy as np
import torch

from .. import _C, knobs
from ..errors import CheckpointNotFoundError, ConfigError
from . import checks, header
from . import index as index_mod
from .dtypes import BY_NAME


def check_listed_file(ckpt_dir: str, fname: str, index: Dict[str, Any]) -> str:
    """Path of a file listed in the index, after checking it is a regular file (not a symlink) of
    exactly the recorded size."""
    path = os.path.join(ckpt_dir, checks.as_plain_name(fname, "file name", ckpt_dir))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{path}: file listed in the index is missing; the checkpoint is incomplete — restore "
            f"from another checkpoint", path=path) from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise checks.corrupt(path, "listed file is not a regular file (symbolic links are refused)")
    expected = index["files"][fname]["size"]
    if st.st_size != expected:
        raise checks.corrupt(path, f"file is {st.st_size} bytes, the index records {expected}")
    return path


def read_tensors(ckpt_dir: str, names: Optional[Iterable[str]] = None, *,
                 index: Optional[Dict[str, Any]] = None, verify: bool = True,
                 concurrency: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Reads the named tensors (all when `names` is None) of the checkpoint in `ckpt_dir`.

    Every segment read is checked against its CRC32C unless `verify` is False. Raises
    CheckpointNotFoundError, CorruptCheckpointError (incl. FormatVersionError) or ConfigError for a
    name the checkpoint does not have.
    """
    if index is None:
        index = index_mod.read(ckpt_dir)
    wanted = list(index["tensors"]) if names is None else list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in index["tensors"]]
    if missing:
        raise ConfigError(f"{ckpt_dir}: the checkpoint has no tensor(s) {missing}; it has "
                          f"{sorted(index['tensors'])[:20]}", path=ckpt_dir, key=missing[0])
    threads = concurrency or knobs.get("concurrency")
    out = {n: torch.empty(index["tensors"][n]["shape"], dtype=BY_NAME[index["tensors"][n]["dtype"]].torch_dtype)
           for n in wanted}
    for fname in index_mod.chunk_files(index, wanted):
        _read_file(ckpt_dir, fname, index, wanted, out, verify, threads)
    return out


def _read_file(ckpt_dir: str, fname: str, index: Dict[str, Any], wanted: List[str],
               out: Dict[str, torch.Tensor], verify: bool, threads: int) -> None:
    path = check_listed_file(ckpt_dir, fname, index)
    reader = _C.ShardReader(path)
    try:
        data_start, entries = header.parse(reader.read_header(knobs.get("max_header_bytes")),
                                           reader.size, path)
        offsets: List[int] = []
        addresses: List[int] = []
        lengths: List[int] = []
        crcs: List[int] = []
        for name in wanted:
            t = out[name]
            row_bytes = t[0].nbytes if t.dim() and t.shape[0] else 0
            for chunk in index["tensors"][name]["chunks"]:
                if chunk["file"] != fname:
                    continue
                _check_against_header(chunk, entries.get(name), data_start, index["tensors"][name]["dtype"], path, name)
                dest = t.data_ptr() + (chunk["rows"][0] * row_bytes if "rows" in chunk else 0)
                for (b, e), crc in zip(index_mod.segment_bounds(chunk), chunk["crc32c"]):
                    offsets.append(chunk["offset"] + b)
                    addresses.append(dest + b)
                    lengths.append(e - b)
                    crcs.append(crc)
        reader.read(np.asarray(offsets, dtype=np.uint64), np.asarray(addresses, dtype=np.uint64),
                    np.asarray(lengths, dtype=np.uint64),
                    np.asarray(crcs, dtype=np.uint32) if verify else None, threads)
    finally:
        reader.close()


def _check_against_header(chunk: Dict[str, Any], entry: Optional[header.HeaderEntry], data_start: int,
                          dtype_name: str, path: str, name: str) -> None:
    if entry is None:
        raise checks.corrupt(path, "the index places this tensor in the file but its header lacks it", name)
    if (data_start + entry.begin != chunk["offset"] or entry.end - entry.begin != chunk["length"]
            or entry.dtype.name != dtype_name):
        raise checks.corrupt(path, f"index entry (offset {chunk['offset']}, length {chunk['length']}, "
                             f"{dtype_name}) disagrees with the file header (offset "
                             f"{data_start + entry.begin}, length {entry.end - entry.begin}, "
                             f"{entry.dtype.name})", name)
