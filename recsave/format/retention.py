"""Which committed checkpoints an output dir keeps, and why (docs/FORMAT.md section 1, "Retention").

`select` is a pure function of the listed ids and the policy, so that the Saver's rotation, `recsave
gc` and `recsave ls` agree; `policy_of` reads the policy a writer recorded in its latest index.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from recsave.argcheck import check
from recsave.errors import (
    UsageError,
)
from recsave.format import index as index_mod
from recsave.format.checks import is_finite_number
from recsave.format.records import Index, Retention
from recsave.storage import Storage

LATEST, EVERY_N_STEPS, BEST = "latest", "every_n_steps", "best"
BEST_MODES = ("max", "min")


def select(listed: Sequence[str], *, max_keep: Optional[int], keep_every_n_steps: Optional[int] = None,
           keep_best: int = 0, best_metric: Optional[str] = None, best_mode: str = "max",
           step_of: Callable[[str], Optional[int]] = lambda ckpt: None,
           metrics_of: Callable[[str], Optional[Mapping[str, float]]] = lambda ckpt: None,
           depends_on: Callable[[str], Iterable[str]] = lambda ckpt: ()) -> Dict[str, List[str]]:
    """The ids of `listed` (oldest first) to keep, mapped to why, in `listed` order.

    Reasons: ``latest`` (one of the `max_keep` newest; every one when max_keep is None),
    ``every_n_steps`` (the checkpoint with the lowest step in its window of `keep_every_n_steps`
    steps, ``[k*n, (k+1)*n)``: with saves at multiples of n, every such one), ``best`` (one of the
    `keep_best` checkpoints with the highest, or with best_mode "min" the lowest, value of metric
    `best_metric`; ties go to the newer one; checkpoints without that metric never count) and
    ``needed by <id>`` (a kept checkpoint depends on it: `depends_on`, followed transitively; ids
    that are not listed are ignored). `step_of` and `metrics_of` are called only when a rule
    needs them."""
    reasons: Dict[str, List[str]] = {}

    def add(ckpt: str, why: str) -> None:
        if why not in reasons.setdefault(ckpt, []):
            reasons[ckpt].append(why)

    newest = listed if max_keep is None else (listed[-max_keep:] if max_keep > 0 else [])
    for ckpt in newest:
        add(ckpt, LATEST)
    if keep_every_n_steps:
        first_of_window: Dict[int, tuple] = {}
        for pos, ckpt in enumerate(listed):
            step = step_of(ckpt)
            if step is None:
                continue
            window = step // keep_every_n_steps
            if window not in first_of_window or (step, pos) < first_of_window[window]:
                first_of_window[window] = (step, pos)
        for _, pos in first_of_window.values():
            add(listed[pos], EVERY_N_STEPS)
    if keep_best and best_metric is not None:
        scored = []
        for pos, ckpt in enumerate(listed):
            value = (metrics_of(ckpt) or {}).get(best_metric)
            if is_finite_number(value):
                scored.append((value if best_mode == "max" else -value, pos))
        for _, pos in sorted(scored, reverse=True)[:keep_best]:
            add(listed[pos], BEST)
    on_list = set(listed)
    todo = [c for c in listed if c in reasons]
    while todo:
        ckpt = todo.pop()
        for parent in depends_on(ckpt):
            if parent in on_list and parent != ckpt:
                fresh = parent not in reasons
                add(parent, f"needed by {ckpt}")
                if fresh:
                    todo.append(parent)
    return {c: reasons[c] for c in listed if c in reasons}


def select_by(listed: Sequence[str], policy: Retention, *,
              step_of: Callable[[str], Optional[int]] = lambda ckpt: None,
              metrics_of: Callable[[str], Optional[Mapping[str, float]]] = lambda ckpt: None,
              depends_on: Callable[[str], Iterable[str]] = lambda ckpt: ()) -> Dict[str, List[str]]:
    """`select` with the settings of `policy`."""
    return select(listed, max_keep=policy.max_keep, keep_every_n_steps=policy.keep_every_n_steps,
                  keep_best=policy.keep_best, best_metric=policy.best_metric, best_mode=policy.best_mode,
                  step_of=step_of, metrics_of=metrics_of, depends_on=depends_on)


def recorded(storage: Storage, output_dir: str, ids: Sequence[str],
             depends_on: Callable[[str], Iterable[str]] = lambda ckpt: ()) -> Dict[str, List[str]]:
    """The selection `select` makes among the committed `ids` of output_dir (oldest first) under the
    policy recorded in the latest one's index (what `recsave ls` shows and `recsave gc` keeps).
    Without a recorded policy (a plain Saver's max_keep, or an index that cannot be read) every id
    is kept as ``latest``: the `checkpoint` file lists what that writer kept."""
    indexes: Dict[str, Optional[Index]] = {}

    def index_of(ckpt: str) -> Optional[Index]:
        if ckpt not in indexes:  # gone, damaged or newer: None; unreadable here: raises (gc deletes nothing)
            indexes[ckpt] = index_mod.read_for_retention(storage.join(output_dir, ckpt), storage)
        return indexes[ckpt]

    # The callers pass ids whose index exists (gc drops stale ids first; ls leaves them out): a
    # latest index that is damaged or a newer recsave's names no policy here, and all are kept.
    latest = index_of(ids[-1]) if ids else None
    policy = latest.retention if latest is not None and latest.retention is not None else Retention(None)

    def step_of(ckpt: str) -> Optional[int]:
        index = index_of(ckpt)
        return index.step if index is not None else None

    def metrics_of(ckpt: str) -> Optional[Mapping[str, float]]:
        index = index_of(ckpt)
        return index.metrics if index is not None else None

    return select_by(ids, policy, step_of=step_of, metrics_of=metrics_of, depends_on=depends_on)


def check_policy(where: str, *, keep_every_n_steps: Any, keep_best: Any, best_metric: Any,
                 best_mode: Any) -> None:
    """Raises UsageError for retention settings of the right types but wrong values."""
    if keep_every_n_steps is not None and keep_every_n_steps < 1:
        raise UsageError(f"{where}: keep_every_n_steps must be an int >= 1 or None, got {keep_every_n_steps!r}")
    if keep_best < 0:
        raise UsageError(f"{where}: keep_best must be an int >= 0 (0: keep no best), got {keep_best!r}")
    if keep_best and not best_metric:
        raise UsageError(f"{where}: keep_best={keep_best} needs best_metric, the name of a metric passed "
                         f"to step(metrics=...) / save(metrics=...)")
    if best_mode not in BEST_MODES:
        raise UsageError(f"{where}: best_mode must be one of {BEST_MODES}, got {best_mode!r}")


def check_metrics(where: str, metrics: Any) -> Optional[Dict[str, float]]:
    """A copy of `metrics` (a dict of str -> finite int / float), or None. ArgumentTypeError /
    UsageError otherwise: the index stores them as JSON numbers."""
    check(metrics, dict, "metrics", where, optional=True, expected="a dict of metric name -> float")
    if metrics is None:
        return None
    out: Dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise UsageError(f"{where}: metric names must be non-empty strings, got {name!r}", key="metrics")
        if not is_finite_number(value):
            raise UsageError(f"{where}: metric {name!r} must be a finite int or float (an int within "
                             f"float range), got {value!r}", key=name)
        out[name] = value
    return out
