"""Lightning integration: a Callback that autosaves and restores a LightningModule through a
CheckpointManager (public path ``recsave.lightning``; needs ``pip install recsave[lightning]``).

What a checkpoint holds beyond the Saver's model, sparse optimizer, extras and io states: one
optional extra (``lightning`` by default) with Lightning's fit-loop progress (global step, epoch,
batch index within the epoch), the Trainer's dense optimizers and its LR schedulers. A resumed
``fit`` therefore continues at the batch after the one saved, not at the start of the epoch. Where
the *data* continues is the job of the user's reader / sampler, registered as io state
(``Saver.register_io_state``): docs/API.md section 9 shows the pattern.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Dict, List, Optional

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("recsave.lightning needs the `lightning` package: pip install 'recsave[lightning]' "
                      "(or pip install lightning)") from exc

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from recsave.argcheck import check
from recsave.errors import Preempted, UsageError
from recsave.manager import CheckpointManager
from recsave.storage import dist

__all__ = ["RecsaveCallback", "LIGHTNING_STATE"]

log = logging.getLogger("recsave")

LIGHTNING_STATE = "lightning"


class _TrainerState:
    """The Trainer's loop progress, optimizers and LR schedulers as one registered extra. It reads
    the Trainer of the running fit when saved, and writes into it when loaded."""

    def __init__(self, callback: "RecsaveCallback"):
        self._callback = callback

    def _trainer(self) -> "pl.Trainer":
        trainer = self._callback.trainer
        if trainer is None:
            raise UsageError("the recsave Lightning callback is not attached to a running Trainer.fit; "
                             "save and restore through it from inside fit (or give restore=False)")
        return trainer

    def state_dict(self) -> Dict[str, Any]:
        trainer = self._trainer()
        return {
            "fit_loop": trainer.fit_loop.state_dict(),
            "optimizers": [o.state_dict() for o in trainer.optimizers],
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        trainer = self._trainer()
        if not isinstance(state, dict) or not {"fit_loop", "optimizers", "lr_schedulers"} <= set(state):
            raise UsageError(f"saved {self._callback.name!r} state is not a recsave Lightning state "
                             f"(keys {sorted(state) if isinstance(state, dict) else type(state).__name__})",
                             key=self._callback.name)
        optimizers, schedulers = trainer.optimizers, trainer.lr_scheduler_configs
        if len(state["optimizers"]) != len(optimizers) or len(state["lr_schedulers"]) != len(schedulers):
            raise UsageError(f"the checkpoint holds {len(state['optimizers'])} optimizer(s) and "
                             f"{len(state['lr_schedulers'])} LR scheduler(s), configure_optimizers returned "
                             f"{len(optimizers)} and {len(schedulers)}; restore into the same setup",
                             key=self._callback.name)
        for opt, s in zip(optimizers, state["optimizers"]):
            opt.load_state_dict(s)
        for config, s in zip(schedulers, state["lr_schedulers"]):
            config.scheduler.load_state_dict(s)
        trainer.fit_loop.load_state_dict(state["fit_loop"])


class RecsaveCallback(pl.Callback):
    """Saves and restores a Lightning fit through a CheckpointManager (docs/API.md section 9).

    ``Trainer(callbacks=[RecsaveCallback(manager)])`` where ``manager = CheckpointManager(Saver(module,
    sparse_optim=..., output_dir=...), save_interval=N)``:

    - ``on_fit_start``: restores the latest committed checkpoint (or ``ckpt_<global_step>`` when
      `global_step` is given): tables, sparse and dense optimizers, LR schedulers, extras, io states
      and Lightning's loop counters, so fit continues at the next batch, through
      ``manager.restore`` on every rank (where the ranks agree whether there is a checkpoint).
      Nothing to restore: a fresh start. With ``restore=False``, or when ``Trainer.fit`` was given
      a ``ckpt_path`` (Lightning restores that file), it does not restore.
    - ``on_train_batch_end``: at each new global step, the manager's ``step()``: saves
      ``ckpt_<trainer.global_step>`` at multiples of save_interval or after save_interval_seconds
      (the manager's async_mode applies), and after a preemption signal saves, waits and raises
      ``recsave.Preempted`` (exit 143); a batch without an optimizer step (gradient
      accumulation) acts on a preemption signal too.
    - ``on_validation_batch_end`` / ``on_validation_end`` (during fit, in a single process): the
      same for a preemption signal that arrives while validation runs.
    - With ``monitor`` (a metric name, as ModelCheckpoint's): ``on_validation_end`` of a fit (not
      the sanity check) saves ``ckpt_<trainer.global_step>`` with ``metrics={monitor: value}``
      from ``trainer.callback_metrics``, which the manager's keep_best ranks (its best_metric and
      best_mode; a different best_metric is a UsageError). The autosave of a step that validation
      follows is left to that save (taken by the next hook where no validation ends). A metric
      not logged raises UsageError; a NaN / inf one saves without metrics (never ranked best).
    - ``on_train_end``: saves the final step (``save_on_train_end``) and waits for the write.
    - ``on_exception``: on Lightning's SIGTERMException (its stop on SIGTERM where no hook of this
      callback follows, e.g. after the module's ``on_train_epoch_end``), in a single process,
      saves the preempted state and sets the exit status to 143.
    - ``on_exception`` / ``teardown`` of the fit: waits for a background write, then closes the
      Saver (its writer lock released; the next save takes it again), so a fit retried in this
      process with a new Saver of the same output dir can write.

    The Trainer's optimizers and schedulers are saved by the callback (extra `name`); a sparse
    optimizer belongs to the Saver (``Saver(..., sparse_optim=...)``). Sparse optimizers are not
    torch optimizers, so step them with manual optimization (``self.automatic_optimization = False``,
    see docs/API.md section 9).
    """

    def __init__(self, manager: CheckpointManager, *, restore: bool = True, global_step: Optional[int] = None,
                 save_on_train_end: bool = True, fallback: bool = True, name: str = LIGHTNING_STATE,
                 monitor: Optional[str] = None):
        check(manager, CheckpointManager, "manager", "RecsaveCallback", expected="a recsave.CheckpointManager")
        check(restore, bool, "restore", "RecsaveCallback")
        check(global_step, int, "global_step", "RecsaveCallback", optional=True)
        check(save_on_train_end, bool, "save_on_train_end", "RecsaveCallback")
        check(fallback, bool, "fallback", "RecsaveCallback")
        check(name, str, "name", "RecsaveCallback")
        check(monitor, str, "monitor", "RecsaveCallback", optional=True)
        _check_monitor(manager, monitor)
        self.manager, self.monitor = manager, monitor
        self.restore, self.global_step, self.fallback = restore, global_step, fallback
        self.save_on_train_end, self.name = save_on_train_end, name
        self.trainer: Optional[pl.Trainer] = None
        self.restored_step: Optional[int] = None  # the global step restored by the last fit, if any
        self.saved: List[str] = []  # checkpoint paths saved during the last fit
        # The global step whose autosave on_train_batch_end left to the validation it predicted,
        # until that validation's end saves it (or a later hook finds it did not end).
        self._left_to_validation: Optional[int] = None
        # Optional: a checkpoint of a plain Saver / CheckpointManager still restores (loop from 0).
        manager.register_for_checkpointing(name, _TrainerState(self), optional=True)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer, self.saved, self.restored_step = trainer, [], None
        self._left_to_validation = None
        if not self.restore:
            return
        if trainer.ckpt_path is not None:
            # fit(ckpt_path=...) restores that file: Lightning loads its model state before this hook
            # and its optimizers and loop after it, so restoring here too would mix two checkpoints.
            log.info("%s: not restoring, Trainer.fit restores %s", self.manager.saver.output_dir, trainer.ckpt_path)
            return
        # restore() on every rank, also when nothing is saved yet (it then returns 0 and changes
        # nothing): the ranks agree there whether there is a checkpoint, and a rank whose listing
        # fails makes every rank raise naming it (a look at this rank's list alone skipped the
        # agreement, and a rank that found none went on unrestored beside restored ones).
        before = self.manager.last_report
        step = self.manager.restore(self.global_step, fallback=self.fallback)
        report = self.manager.last_report
        if report is before:
            return  # nothing saved yet: a fresh start
        self.restored_step = step
        if report is not None and self.name in report.skipped:
            log.info("%s: restored without Lightning loop state (the checkpoint has no %r); the fit "
                     "loop starts at epoch 0", self.manager.saver.output_dir, self.name)
            # The manager's steps follow the Trainer's, which start at 0 again: left at the
            # restored step, a first batch without an optimizer step (gradient accumulation) set
            # global_step to -1 (UsageError).
            self.manager.global_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self.manager.global_step:
            # No optimizer step in this batch (gradient accumulation), or saved already. Lightning
            # still ends the fit right after this batch on SIGTERM (exit 0, nothing saved): act on
            # a preemption here too. Every rank runs the same training batches, so the check (a
            # collective) stays in step. It saves ckpt_<step>: the autosave of that step if there
            # is one (the resumed fit replays the batches since), else the state now.
            if self.manager.save_on_preemption:
                self.manager.check_preemption()
            return
        if self.monitor is not None and _validates_after_this_batch(trainer):
            # Validation's end saves ckpt_<step> with the monitored metric: an autosave here would
            # take that id first, and an index never changes (the metric then went unrecorded).
            # That save also restarts save_interval_seconds; a preemption is acted on now, at the
            # point where step() would have agreed on it with the other ranks.
            self.manager.global_step = step
            self._left_to_validation = step
            if self.manager.save_on_preemption:
                self.manager.check_preemption()
            return
        self._autosave(step)

    def _autosave(self, step: int) -> None:
        """What the manager's step() decides for global step `step`, reached by the last batch."""
        # The manager's own step() decides, as in a plain loop: save_interval, save_interval_seconds
        # and a preemption signal (save ckpt_<step>, wait, raise Preempted: exit 143).
        self.manager.global_step = step - 1
        path = self.manager.step()
        if path is not None:
            self.saved.append(path)

    def _autosave_unless_validated(self) -> None:
        """The autosave left to a validation that ended without saving: Lightning decided against
        it after all, or ran none (a validation loader with no batches skips every hook, the end's
        too), so without this each such step's autosave (every one, where save_interval is a
        multiple of the validation interval) was lost. Called by the next hook of the fit, before
        any training: the model still holds that step's state."""
        step, self._left_to_validation = self._left_to_validation, None
        if step is not None and self.trainer is not None and self.trainer.global_step == step:
            self._autosave(step)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._autosave_unless_validated()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._autosave_unless_validated()

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        # Validation can run for minutes; Lightning ends it on SIGTERM right after this hook (exit
        # 0, nothing saved): the manager saves the state first and raises Preempted (exit 143).
        self._preempted_in_validation(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._save_monitored(trainer)
        # A signal after the last batch's hook (e.g. in on_validation_epoch_end) is acted on by the
        # training loop right after validation, before the next on_train_batch_end.
        self._preempted_in_validation(trainer)

    def _save_monitored(self, trainer: pl.Trainer) -> None:
        """Saves ckpt_<global step> recording the monitored metric (every rank: a collective)."""
        self.manager.global_step = trainer.global_step
        self._left_to_validation = None  # saved here, with the metric (or raising)
        path = self.manager.save(wait=False, metrics=self._monitored(trainer))
        if path not in self.saved:
            self.saved.append(path)

    def _monitored(self, trainer: pl.Trainer) -> Optional[Dict[str, float]]:
        """{monitor: value} from trainer.callback_metrics; None for a NaN / inf value. UsageError
        on every rank when a rank lacks the metric (raised on one rank alone, the others would
        wait in the save's collectives)."""
        assert self.monitor is not None
        value = trainer.callback_metrics.get(self.monitor)
        missing = dist.max_over_ranks([int(value is None)], dist.group()[1],
                                      f"RecsaveCallback: agreeing whether {self.monitor!r} was logged")[0]
        if missing:
            raise UsageError(f"RecsaveCallback(monitor={self.monitor!r}): the validation that ended at global "
                             f"step {trainer.global_step} logged no {self.monitor!r}"
                             f"{'' if value is None else ' on another rank'} (trainer.callback_metrics has "
                             f"{sorted(trainer.callback_metrics)}); log it with self.log({self.monitor!r}, "
                             f"...) in validation_step or on_validation_epoch_end, or monitor a logged metric",
                             key="monitor")
        number = _scalar(self.monitor, value)
        if not math.isfinite(number):
            log.warning("%s: %s is %s at global step %d: ckpt_%d is saved without metrics (keep_best never "
                        "keeps it as best)", self.manager.saver.output_dir, self.monitor, number,
                        trainer.global_step, trainer.global_step)
            return None
        return {self.monitor: number}

    def _preempted_in_validation(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking or not self.manager.save_on_preemption:
            return  # (trainer.validate() outside a fit has nothing of a fit to save)
        if dist.group()[1] > 1:
            # check_preemption is a collective: ranks may run different numbers of validation
            # batches, and a mismatched collective would hang the fit. Several ranks rely on the
            # training loop's check (Lightning broadcasts rank 0's SIGTERM there).
            return
        self.manager.global_step = trainer.global_step
        self.manager.check_preemption()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._autosave_unless_validated()
        self.manager.global_step = trainer.global_step
        if self.save_on_train_end and trainer.global_step > 0:
            path = self.manager.save(wait=True)
            if path not in self.saved:
                self.saved.append(path)
        else:
            self.manager.wait()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            if isinstance(exception, SIGTERMException):
                self._save_at_sigterm_stop(trainer, exception)
        finally:
            try:  # let a background write of the last autosave finish; the fit's own error is what counts
                self.manager.wait()
            except Exception as exc:  # reported as a warning: it must not hide `exception`
                log.warning("%s: the last background save failed too: %s", self.manager.saver.output_dir, exc)
            self._release()

    def _save_at_sigterm_stop(self, trainer: pl.Trainer, stop: SIGTERMException) -> None:
        """Lightning also stops a fit on SIGTERM where no hook of this callback follows the signal
        (after the module's on_train_epoch_end or on_validation_end, between batches), with exit
        status 0 and the state since the last save lost. The manager saves that state now and the
        status becomes Preempted's 143. Not raised from here: Lightning's other on_exception hooks,
        its loggers' finalize and its teardown still run before it re-raises `stop`."""
        if trainer.state.fn != "fit" or not self.manager.save_on_preemption or dist.group()[1] > 1:
            return  # several ranks may stop at different points: a collective save could hang
        self.manager.global_step = trainer.global_step
        try:
            self.manager.check_preemption()  # saves ckpt_<step> (or finds it saved) and raises
        except Preempted as preempted:
            stop.code = preempted.code

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.trainer = None
        if stage == "fit":
            self._release()

    def _release(self) -> None:
        """Releases the output dir's writer lock (Saver.close; the next save takes it again): a
        fit retried in this process with a new Saver of the same output dir (after an error
        caught around fit()) would otherwise meet WriterLockedError from this one, which the
        exception's traceback keeps alive."""
        try:
            self.manager.saver.close()
        except Exception as exc:  # a write already reported (on_train_end, on_exception waited for it)
            log.warning("%s: closing the Saver after the fit: %s", self.manager.saver.output_dir, exc)


def _check_monitor(manager: CheckpointManager, monitor: Optional[str]) -> None:
    """The metric saved must be the one keep_best ranks by (its best_mode gives the direction):
    another name leaves every checkpoint unranked, and keep_best keeps none."""
    if monitor == "":
        raise UsageError("RecsaveCallback: monitor must be a metric name or None, got ''", key="monitor")
    retention = manager.saver.retention
    if not retention.keep_best:
        return
    if monitor is None:
        warnings.warn(f"RecsaveCallback: the manager keeps the {retention.keep_best} best checkpoints by "
                      f"{retention.best_metric!r}, but no monitor is given, so no save of the fit records it; "
                      f"give monitor={retention.best_metric!r}", RuntimeWarning, stacklevel=3)
    elif monitor != retention.best_metric:
        raise UsageError(f"RecsaveCallback: monitor={monitor!r}, but the manager's keep_best ranks by "
                         f"{retention.best_metric!r}; give monitor={retention.best_metric!r}, or "
                         f"best_metric={monitor!r} to the CheckpointManager", key="monitor")


def _validates_after_this_batch(trainer: pl.Trainer) -> bool:
    """Whether Lightning runs validation right after the training batch that just ended: its own
    decision, from its training loop (private API, tested with Lightning 2.6; elsewhere False, and
    a step autosaved before validation cannot record the metric: the manager warns)."""
    loop, fetcher = trainer.fit_loop.epoch_loop, getattr(trainer.fit_loop, "_data_fetcher", None)
    try:
        validates = loop._should_check_val_fx(fetcher)  # type: ignore[arg-type]  # noqa: SLF001 (see above)
        return bool(validates) and not loop._skip_next_val  # noqa: SLF001 (see above)
    except (AttributeError, TypeError):
        return False


def _scalar(name: str, value: Any) -> float:
    """A logged metric (a one-element tensor or a number) as a float."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UsageError(f"RecsaveCallback: monitored metric {name!r} is a tensor of shape "
                             f"{tuple(value.shape)}; log a scalar", key="monitor")
        return float(value.item())
    return float(value)
