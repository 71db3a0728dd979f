"""Autograd modes a table's methods must tell apart.

Table storage stays made of normal tensors when a caller runs under ``torch.inference_mode()``.

A tensor allocated in inference mode is an inference tensor, which can never again be updated in
place outside it: a table that grew (a training-mode lookup of new ids) or was loaded inside such a
block could not be trained afterwards (every optimizer step raised). The table methods that
allocate storage run with inference mode switched off; grad mode stays as the caller had it."""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar, cast

import torch

F = TypeVar("F", bound=Callable[..., Any])


def outside_inference_mode(fn: F) -> F:
    """Runs `fn` with inference mode off (and grad mode as it was: off) when called inside it."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():  # inference_mode(False) enables grad
            return fn(*args, **kwargs)
    return cast(F, wrapper)


def recomputing() -> bool:
    """Whether a forward is activation checkpointing's recompute (torch.utils.checkpoint, reentrant
    or not): a second run, during backward, of a lookup the forward pass made already, which must
    not count it again. Told by the backward pass running in this thread with grad mode on (the
    recompute turns it on to rebuild the graph); a lookup in a hook or a Function's backward runs
    with it off (unless the backward builds a graph: create_graph=True) and still counts."""
    if not torch.is_grad_enabled():
        return False
    # No public call tells; a torch without this one counts the recompute as before.
    task_id = getattr(torch._C, "_current_graph_task_id", None)  # noqa: SLF001
    return task_id is not None and task_id() != -1
