"""Type checks of public arguments: a wrong type raises ArgumentTypeError (a RecsaveError and a
TypeError) naming the argument, before anything is done. Wrong values of the right type are the
caller's business (UsageError / ValueError)."""
from __future__ import annotations

import numbers
from typing import Any, Optional, Tuple, Type, Union

from recsave.errors import ArgumentTypeError, UsageError

Kind = Union[Type[Any], Tuple[Type[Any], ...]]

_NAMES = {int: "an int", str: "a str", bool: "a bool", float: "a float", dict: "a dict",
          numbers.Real: "a real number", list: "a list", tuple: "a tuple"}


def fail(where: str, arg: str, expected: str, value: Any) -> ArgumentTypeError:
    """The error for argument `arg` of `where` that is not `expected` (e.g. "an int")."""
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ArgumentTypeError(f"{where}: {arg} must be {expected}, got {type(value).__name__} {shown}", key=arg)


def check(value: Any, kind: Kind, arg: str, where: str, *, optional: bool = False,
          expected: Optional[str] = None) -> Any:
    """Returns `value` when it is an instance of `kind` (or None, with `optional`); raises
    ArgumentTypeError otherwise. A bool is not an int or a number unless `kind` includes bool."""
    if value is None and optional:
        return value
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)):
        return value
    want = expected or " or ".join(_NAMES.get(k, f"a {k.__name__}") for k in kinds)
    raise fail(where, arg, want + (" or None" if optional else ""), value)


def path(value: Any, arg: str, where: str) -> str:
    """A path argument: a str (ArgumentTypeError otherwise) that is not empty (UsageError)."""
    check(value, str, arg, where, expected="a str (a local path or an fsspec URL)")
    if not value:
        raise UsageError(f"{where}: {arg} must name a directory (a local path or an fsspec URL), got ''",
                         key=arg)
    return value


def callback(value: Any, arg: str, where: str) -> Any:
    """An optional callable argument (None or a callable; ArgumentTypeError otherwise)."""
    if value is not None and not callable(value):
        raise fail(where, arg, "a callable or None", value)
    return value
