"""The `meta` object of a checkpoint index (docs/FORMAT.md section 3, "Meta"): what the checkpoint
holds for higher layers (tables, dense entries, extras, io states), parsed into the typed records
of recsave.format.records and checked against the index's tensors, int8 tables (section 8) and
delta tables (section 10) included. format/index.py calls parse_meta while it validates an index.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from recsave.errors import FormatVersionError
from recsave.format import checks
from recsave.format.records import QUANT_INT8, DenseMeta, Meta, TableMeta, TensorEntry
from recsave.version import __version__

META_KEYS = ("tables", "dense", "extras", "io_states")


def parse_meta(meta: Dict[str, Any], tensors: Mapping[str, TensorEntry], path: str) -> Optional[Meta]:
    """The typed `meta` of an index: None when it describes nothing (an empty object); otherwise
    tables, dense entries, extras and io states must all be described, and every table's tensors
    (`<table>@id`, `@embedding`, one per slot) must be in the index."""
    present = [k for k in META_KEYS if k in meta]
    if not present:
        return None

    def bad(detail: str) -> Exception:
        return checks.corrupt(path, f"index meta does not describe tables / dense / extras ({detail})")

    if len(present) != len(META_KEYS):
        raise bad(f"missing {[k for k in META_KEYS if k not in meta]}")
    if not isinstance(meta["tables"], dict) or not isinstance(meta["dense"], dict):
        raise bad("'tables' and 'dense' must be objects")
    tables: Dict[str, TableMeta] = {}
    for name, t in meta["tables"].items():
        if not isinstance(t, dict):
            raise bad(f"table {name!r} is not an object")
        quant = t.get("quant")
        if quant is not None and quant != QUANT_INT8:
            raise FormatVersionError(f"{path}: table {name!r} is stored as {quant!r}, which recsave "
                                     f"{__version__} cannot decode (it knows {QUANT_INT8!r}); upgrade recsave",
                                     path=path)
        cleared = t.get("cleared")
        if cleared is not None and not isinstance(cleared, bool):
            raise bad(f"cleared of table {name!r} must be true or false, found {cleared!r}")
        tables[name] = TableMeta(checks.as_int(t.get("dim"), f"dim of table {name!r}", path),
                                 _text(t.get("dtype"), f"dtype of table {name!r}", bad),
                                 _texts(t.get("slots"), f"slots of table {name!r}", bad),
                                 checks.as_int(t.get("rows", 0), f"rows of table {name!r}", path), quant,
                                 step=_opt_int(t.get("step"), f"step of table {name!r}", path),
                                 cleared=cleared,
                                 tombstones=_opt_int(t.get("tombstones"), f"tombstones of table {name!r}", path))
    dense: Dict[str, DenseMeta] = {}
    for name, d in meta["dense"].items():
        if not isinstance(d, dict):
            raise bad(f"dense {name!r} is not an object")
        dense[name] = DenseMeta(tuple(checks.as_shape(d.get("shape"), path, name)),
                                _text(d.get("dtype"), f"dtype of dense {name!r}", bad))
    count = meta.get("io_state_count")
    if count is not None:
        count = checks.as_int(count, "io_state_count", path, lo=1, hi=1 << 24)
    for name, info in tables.items():
        quantised = ("scale", "offset") if info.quant is not None else ()
        for suffix in ("id", "embedding") + info.slots + quantised:
            if f"{name}@{suffix}" not in tensors:
                raise checks.corrupt(path, f"table {name!r} lacks its tensor {name}@{suffix}")
        if info.quant is not None:
            _check_quantised(name, info, tensors, path)
    return Meta(tables, dense, _texts(meta["extras"], "extras", bad), _texts(meta["io_states"], "io_states", bad),
                count)


def _opt_int(value: Any, what: str, path: str) -> Optional[int]:
    return None if value is None else checks.as_int(value, what, path)


def _check_quantised(name: str, info: TableMeta, tensors: Mapping[str, TensorEntry], path: str) -> None:
    """An int8 table (docs/FORMAT.md section 8): int8 codes [n, dim], float16/float32 scale and
    offset [n, 1] of one dtype."""
    codes, scale, offset = (tensors[f"{name}@{s}"] for s in ("embedding", "scale", "offset"))
    n = codes.shape[0] if codes.shape else -1
    if codes.dtype != "int8" or list(codes.shape) != [n, info.dim]:
        raise checks.corrupt(path, f"int8 table {name!r}: {name}@embedding must be int8 [rows, {info.dim}], "
                             f"found {codes.dtype} {list(codes.shape)}", f"{name}@embedding")
    for entry, what in ((scale, "scale"), (offset, "offset")):
        if entry.dtype not in ("float16", "float32") or entry.dtype != scale.dtype \
                or list(entry.shape) != [n, 1]:
            raise checks.corrupt(path, f"int8 table {name!r}: {name}@{what} must be float16 or float32 "
                                 f"[{n}, 1] like the scale, found {entry.dtype} {list(entry.shape)}",
                                 f"{name}@{what}")


def _text(value: Any, what: str, bad: Callable[[str], Exception]) -> str:
    if not isinstance(value, str):
        raise bad(f"{what} must be a string, found {value!r}")
    return value


def _texts(value: Any, what: str, bad: Callable[[str], Exception]) -> Tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad(f"{what} must be a list of strings, found {value!r}")
    return tuple(value)
