"""The oracle's rules (docs/FORMAT.md): limits, the dtype table and validators of untrusted JSON
values, written from the specification like the oracle itself (recsave/format/oracle.py) and
shared by nothing else."""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from recsave.errors import CorruptCheckpointError, FormatVersionError

FORMAT_VERSION = 1  # a full checkpoint's index, and every shard file's header
SHARED_RANGES_VERSION = 3  # any kind; chunks refer to `bucket_ranges` by position
RULE_VERSION = 4  # version 3, and a chunk may give its segments as the `bucket_segments` rule
# FORMAT.md section 3 `kind` -> the format_versions it may have
KIND_VERSIONS = {"full": (1, SHARED_RANGES_VERSION, RULE_VERSION), "delta": (2, SHARED_RANGES_VERSION, RULE_VERSION),
                 "serving": (2, SHARED_RANGES_VERSION, RULE_VERSION)}
INDEX_VERSIONS = sorted({v for vs in KIND_VERSIONS.values() for v in vs})
MAX_ID_BYTES = 255  # a <ckpt_id> (section 1)
INDEX_MAGIC = "recsave.index"
MAX_INDEX_BYTES = 256 * 1024 * 1024
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_NDIM = 32
MAX_NBYTES = 1 << 62
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")

# FORMAT.md section 4: torch dtype name -> (itemsize, safetensors code or None when stored as U8).
DTYPE_TABLE: Dict[str, Tuple[int, Optional[str]]] = {
    "float64": (8, "F64"), "float32": (4, "F32"), "float16": (2, "F16"), "bfloat16": (2, "BF16"),
    "int64": (8, "I64"), "int32": (4, "I32"), "int16": (2, "I16"), "int8": (1, "I8"),
    "uint64": (8, "U64"), "uint32": (4, "U32"), "uint16": (2, "U16"), "uint8": (1, "U8"),
    "bool": (1, "BOOL"), "complex64": (8, "C64"),
    "float8_e4m3fn": (1, "F8_E4M3"), "float8_e5m2": (1, "F8_E5M2"),
    "float8_e4m3fnuz": (1, "F8_E4M3FNUZ"), "float8_e5m2fnuz": (1, "F8_E5M2FNUZ"),
    "complex128": (16, None), "complex32": (4, None), "float8_e8m0fnu": (1, None),
    "float4_e2m1fn_x2": (1, None), "bits8": (1, None), "bits16": (2, None), "bits1x8": (1, None),
    "bits2x4": (1, None), "bits4x2": (1, None),
}
CODE_ITEMSIZE: Dict[str, int] = {code: size for size, code in DTYPE_TABLE.values() if code}


def corrupt(path: str, what: str, key: Optional[str] = None) -> CorruptCheckpointError:
    where = f"{path}: tensor {key!r}: " if key is not None else f"{path}: "
    return CorruptCheckpointError(where + what + " (the checkpoint is corrupt; restore another one)",
                                  path=path, key=key)


def is_int(v: Any) -> bool:
    # JSON true/false parse to bool, a subclass of int: they are not integers here.
    return isinstance(v, int) and not isinstance(v, bool)


def as_int(v: Any, what: str, path: str, key: Optional[str] = None, lo: int = 0, hi: int = MAX_NBYTES) -> int:
    if not is_int(v) or not lo <= v < hi:
        raise corrupt(path, f"{what} must be an integer in [{lo}, {hi}), got {v!r:.80}", key)
    return v


def as_obj(v: Any, what: str, path: str, key: Optional[str] = None) -> dict:
    if not isinstance(v, dict):
        raise corrupt(path, f"{what} must be a JSON object, got {type(v).__name__}", key)
    return v


def no_duplicates(pairs: List[Tuple[str, Any]]) -> dict:
    # A repeated key would let two readers see different values: refuse it.
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r:.80}")
        out[k] = v
    return out


def parse_json(raw: bytes, what: str, path: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, int digit limit
        raise corrupt(path, f"{what} is not valid UTF-8 JSON: {str(e):.200}") from None


def as_shape(v: Any, what: str, path: str, key: Optional[str] = None, itemsize: int = 1) -> Tuple[List[int], int]:
    """Validates a shape and returns it with its byte size ``product(shape) x itemsize``, which must be
    < 2^62 (so that a reader using int64 arithmetic cannot overflow); each dim is bounded the same way."""
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise corrupt(path, f"{what} shape must be a list of at most {MAX_NDIM} dims, got {v!r:.80}", key)
    nbytes = itemsize
    for d in v:
        if not is_int(d) or d < 0:
            raise corrupt(path, f"{what} shape {v!r:.80} has a dim that is not a non-negative integer", key)
        nbytes *= d
        if nbytes >= MAX_NBYTES or d >= MAX_NBYTES:  # Python ints never overflow: bound them explicitly
            raise corrupt(path, f"{what} shape {v!r:.80} x itemsize {itemsize} is 2^62 bytes or more", key)
    return list(v), nbytes


def plain_name(name: Any, path: str) -> str:
    if not isinstance(name, str) or not PLAIN_NAME.match(name) or name in (".", ".."):
        raise corrupt(path, f"file name {name!r:.120} is not a plain file name inside the checkpoint directory")
    return name


def ckpt_id(v: Any, what: str, path: str) -> str:
    """A <ckpt_id> (FORMAT.md section 1): a plain name of at most 255 bytes."""
    if not isinstance(v, str) or not PLAIN_NAME.match(v) or v in (".", "..") or len(v.encode()) > MAX_ID_BYTES:
        raise corrupt(path, f"{what} {v!r:.120} is not a valid checkpoint id")
    return v


def check_kind(idx: dict, path: str) -> str:
    """The index's `kind` against its (known) format_version, and a delta's `parent` / `base`
    (FORMAT.md sections 3 and 10); returns the kind. An unknown kind, or a full index of version 2,
    is refused like an unknown version (FormatVersionError)."""
    version, kind = idx["format_version"], idx.get("kind", "full")
    if not isinstance(kind, str):
        raise corrupt(path, f"kind must be a string, got {kind!r:.80}")
    if kind not in KIND_VERSIONS and version <= FORMAT_VERSION:  # new kinds come with new versions
        raise corrupt(path, f"checkpoint kind {kind!r:.80} at format_version {version}: damage")
    if kind not in KIND_VERSIONS:
        raise FormatVersionError(f"{path}: unknown checkpoint kind {kind!r:.80} (this reader knows "
                                 f"{sorted(KIND_VERSIONS)}); upgrade recsave to read it", path=path)
    if kind == "full" and version not in KIND_VERSIONS[kind]:
        raise FormatVersionError(f"{path}: format_version {version} is not defined for a full checkpoint (this "
                                 f"reader knows versions {KIND_VERSIONS[kind]}); upgrade recsave to read it", path=path)
    if version not in KIND_VERSIONS[kind]:
        raise corrupt(path, f"a {kind!r} index must have format_version {KIND_VERSIONS[kind]}, not {version}")
    if kind != "delta":
        if "parent" in idx or "base" in idx:
            raise corrupt(path, f"a {kind!r} index must not have 'parent' or 'base'")
        return kind
    parent = as_obj(idx.get("parent"), "parent", path)
    ckpt_id(parent.get("id"), "parent.id", path)
    as_int(parent.get("crc32c"), "parent.crc32c", path, hi=1 << 32)
    ckpt_id(idx.get("base"), "base", path)
    return kind


def check_kind_tensors(idx: dict, kind: str, path: str) -> None:
    """What the table meta says about how to read the tables' tensors (tensor entries already
    validated): an int8 table's codes, scale and offset (section 8; another `quant` is refused as
    an unknown encoding) and a delta table's tombstones (section 10). Other meta keys are not read."""
    tensors = idx["tensors"]
    tables = as_obj(idx["meta"].get("tables", {}), "meta tables", path)
    for name, t in tables.items():
        t = as_obj(t, "table meta", path, name)

        def tensor(suffix: str, name: str = name) -> dict:
            entry = tensors.get(f"{name}@{suffix}")
            if entry is None:
                raise corrupt(path, f"table {name!r} has no tensor {name}@{suffix}", name)
            return entry
        quant = t.get("quant")
        if quant is not None and quant != "int8":
            raise FormatVersionError(f"{path}: table {name!r} is stored as {quant!r:.80}, which this reader "
                                     f"cannot decode (it knows 'int8'); upgrade recsave", path=path)
        if quant == "int8":
            dim = as_int(t.get("dim"), "dim", path, name)
            codes, scale, offset = tensor("embedding"), tensor("scale"), tensor("offset")
            n = codes["shape"][0] if len(codes["shape"]) == 2 else -1
            if codes["dtype"] != "int8" or n < 0 or codes["shape"][1] != dim:
                raise corrupt(path, f"int8 codes must be int8 [rows, {dim}], got "
                                    f"{codes['dtype']} {codes['shape']}", f"{name}@embedding")
            for what, e in (("scale", scale), ("offset", offset)):
                if e["dtype"] not in ("float16", "float32") or e["dtype"] != scale["dtype"] or e["shape"] != [n, 1]:
                    raise corrupt(path, f"{what} must be float16 or float32 [{n}, 1] like the scale, got "
                                        f"{e['dtype']} {e['shape']}", f"{name}@{what}")
        if kind == "delta":
            stones = tensor("tombstone")
            if not isinstance(t.get("cleared"), bool):
                raise corrupt(path, f"a delta table needs 'cleared' true or false, got {t.get('cleared')!r:.40}", name)
            k = as_int(t.get("tombstones"), "tombstones", path, name)
            if stones["dtype"] != "int64" or stones["shape"] != [k]:
                raise corrupt(path, f"{name}@tombstone must be int64 [{k}] (the meta's tombstones), got "
                                    f"{stones['dtype']} {stones['shape']}", f"{name}@tombstone")


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Rows of an int8 table (section 8): ``(float32(code) + 128) * float32(scale) + float32(offset)``
    in float32, the product rounded, then the sum (codes [n, dim], scale and offset [n, 1])."""
    product = (codes.to(torch.float32) + 128.0) * scale.to(torch.float32)
    return product + offset.to(torch.float32)
