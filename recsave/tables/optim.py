"""Sparse (row-wise, lazy) optimizers for HashTable embeddings.

Each optimizer updates only the rows whose gradient arrived since the last ``zero_grad()``, exactly as
``torch.optim.SGD`` / ``Adagrad`` / ``SparseAdam`` update an ``nn.Embedding(sparse=True)``. Per-row
state (accumulators, moments) lives in the tables as *slots*, row-aligned with the embedding, so a
checkpoint of a table carries its optimizer state; only scalar state (hyper-parameters and per-table
step counts) lives in :meth:`SparseOptimizer.state_dict`, as plain Python values that
``torch.load(weights_only=True)`` accepts.
"""
from __future__ import annotations

import abc
import math
import numbers
from typing import Any, Callable, ClassVar, Dict, Iterable, Optional, Tuple, Union

import torch

from recsave.argcheck import check
from recsave.argcheck import fail as type_error
from recsave.errors import ConfigError, UsageError
from recsave.tables.hashtable import HashTable

__all__ = ["SparseOptimizer", "SparseSGD", "SparseAdagrad", "SparseAdam"]

TablesArg = Union[torch.nn.Module, HashTable, Iterable[HashTable]]


_TABLES = "an nn.Module, a HashTable or an iterable of HashTables"


def _collect_tables(model_or_tables: TablesArg, where: str) -> Dict[str, HashTable]:
    """name -> table. Names are the tables' own names, else their attribute path in the model (the
    names split_sparse_dense_state_dict gives them, so optimizer state and checkpoints line up)."""
    if isinstance(model_or_tables, HashTable):
        found = [(model_or_tables.table_name, model_or_tables)]
    elif isinstance(model_or_tables, torch.nn.Module):
        found = [(m.table_name or path, m) for path, m in model_or_tables.named_modules()
                 if isinstance(m, HashTable)]
    else:
        try:
            items = list(model_or_tables)
        except TypeError:
            raise type_error(where, "model_or_tables", _TABLES, model_or_tables) from None
        for t in items:
            if not isinstance(t, HashTable):
                error = type_error(where, "model_or_tables", _TABLES, t)
                raise type(error)(f"{error} in the iterable", key=error.key)
        found = [(t.table_name, t) for t in items]
    tables: Dict[str, HashTable] = {}
    for name, table in found:
        if not name:
            raise UsageError("a HashTable passed without a model has no name; create it with "
                             "HashTable(dim, name=...) or pass the model that holds it")
        if name in tables and tables[name] is not table:
            raise UsageError(f"two different HashTables are both named {name!r}; give them distinct names",
                             key=name)
        tables[name] = table
    if not tables:
        raise UsageError(f"{type(model_or_tables).__name__} holds no HashTable: a sparse optimizer needs at "
                         "least one table (use a torch.optim optimizer for dense parameters)")
    return tables


def _check(ok: bool, what: str, value: Any) -> None:
    if not ok:
        raise UsageError(f"invalid {what}: {value!r}")


def _is_num(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class SparseOptimizer(abc.ABC):
    """Base class: table bookkeeping, step counting, state_dict. Subclasses implement ``_update``.

    Attributes:
        tables: name -> HashTable this optimizer updates.
        hparams: hyper-parameters (may be changed between steps, e.g. by an lr schedule).
        steps: name -> number of steps in which that table had a gradient (torch counts per param).
    """

    slot_names: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, model_or_tables: TablesArg, hparams: Dict[str, Any]):
        where = type(self).__name__
        for key, value in hparams.items():
            if key == "betas":
                check(value, tuple, key, where, expected="a tuple of two real numbers")
                for b in value:
                    check(b, numbers.Real, key, where, expected="a tuple of two real numbers")
            else:
                check(value, numbers.Real, key, where)
        self._validate(hparams, UsageError)
        self.tables: Dict[str, HashTable] = _collect_tables(model_or_tables, where)
        self.hparams: Dict[str, Any] = dict(hparams)
        self.steps: Dict[str, int] = {name: 0 for name in self.tables}
        # Slots are created now (not on first step) so a checkpoint taken at any time has them.
        for table in self.tables.values():
            for slot, init in self._slot_inits().items():
                table.add_slot(slot, init)

    # --------------------------------------------------------------------------------- hooks
    @classmethod
    def _validate(cls, hp: Dict[str, Any], error: type) -> None:
        """Raises ``error`` for an invalid hyper-parameter (UsageError when constructing,
        ConfigError when loading a state_dict)."""
        try:
            _check(_is_num(hp["lr"]) and hp["lr"] >= 0, "learning rate (must be >= 0)", hp["lr"])
            for key in ("eps", "weight_decay", "lr_decay", "initial_accumulator_value"):
                if key in hp:
                    _check(_is_num(hp[key]) and hp[key] >= 0, f"{key} (must be >= 0)", hp[key])
        except UsageError as e:
            raise error(f"{cls.__name__}: {e}") from None

    def _slot_inits(self) -> Dict[str, float]:
        return {}

    def _hp(self) -> Dict[str, Any]:
        """`hparams` as plain numbers for an update: torch's ops take a 0-d tensor as a scalar but
        refuse a one-element tensor or numpy array of another shape (an lr torch.optim accepts)."""
        return {k: _plain(v) for k, v in self.hparams.items()}

    @abc.abstractmethod
    def _update(self, table: HashTable, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """Applies one step to the unique ascending ``rows`` with their summed gradient ``grad``."""

    # ----------------------------------------------------------------------------------- API
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Updates the rows touched since the last zero_grad(); returns closure() if given."""
        if closure is not None and not callable(closure):
            raise type_error(f"{type(self).__name__}.step", "closure", "a callable or None", closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for name, table in self.tables.items():
            coalesced = table.grad_for_step()
            if coalesced is None:  # like torch: a param whose .grad is None keeps its step count
                continue
            self.steps[name] += 1
            rows, grad = coalesced
            if rows.numel():
                self._update(table, rows, grad.to(table.dtype), self.steps[name])
                table.mark_rows_changed(rows)
            table.advance_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the tables' accumulated row gradients."""
        for table in self.tables.values():
            table.zero_grad()

    def state_dict(self) -> Dict[str, Any]:
        """Scalar state only (per-row state is in the tables' slots): plain ints/floats/tuples/dicts."""
        # hparams may have been set between steps to what step() takes but a strict load refuses (a
        # 0-dim tensor lr from a schedule, a list of betas): saved as plain numbers, or refused now
        # rather than in a restore that cannot be fixed any more.
        hparams = {k: _plain(v) for k, v in self.hparams.items()}
        self._validate(hparams, UsageError)
        return {"optimizer": type(self).__name__, "hparams": hparams, "steps": dict(self.steps)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores hyper-parameters and step counts. Tables absent from ``state_dict`` restart at
        step 0; names this optimizer does not know, or another optimizer's state, raise ConfigError."""
        me = type(self).__name__
        if not isinstance(state_dict, dict) or set(state_dict) != {"optimizer", "hparams", "steps"}:
            raise ConfigError(f"{me}.load_state_dict: expected a dict with keys optimizer, hparams, steps "
                              f"(from {me}.state_dict()), got {_describe(state_dict)}")
        if state_dict["optimizer"] != me:
            raise ConfigError(f"{me}.load_state_dict: the state is from a {state_dict['optimizer']!r}; "
                              f"construct a {state_dict['optimizer']} to resume it, or do not load it")
        hp, steps = state_dict["hparams"], state_dict["steps"]
        if not isinstance(hp, dict) or set(hp) != set(self.hparams):
            raise ConfigError(f"{me}.load_state_dict: hyper-parameters {_describe(hp)} do not match the "
                              f"expected {sorted(self.hparams)}")
        hp = {k: _plain(v) for k, v in hp.items()}  # as state_dict() gives them (a state from JSON: lists)
        self._validate(hp, ConfigError)
        unknown = sorted(set(steps) - set(self.tables), key=str) if isinstance(steps, dict) else None
        if unknown is None or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in steps.values()):
            raise ConfigError(f"{me}.load_state_dict: 'steps' must map table names to ints >= 0, got "
                              f"{_describe(steps)}")
        if unknown:
            raise ConfigError(f"{me}.load_state_dict: the state has tables {unknown} that this optimizer "
                              f"does not have (it has {sorted(self.tables)}); rename the tables or drop "
                              f"them from the state", key=unknown[0])
        self._check_compatible(hp)
        self.hparams = dict(hp)
        self.steps = {name: int(steps.get(name, 0)) for name in self.tables}

    def _check_compatible(self, hp: Dict[str, Any]) -> None:  # noqa: B027 (an optional hook)
        """Hook: refuse loaded hyper-parameters that the existing slots cannot honour."""

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self.hparams.items())
        return f"{type(self).__name__}(tables={sorted(self.tables)}, {hp})"


def _plain(value: Any) -> Any:
    """A hyper-parameter as plain Python: one-element tensors and numpy scalars (an lr a schedule
    computed with numpy: `torch.load(weights_only=True)` refuses numpy objects) as int / float,
    sequences as tuples."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, torch.Tensor) and value.dim() == 1:  # e.g. betas as a tensor
        return tuple(_plain(v) for v in value.tolist())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if getattr(value, "ndim", None) == 1 and getattr(value, "size", 0) > 1 and callable(getattr(value, "tolist", None)):
        return tuple(_plain(v) for v in value.tolist())  # a 1-d numpy array, e.g. betas
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    item = getattr(value, "item", None)  # a one-element numpy array
    if callable(item) and getattr(value, "size", None) == 1 and not isinstance(value, (str, bytes)):
        return _plain(item())
    return value


def _describe(x: Any) -> str:
    return f"{sorted(x, key=str)!r}" if isinstance(x, dict) else type(x).__name__


class SparseSGD(SparseOptimizer):
    """``w[r] -= lr * (g[r] + weight_decay * w[r])`` for touched rows r.

    With weight_decay=0 this is ``torch.optim.SGD`` on ``nn.Embedding(sparse=True)``. torch refuses
    weight decay with sparse gradients; here it is lazy (applied to touched rows only), which equals
    dense torch SGD whenever every row is touched each step.
    """

    def __init__(self, model_or_tables: TablesArg, lr: float, weight_decay: float = 0.0):
        super().__init__(model_or_tables, {"lr": lr, "weight_decay": weight_decay})

    def _update(self, table: HashTable, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        hp, weight = self._hp(), table.weight
        if hp["weight_decay"]:
            grad = grad.add(weight[rows], alpha=hp["weight_decay"])
        weight.index_add_(0, rows, grad, alpha=-hp["lr"])  # rows are unique: a plain update


class SparseAdagrad(SparseOptimizer):
    """``torch.optim.Adagrad`` with sparse gradients; the accumulator is the slot ``adagrad_acc``.

    ``acc[r] += g[r]**2; w[r] -= clr * g[r] / (sqrt(acc[r]) + eps)`` with
    ``clr = lr / (1 + (step - 1) * lr_decay)`` and a per-table step. weight_decay is lazy as in
    :class:`SparseSGD` (torch refuses it with sparse gradients).
    """

    slot_names = ("adagrad_acc",)

    def __init__(self, model_or_tables: TablesArg, lr: float = 0.01, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0, eps: float = 1e-10):
        super().__init__(model_or_tables, {"lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay,
                                           "initial_accumulator_value": initial_accumulator_value, "eps": eps})

    def _slot_inits(self) -> Dict[str, float]:
        return {"adagrad_acc": float(self.hparams["initial_accumulator_value"])}

    def _check_compatible(self, hp: Dict[str, Any]) -> None:
        # The value seeds rows inserted later (the slot's init), which is fixed when the slot is made.
        if hp["initial_accumulator_value"] != self.hparams["initial_accumulator_value"]:
            raise ConfigError(f"SparseAdagrad.load_state_dict: the state was made with initial_accumulator_"
                              f"value={hp['initial_accumulator_value']!r}, this optimizer uses "
                              f"{self.hparams['initial_accumulator_value']!r}; construct it with the saved value")

    def _update(self, table: HashTable, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        hp, weight, acc = self._hp(), table.weight, table.slot("adagrad_acc")
        if hp["weight_decay"]:
            grad = grad.add(weight[rows], alpha=hp["weight_decay"])
        clr = hp["lr"] / (1 + (step - 1) * hp["lr_decay"])
        acc.index_add_(0, rows, grad.pow(2))
        std = acc[rows].sqrt_().add_(hp["eps"])  # same operation order as torch, for bitwise-close results
        weight.index_add_(0, rows, grad / std, alpha=-clr)


class SparseAdam(SparseOptimizer):
    """``torch.optim.SparseAdam`` (lazy Adam): moments are the slots ``adam_m`` / ``adam_v``, updated
    only for touched rows; bias correction uses the table's step count, which advances only on
    steps where the table had a gradient."""

    slot_names = ("adam_m", "adam_v")

    def __init__(self, model_or_tables: TablesArg, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        super().__init__(model_or_tables, {"lr": lr, "betas": tuple(betas) if isinstance(betas, (tuple, list))
                                           else betas, "eps": eps})

    @classmethod
    def _validate(cls, hp: Dict[str, Any], error: type) -> None:
        super()._validate(hp, error)
        betas = hp["betas"]
        if not (isinstance(betas, tuple) and len(betas) == 2 and all(_is_num(b) and 0 <= b < 1 for b in betas)):
            raise error(f"SparseAdam: invalid betas {betas!r}: need two numbers in [0, 1)")
        if not hp["eps"] > 0:  # as torch: eps=0 divides 0 by 0 for a row whose gradients were all 0
            raise error(f"SparseAdam: invalid eps {hp['eps']!r}: must be > 0")

    def _slot_inits(self) -> Dict[str, float]:
        return {"adam_m": 0.0, "adam_v": 0.0}

    def _update(self, table: HashTable, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        hp = self._hp()
        beta1, beta2 = hp["betas"]
        weight, exp_avg, exp_avg_sq = table.weight, table.slot("adam_m"), table.slot("adam_v")
        # The operation order follows torch.optim._functional.sparse_adam.
        old_m, old_v = exp_avg[rows], exp_avg_sq[rows]
        m_update = grad.sub(old_m).mul_(1 - beta1)
        v_update = grad.pow(2).sub_(old_v).mul_(1 - beta2)
        exp_avg.index_add_(0, rows, m_update)
        exp_avg_sq.index_add_(0, rows, v_update)
        numer = m_update.add_(old_m)
        denom = v_update.add_(old_v).sqrt_().add_(hp["eps"])
        step_size = hp["lr"] * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        weight.index_add_(0, rows, numer.div_(denom).mul_(-step_size))
