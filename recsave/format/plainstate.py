"""What extras and io states may hold, so that a committed checkpoint always loads.

The .pt files are read with ``torch.load(weights_only=True)`` (format/torchio.py), which restores
only tensors, plain Python values and plain containers. ``encode`` runs at save, before anything is
written: it refuses any other value with a UsageError naming the registered object, the value's
type and where it sits, and it carries numpy arrays and scalars (``np.random.get_state()``) as
marker dicts of tensors / Python numbers. ``decode`` turns those markers back into numpy at load.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Tuple

import numpy as np
import torch

from recsave.errors import UsageError

_MARK = "__recsave_numpy__"  # {_MARK: "ndarray" | "scalar", "dtype": str, "value": tensor | number}
_NUMERIC_KINDS = "biufc"  # bool, int, uint, float, complex
# Exactly these types (not subclasses: a namedtuple or defaultdict is refused by weights_only).
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device, torch.Size)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_HINT = ("Return only tensors, numbers, strings, bytes, None, numpy arrays / scalars of numeric dtype and "
         "dicts / lists / tuples / sets of these (e.g. a datetime as its isoformat() string), converting "
         "back in {load}")


class _Refused(Exception):
    def __init__(self, value: Any, where: str):
        super().__init__(where)
        self.value, self.where = value, where


def encode(state: Any, what: str, name: str, method: str, load_method: str) -> Any:
    """`state` with numpy arrays / scalars replaced by markers (other values are kept, not copied).
    UsageError for anything the safe loader cannot restore; `what` / `name` / `method` name the
    registered object in the message ("extra 'rng': state_dict() holds ...")."""
    try:
        return _walk(state, "", _encode_leaf)
    except _Refused as bad:
        raise UsageError(
            f"{what} {name!r}: {method}() holds a {_type_name(bad.value)} at {bad.where or '[]'}, which the "
            f"safe loader (torch.load weights_only=True) cannot restore, so the checkpoint could never be "
            f"loaded; nothing was saved. " + _HINT.format(load=load_method), key=name) from None


def decode(state: Any) -> Any:
    """encode()'s output with its numpy markers turned back into numpy arrays / scalars."""
    return _walk(state, "", _decode_leaf)


def _walk(value: Any, where: str, leaf: Callable[[Any, str], Tuple[bool, Any]]) -> Any:
    done, out = leaf(value, where)
    if done:
        return out
    kind = type(value)
    if kind in (dict, collections.OrderedDict):
        items = []
        for k, v in value.items():
            items.append((_walk(k, f"a key of {where or '[]'}", leaf), _walk(v, f"{where}[{k!r}]", leaf)))
        return kind(items)
    if kind in (list, tuple, set):
        return kind(_walk(v, f"{where}[{i}]", leaf) for i, v in enumerate(value))
    if kind in _ATOMS or kind in _TENSORS:
        return value
    raise _Refused(value, where)


def _encode_leaf(value: Any, where: str) -> Tuple[bool, Any]:
    if not isinstance(value, (np.ndarray, np.generic)):
        return False, None
    if value.dtype.kind not in _NUMERIC_KINDS:
        raise _Refused(value, where)
    if isinstance(value, np.generic):
        item = value.item()
        if type(item) not in (bool, int, float, complex):  # longdouble stays a numpy scalar
            raise _Refused(value, where)
        return True, {_MARK: "scalar", "dtype": value.dtype.str, "value": item}
    try:  # a native-order contiguous copy; decode restores the dtype (byte order included)
        data = torch.from_numpy(np.array(value, dtype=value.dtype.newbyteorder("="), order="C", copy=True))
    except TypeError:  # a numpy dtype torch has no tensor type for (longdouble, ...)
        raise _Refused(value, where) from None
    return True, {_MARK: "ndarray", "dtype": value.dtype.str, "value": data}


def _decode_leaf(value: Any, where: str) -> Tuple[bool, Any]:
    if type(value) is dict and value.keys() == {_MARK, "dtype", "value"}:
        dtype = np.dtype(value["dtype"])
        if value[_MARK] == "ndarray":
            return True, value["value"].numpy().astype(dtype, copy=False)
        return True, dtype.type(value["value"])
    if type(value) not in (dict, collections.OrderedDict, list, tuple, set):
        return True, value  # leaves pass through unchanged
    return False, None


def _type_name(value: Any) -> str:
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{name} of dtype {value.dtype}" if isinstance(value, (np.ndarray, np.generic)) else name
