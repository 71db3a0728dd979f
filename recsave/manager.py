"""CheckpointManager: autosave every N steps or seconds, save and exit on preemption, retention,
restore by global step, warm start from a model bank."""
from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
import signal
import time
import warnings
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from recsave.argcheck import check
from recsave.errors import (
    ArgumentTypeError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    Preempted,
    RecsaveError,
    UsageError,
)
from recsave.format import index as index_mod
from recsave.format import retention
from recsave.load import config as load_config
from recsave.load.config import CATEGORIES
from recsave.load.execute import names_executed
from recsave.load.plan import LoadPlan
from recsave.load.report import LoadReport
from recsave.save import background, policy
from recsave.save.pipeline import step_of_id
from recsave.save.preemption import PreemptionFlag
from recsave.save.saveinfo import SaveInfo
from recsave.save.saver import Saver
from recsave.storage import dist, get_storage

GLOBAL_STEP = "global_step"
ASYNC_MODES = ("disabled", "async", "async_pinned")
EVICT_KEYS = ("older_than_steps", "min_count")


class _StepState:
    """The manager's global step as a registered extra (saved in extra.pt)."""

    def __init__(self, manager: "CheckpointManager"):
        self._manager = manager

    def state_dict(self) -> Dict[str, int]:
        return {"global_step": self._manager.global_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        step = state.get("global_step") if isinstance(state, dict) else None
        if not isinstance(step, int) or step < 0:
            raise UsageError(f"saved global_step {step!r} is not a non-negative int")
        self._manager.global_step = step


def _keeping_own_step(entries: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Bank entries with the manager's ``global_step`` extra added to ``exclude``, except where an
    entry's ``load`` names it; anything not a list of dicts is passed on for the bank's own checks."""
    if not isinstance(entries, (list, tuple)):
        return entries  # type: ignore[return-value]  # refused by the Saver with ArgumentTypeError
    out: List[Dict[str, Any]] = []
    for entry in entries:
        if isinstance(entry, dict):
            load, exclude = _items(entry.get("load", ["*"])), _items(entry.get("exclude", []))
            # A pattern that selects it names it too (["global_*"]); a category ("*", "extra") does not.
            named = isinstance(load, (list, tuple)) and any(
                isinstance(item, str) and item not in CATEGORIES and fnmatch.fnmatchcase(GLOBAL_STEP, item)
                for item in load)
            if not named and isinstance(exclude, (list, tuple)):
                entry = {**entry, "exclude": [*exclude, GLOBAL_STEP]}
        out.append(entry)
    return out


def _restores_whole(load_conf: Optional[Dict[str, Any]]) -> bool:
    """Whether a restore under `load_conf` leaves the model as the checkpoint holds it: the default
    settings (every name selected, no merge, rename or dim / dtype policy), save that io states may
    be left out (as on a restart with another number of workers: the next restart leaves them out
    again), and so may the manager's own step (set from the id). Any other setting may leave state
    of the model's own."""
    conf = load_config.parse(load_conf, where="restore")
    default = load_config.LoadConf()
    own_step_or_io = all(item in ("io_state", GLOBAL_STEP) for item in conf.exclude)
    return own_step_or_io and dataclasses.replace(conf, path=None, exclude=(), strict=default.strict) == default


def _items(value: Any) -> Any:
    """A `load` / `exclude` value as a list when it is one item (a string); else as given."""
    return [value] if isinstance(value, str) else value


class CheckpointManager:
    """Drives a Saver from the training loop. Checkpoint ids are ``ckpt_<global_step>``.

    Call step() once per training step (on every rank, in the same order). It saves every
    `save_interval` steps (0: not by steps) and, with `save_interval_seconds`, when that much time
    has passed since the last save by rank 0's `clock` (every rank follows rank 0's decision).
    `async_mode`: ``disabled`` saves synchronously; ``async`` makes autosaves Saver.async_save calls
    (training waits only for the snapshot); ``async_pinned`` also stages CUDA tensors in page-locked
    memory. Call wait() or close() at the end of training (save() waits by default).

    With `save_on_preemption` (default), SIGTERM and SIGUSR1 (handlers installed from the main
    thread, restored by close()) make the next step() or check_preemption() save on every rank,
    wait for the commit and raise recsave.Preempted (a SystemExit, code 143).

    Retention: besides the Saver's max_keep, `keep_every_n_steps` keeps the first checkpoint of
    every window of that many steps, and `keep_best` the ones with the best value of metric
    `best_metric` (passed to step(metrics=...) / save(metrics=...); `best_mode` "max" or "min").
    Given none of the four (all at their defaults), the manager keeps the Saver's
    (Saver.set_retention; call saver.set_retention() first to drop it).
    `clock` (default time.monotonic) exists for tests.
    """

    def __init__(self, saver: Saver, save_interval: int, *, async_mode: str = "disabled",
                 save_interval_seconds: Optional[float] = None, full_every: Optional[int] = None,
                 rebase_ratio: float = 0.3, keep_every_n_steps: Optional[int] = None, keep_best: int = 0,
                 best_metric: Optional[str] = None, best_mode: str = "max",
                 evict: Optional[Dict[str, int]] = None, save_on_preemption: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        where = "CheckpointManager"
        check(saver, Saver, "saver", where, expected="a recsave.Saver")
        check(save_interval, int, "save_interval", where)
        check(async_mode, str, "async_mode", where)
        check(save_interval_seconds, (int, float), "save_interval_seconds", where, optional=True)
        check(keep_every_n_steps, int, "keep_every_n_steps", where, optional=True)
        check(keep_best, int, "keep_best", where)
        check(best_metric, str, "best_metric", where, optional=True)
        check(best_mode, str, "best_mode", where)
        check(save_on_preemption, bool, "save_on_preemption", where)
        if not callable(clock):
            raise ArgumentTypeError(f"{where}: clock must be a callable returning seconds, got "
                                    f"{type(clock).__name__}", key="clock")
        if save_interval < 0:
            raise UsageError(f"save_interval must be an int >= 0 (0: no autosave), got {save_interval!r}")
        if async_mode not in ASYNC_MODES:
            raise UsageError(f"async_mode must be one of {ASYNC_MODES}, got {async_mode!r}")
        if save_interval_seconds is not None and not (math.isfinite(save_interval_seconds)
                                                      and save_interval_seconds > 0):
            raise UsageError(f"save_interval_seconds must be a number > 0 or None, got {save_interval_seconds!r}")
        retention.check_policy(where, keep_every_n_steps=keep_every_n_steps, keep_best=keep_best,
                               best_metric=best_metric, best_mode=best_mode)
        self.full_every, self.rebase_ratio, self.evict = _incremental_settings(full_every, rebase_ratio, evict)
        self.saver = saver
        self.async_mode = async_mode
        self.save_interval_seconds = save_interval_seconds
        if (keep_every_n_steps, keep_best, best_metric, best_mode) == (None, 0, None, "max"):
            # None given: the Saver's own (Saver.set_retention) stays. Reset to max_keep alone,
            # its next rotation would prune the checkpoints the user asked to keep.
            kept = saver.retention
            keep_every_n_steps, keep_best, best_metric, best_mode = \
                kept.keep_every_n_steps, kept.keep_best, kept.best_metric, kept.best_mode
        self.keep_every_n_steps, self.keep_best = keep_every_n_steps, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        self.save_on_preemption = save_on_preemption
        self.clock = clock
        self.preempted = False
        self._save_interval = save_interval
        self._global_step = 0
        # (checkpoint dir, global step) of the last restore: saving that step again returns it
        self._restored: Optional[Tuple[str, int, LoadReport]] = None  # path, step, the load's report
        # The checkpoint this manager saved at the current global step, with no step, restore or
        # load since: saving that step again returns it. (Not merely the latest listed id: after
        # restoring an earlier step and training back up to it, that id holds the abandoned branch.)
        self._saved: Optional[str] = None
        self._loads_at_save = 0  # saver.loads_started when _saved was set: a Saver load since forgets it
        # saver.commits_made and last_save when _saved was set: whether that save committed
        self._before_save: Tuple[int, Optional[SaveInfo]] = (0, None)
        self._saved_metrics: Optional[Dict[str, float]] = None  # the metrics _saved records
        # (entries, each entry's source version, each entry's checkpoint) of the last load_model_bank
        self._bank: Optional[Tuple[List[Dict[str, Any]], Dict[int, str], List[str]]] = None
        self._warned_unsaved_metrics = False
        self.last_report: Optional[LoadReport] = None
        # Optional: checkpoints of a plain Saver lack it, and still load (restore() then takes the
        # step from the checkpoint id).
        try:
            saver.register_for_checkpointing(GLOBAL_STEP, _StepState(self), optional=True)
        except UsageError as exc:  # "pick another name" would be advice the caller cannot follow
            raise UsageError(f"{where}: this Saver cannot take the manager's step as extra {GLOBAL_STEP!r} "
                             f"({exc}). A Saver serves one CheckpointManager: if another manager was made on "
                             f"it, make a new Saver for this one; else rename what of the model or of your "
                             f"registrations is called {GLOBAL_STEP!r}", key=GLOBAL_STEP) from exc
        saver.set_retention(keep_every_n_steps=keep_every_n_steps, keep_best=keep_best,
                            best_metric=best_metric, best_mode=best_mode)
        self._last_save_at = clock()
        self._preemption = PreemptionFlag()
        # A manager dropped without close() puts the previous handlers back when collected (on the
        # main thread: elsewhere signal handlers cannot be changed).
        weakref.finalize(self, self._preemption.uninstall)
        if save_on_preemption and not self._preemption.install():
            warnings.warn("CheckpointManager was created outside the main thread: SIGTERM / SIGUSR1 "
                          "handlers cannot be installed, so a preemption signal ends the process without a "
                          "save; create the manager on the main thread", RuntimeWarning, stacklevel=2)

    @property
    def global_step(self) -> int:
        return self._global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        check(value, int, "global_step", "CheckpointManager")
        if value < 0:
            raise UsageError(f"global_step must be an int >= 0, got {value!r}")
        if value != self._global_step:  # training may have run without step(): nothing holds the state
            self._saved = None
            self._restored = None  # (restore() records its checkpoint after setting the step)
        self._global_step = value

    @property
    def save_interval(self) -> int:
        return self._save_interval

    def register_for_checkpointing(self, name: str, obj: Any, optional: bool = False) -> None:
        """Saver.register_for_checkpointing (see there for `optional`)."""
        self.saver.register_for_checkpointing(name, obj, optional=optional)

    @property
    def last_save(self) -> Optional[SaveInfo]:
        """The Saver's last committed save (Saver.last_save)."""
        return self.saver.last_save

    def step(self, metrics: Optional[Mapping[str, float]] = None) -> Optional[str]:
        """Advances the global step; saves when it reaches a multiple of save_interval, or when
        save_interval_seconds have passed since the last save (rank 0's clock decides); returns the
        checkpoint path then, else None. `metrics` go into the checkpoint this step saves (on a step
        that does not save they are dropped, with a RuntimeWarning the first time unless
        save_interval_seconds is set). In an
        async mode the save is only started: training waits for the snapshot (and for the previous
        write, if it is still running).

        After a preemption signal on any rank, every rank saves, waits for the commit and raises
        Preempted. With several ranks, one small all_reduce per call carries rank 0's time decision
        and the preemption flags (none when only save_interval is used and save_on_preemption is off)."""
        values, refused = self._metrics("CheckpointManager.step", metrics, keep_refusal=True)
        if refused is not None and dist.group()[1] <= 1 and not (self.save_on_preemption and self._preemption.is_set):
            raise refused  # alone and not preempted: at once, the step not taken
        self._global_step += 1
        self._restored = None  # trained since: the restored checkpoint no longer holds the state
        self._saved = None
        by_steps = bool(self._save_interval) and self._global_step % self._save_interval == 0
        by_time, preempt = self._agree()
        if preempt:
            self._preempt(metrics if refused is not None else values)
        if by_steps or by_time:
            return self.save(wait=False, metrics=metrics if refused is not None else values)
        if refused is not None:  # no save: nothing collective follows
            raise refused
        if values and not self._warned_unsaved_metrics and self.save_interval_seconds is None:
            # Not kept for the next save: they describe this step's model, and keep_best would
            # rank a later checkpoint by them. (With time-based saves only step() knows whether
            # it saves: passing metrics on every step is then the way to have them stored.)
            self._warned_unsaved_metrics = True
            warnings.warn(f"CheckpointManager.step: metrics {sorted(values)} were passed on global step "
                          f"{self._global_step}, which does not save; only a saving step stores them "
                          f"(keep_best ranks checkpoints by them). Pass them on saving steps, or call "
                          f"save(metrics=...) after an evaluation. (Warned once per manager.)",
                          RuntimeWarning, stacklevel=2)
        return None

    def check_preemption(self) -> None:
        """For loops that run long without step() (e.g. evaluation): when any rank got a preemption
        signal, every rank saves ``ckpt_<global_step>``, waits for the commit and raises Preempted.
        Call it on every rank at the same points (it is a collective, like step())."""
        if self._agree(time_check=False)[1]:
            self._preempt(None)

    def _agree(self, time_check: bool = True) -> Tuple[bool, bool]:
        """(save now by time, preempted): rank 0's clock decides the first, any rank's signal the
        second; one all_reduce (MAX) of both when several ranks run."""
        interval = self.save_interval_seconds if time_check else None
        if interval is None and not self.save_on_preemption:
            return False, False
        rank, world = dist.group()  # alone: its own clock decides
        due = interval is not None and rank == 0 and self.clock() - self._last_save_at >= interval
        agreed = dist.max_over_ranks([int(due), int(self._preemption.is_set)], world,
                                     f"CheckpointManager step {self._global_step}: agreeing on a save")
        return bool(agreed[0]), bool(agreed[1])

    def _preempt(self, metrics: Any) -> None:
        self.preempted = True
        try:  # the last chance to save: refused metrics are dropped, not the save
            retention.check_metrics("CheckpointManager.step", metrics)
        except (ArgumentTypeError, UsageError) as exc:
            logging.getLogger("recsave").warning("recsave: the preemption save drops its metrics (%s)", exc)
            metrics = None
        try:  # a failed earlier background write must not cost the state the preemption save keeps
            self.wait()
        except Exception as exc:
            logging.getLogger("recsave").warning(
                "recsave: the background write before the preemption failed (%s: %s); saving global step %d "
                "now", type(exc).__name__, exc, self._global_step)
        path = self.save(wait=True, metrics=metrics)
        signum = self._preemption.signum
        why = f"signal {signal.Signals(signum).name}" if signum is not None else "another rank's preemption signal"
        message = (f"preempted ({why}): saved and committed {path} (global step {self._global_step}); "
                   f"exiting with status 143; restore() resumes from it")
        logging.getLogger("recsave").warning("recsave: %s", message)
        raise Preempted(message, path=path, step=self._global_step)

    def save(self, wait: bool = True, metrics: Optional[Mapping[str, float]] = None) -> str:
        """Saves ``ckpt_<global_step>`` now; returns its path. If this manager saved this step (or is
        writing it in the background) with no step(), restore, load (the Saver's own loads too) or
        change of global_step since, returns it without saving again; any other committed checkpoint of this
        step (e.g. after restoring an earlier step and training back up to it, the latest listed
        one too) raises CheckpointExistsError. `metrics` (name -> float) are stored in its index
        (keep_best); one returned without saving cannot record them (a RuntimeWarning says so).

        In an async mode, `wait` (default) waits until it is committed — the save at the end of
        training; with wait=False it returns once the snapshot is taken."""
        check(wait, bool, "wait", "CheckpointManager.save")
        values, refused = self._metrics("CheckpointManager.save", metrics)
        try:
            # Metrics refused on this rank only go on to the Saver, whose check meets the other
            # ranks in their first exchange (they raise at once, not at the collective timeout).
            return self._save(wait, values if refused is None else metrics, refused)
        finally:
            # The interval runs from the end of this save (its snapshot, in an async mode): from
            # its start, a save longer than save_interval_seconds would make every step save.
            self._last_save_at = self.clock()

    @staticmethod
    def _metrics(where: str, metrics: Any, keep_refusal: bool = False
                 ) -> Tuple[Optional[Dict[str, float]], Optional[Exception]]:
        """(checked metrics, None), or with several ranks in a process group (None, the refusal):
        a rank that raised here alone would leave the others waiting in their next collective for
        the collective timeout. Alone the refusal is raised at once, unless `keep_refusal` (step():
        a preemption save drops refused metrics, not the save)."""
        try:
            return retention.check_metrics(where, metrics), None
        except (ArgumentTypeError, UsageError) as exc:
            if dist.group()[1] <= 1 and not keep_refusal:
                raise
            return None, exc

    def _save(self, wait: bool, values: Any, refused: Optional[Exception] = None) -> str:
        """save(); `values` are the metrics, unchecked when this rank refused them (`refused`): the
        Saver refuses them again in step with the other ranks, and a return without saving
        (this step's checkpoint exists) raises `refused` after the steps every rank takes."""
        saver = self.saver

        def unsaved(path: str, recorded: Optional[Mapping[str, float]]) -> str:
            if refused is not None:
                raise refused
            if values and dict(values) != dict(recorded or {}):
                # An index never changes: silently dropped, they would leave this checkpoint
                # unranked by keep_best (e.g. save(metrics=...) after an evaluation that followed
                # the step's autosave), and rotation would prune the best one.
                warnings.warn(f"CheckpointManager.save: {path} holds this state already and is not written "
                              f"again, so metrics {sorted(values)} are not recorded in it (it records "
                              f"{dict(recorded) if recorded else 'none'}); keep_best ranks it by what it "
                              f"records. Pass metrics to the step() that saves instead.",
                              RuntimeWarning, stacklevel=4)
            return path
        ckpt_id = f"ckpt_{self._global_step}"
        ckpt_dir = saver.storage.join(saver.output_dir, ckpt_id)
        saved_here, committed = self._saved_here(ckpt_id)
        if saver.pending_checkpoint == ckpt_id and saved_here:  # written in the background already
            if wait:
                self.wait()
            return unsaved(ckpt_dir, self._saved_metrics)
        if saver.pending_checkpoint is not None:  # async_save would wait for it too; the policy needs its chain
            self.wait()
        if self._holds_restored_state(ckpt_id):
            # Restored from it and neither stepped, saved nor loaded since: it holds this state.
            # Listed last, a restart resumes from it, not from a branch the restore left. (Before
            # the `latest` check: every rank takes this path together, make_latest is collective.)
            path = saver.make_latest(ckpt_id)
            return unsaved(path, self._restored_metrics() if values else None)
        if saved_here and committed:
            return unsaved(ckpt_dir, self._saved_metrics)
        if self.evict is not None:  # before the snapshot: evicted ids are this save's tombstones
            if dist.group()[1] <= 1:  # a refused save must not have evicted rows first (one process:
                saver.refuse_committed(ckpt_id)  # several ranks learn of a refusal together, later)
            policy.evict_rows(saver.model, self.evict)
        incremental, why = False, "full_every is None"
        every = saver.retention.keep_every_n_steps
        if self.full_every is not None and every and \
                policy.opens_kept_window(self._global_step, every, self._listed_steps_or_none()):
            incremental, why = False, f"the first save of its keep_every_n_steps={every} window, kept for good"
        elif self.full_every is not None:
            incremental, why = policy.wants_delta(self.full_every, self.rebase_ratio,
                                                  policy.chain_bytes(saver.storage, saver.delta_parent),
                                                  policy.estimate_delta_bytes(saver.model))
        logging.getLogger("recsave").debug("recsave: %s is %s (%s)", ckpt_id,
                                           "a delta" if incremental else "full", why)
        self._saved = ckpt_id  # before: a save that fails after its commit point is committed still
        self._saved_metrics = values
        self._loads_at_save = saver.loads_started
        self._before_save = (saver.commits_made, saver.last_save)
        if self.async_mode == "disabled":
            try:
                return saver.save(ckpt_id, metrics=values, incremental=incremental)
            except BaseException as exc:
                # Refused before writing anything, on this rank or another: another state's id.
                if dist.failed_anywhere_with(exc, (CheckpointExistsError,)):
                    self._saved = None
                raise
        try:  # (it raises the previous write's error first, if that failed)
            saver.async_save(ckpt_id, pinned=self.async_mode == "async_pinned", metrics=values,
                             incremental=incremental)
        except BaseException:
            self._saved = None
            raise
        if wait:
            self.wait()
        return ckpt_dir

    def _saved_here(self, ckpt_id: str) -> Tuple[bool, bool]:
        """(whether this manager saved `ckpt_id` at the current step with no step, restore or load
        since (a load through the Saver itself counts too: Saver.load, load_model_bank,
        execute_plan) and no fallback load found it damaged since; whether it committed). With
        several ranks they agree (one all_reduce, only when the id is the one saved, as it is on
        every rank): a rank may have loaded alone (shard_num=1), and with an output dir per rank
        only rank 0's holds the `checkpoint` list, so the commit is known by any rank that knows
        it (its last_save, or its list), not by each rank's own list."""
        if ckpt_id != self._saved:
            return False, False
        changed = self.saver.loads_started != self._loads_at_save or ckpt_id in self.saver.damaged_checkpoints
        committed = self._committed_since_agreeing(ckpt_id)
        agreed = dist.max_over_ranks([int(changed), int(committed)], dist.group()[1],
                                     f"CheckpointManager: agreeing whether {ckpt_id} holds the state")
        return not agreed[0], bool(agreed[1])

    def _committed_since_agreeing(self, ckpt_id: str) -> bool:
        """Whether the save of `ckpt_id` that this manager began last committed, as this rank
        knows: its last_save (set at the commit, on the writing thread of an async save too) is a
        new one of that id, or the Saver committed since and its `checkpoint` list names the id
        latest (a save that failed after its commit point is committed still). Not a checkpoint
        of that id committed before that save began: one failing earlier (in its snapshot) after
        a rewind would take the abandoned branch's for this state."""
        commits, last_before = self._before_save
        last = self.saver.last_save
        if last is not None and last is not last_before and last.ckpt_id == ckpt_id:
            return True
        if self.saver.commits_made == commits:
            return False
        latest = self.saver.latest_checkpoint()
        return latest is not None and latest.rstrip("/").rsplit("/", 1)[-1] == ckpt_id

    def _holds_restored_state(self, ckpt_id: str) -> bool:
        """Whether checkpoint `ckpt_id` is the one restore() loaded, at the same global step, with
        no load or model-bank load of the Saver since (step() forgets the restore)."""
        if self._restored is None:
            return False
        path, step, report = self._restored
        return step == self._global_step and path.rstrip("/").rsplit("/", 1)[-1] == ckpt_id \
            and self.saver.last_load is report

    def _restored_metrics(self) -> Optional[Mapping[str, float]]:
        """The metrics the index of the restored checkpoint records (None: none, or unreadable)."""
        if self._restored is None:
            return None
        try:
            return index_mod.read(self._restored[0], self.saver.storage).metrics
        except (RecsaveError, OSError):
            return None

    def wait(self) -> Optional[str]:
        """Waits for the background write of an async save; returns its path (None if none was
        pending) or raises its error. Also waits for the deletion of pruned checkpoints
        (Saver.wait)."""
        try:
            return self.saver.wait()
        except BaseException:
            # The write failed (its id may be another state's, refused): whatever is listed under
            # this step is not known to hold this manager's state.
            self._saved = None
            raise

    def close(self) -> None:
        """Waits for a background write (raising its error), releases the Saver's resources and puts
        back the signal handlers that were installed before this manager's."""
        try:
            self.saver.close()
        finally:
            self._preemption.uninstall()

    def restore(self, global_step: Optional[int] = None, fallback: bool = True,
                load_conf: Optional[Dict[str, Any]] = None) -> int:
        """Loads ``ckpt_<global_step>``, or the latest committed checkpoint; returns the global step.
        With nothing to restore (global_step None and no checkpoint) returns 0 and changes nothing.
        With `fallback` (and global_step None), a corrupt or incomplete latest checkpoint is skipped
        with a warning and the previous committed one restored (see Saver.load); one written by a
        newer recsave stops it (FormatVersionError). A background write of an async save still
        pending is waited for first; when it failed, its error is raised (once, as by wait()) and
        nothing is restored: the checkpoint the caller took for the latest is missing, and the
        error must not wait for the first autosave after the restore. A checkpoint without
        global_step (written by a plain Saver, or by `convert`) restores too: global_step becomes
        the step its index records (that of its id ``ckpt_<N>``, or the one `convert` carried),
        else 0, and ``last_report.notes`` says so. `load_conf` selects what to load, as
        Saver.load's (e.g. ``{"exclude": ["io_state"]}`` when the number of workers changed); it
        has no ``path``: a restore reads this manager's output dir (load_model_bank reads others)."""
        check(global_step, int, "global_step", "CheckpointManager.restore", optional=True)
        check(fallback, bool, "fallback", "CheckpointManager.restore")
        check(load_conf, dict, "load_conf", "CheckpointManager.restore", optional=True)
        if load_conf is not None and "path" in load_conf:
            raise UsageError(f"CheckpointManager.restore: load_conf has a 'path' ({load_conf['path']!r}); a "
                             f"restore reads the manager's output dir {self.saver.output_dir}: drop 'path', or "
                             f"warm-start from another checkpoint with load_model_bank", key="path")
        saver = self.saver
        if global_step is not None and global_step < 0:
            raise UsageError(f"global_step must be an int >= 0, got {global_step!r}")
        ckpt_id = None if global_step is None else f"ckpt_{global_step}"

        def committed() -> bool:
            # A save of this manager still being written in the background is listed only once
            # done: restoring before would miss it (or find nothing and return 0, rewinding
            # nothing). Its outcome is taken here: a failure is raised, restoring nothing, not left
            # for the first autosave after the restore (a save of another state) to raise. Inside
            # the exchange below, so that every rank raises at once.
            self.wait()
            names = self._listed_ids()
            if ckpt_id is not None and ckpt_id not in names:
                raise CheckpointNotFoundError(
                    f"{saver.output_dir}: no committed checkpoint {ckpt_id}; committed: {names or 'none'}",
                    path=saver.output_dir)
            return bool(names)

        # Each rank reads its own list: one that fails (or lacks the step) raises on every rank at
        # once, and the ranks agree whether there is anything to restore before any load starts.
        rank, world = dist.group()
        background.wait_for_every_write()  # another Saver's: this exchange runs on their group
        found = dist.run_everywhere("listing the checkpoints to restore", committed, world, rank=rank,
                                    agree_on_result="whether there is a checkpoint to restore")
        if not found:
            return 0
        report = saver.load(fallback=fallback, load_conf=load_conf) if ckpt_id is None else \
            saver.load(ckpt_id=ckpt_id, load_conf=load_conf)
        if GLOBAL_STEP not in report.loaded:  # e.g. a plain Saver's checkpoint: its index's step, or 0
            self._global_step = int(report.step) if report.step is not None else 0
            where = report.checkpoints[-1] if report.checkpoints else saver.output_dir
            origin = "the step its index records" if report.step is not None else "its index records no step"
            # Not "the checkpoint holds none": load_conf may have left it out (the plan notes a
            # registered name the checkpoint lacks, with its own note).
            report.notes.append(f"{where}: global_step set to {self._global_step} ({origin}); no "
                                f"global_step was loaded from it")
        self.last_report = report
        # Only a restore of the whole checkpoint leaves the model in the state it holds: one that
        # kept the model's own dense part, or merged rows, must not be listed later as that state.
        self._restored = (report.checkpoints[-1], self._global_step, report) \
            if report.checkpoints and _restores_whole(load_conf) else None
        # The state restored is saved already: the time interval runs from here, else a restore
        # slower than it would make the first step save that state again.
        self._last_save_at = self.clock()
        self._saved = None
        if self.async_mode != "disabled":  # the first async save after a restart finds its buffers filled
            saver.prepare_async(pinned=self.async_mode == "async_pinned")
        return self._global_step

    def _listed_ids(self) -> List[str]:
        """The ids of the output dir's committed checkpoints, oldest first (Saver.checkpoints)."""
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.saver.checkpoints()]

    def _listed_steps_or_none(self) -> List[Optional[int]]:
        """The steps of the checkpoints listed in the output dir and of a pending async write (by
        their ids, ckpt_<step>; None for other ids); [] when the list cannot be read here (this
        save is then full: a rank's failure must not stop it alone before the save's collectives,
        and the save's vote makes every rank's save full when one asks for it)."""
        try:
            ids = self._listed_ids()
        except (RecsaveError, OSError):
            return []
        pending = self.saver.pending_checkpoint
        return [step_of_id(i) for i in ids + ([pending] if pending else [])]

    def plan_model_bank(self, entries: Sequence[Dict[str, Any]]) -> LoadPlan:
        """Dry run of load_model_bank: per name, the source checkpoint and name, rows and bytes to
        read, and what stays initialised. Changes nothing."""
        return self.saver.plan_model_bank(_keeping_own_step(entries))

    def load_model_bank(self, entries: Sequence[Dict[str, Any]]) -> LoadReport:
        """Warm start: applies bank entries in order (the last entry wins a name). Entries with
        ``is_dynamic: True`` are remembered for update_model_bank(). The manager's own
        ``global_step`` is left alone unless an entry's ``load`` names it: a source's step is
        another job's (this job's checkpoint ids and schedules follow its own)."""
        entries = _keeping_own_step(entries)
        plan = self.saver.plan_model_bank(entries, collective=True)
        report = self.saver.execute_plan(plan)
        self._saved = None  # the model changed: an id saved before holds other rows now
        self._bank = (list(entries), plan.source_versions(), list(plan.checkpoints))
        return report

    def update_model_bank(self) -> Optional[LoadReport]:
        """Re-loads the names won by ``is_dynamic`` entries whose source has a newer committed
        version since the last load (and only then); returns the report, or None when nothing is
        newer. For jobs that follow another job's embeddings."""
        if self._bank is None:
            return None
        entries, loaded, checkpoints = self._bank
        # Every rank calls it: it may load. Entries that are not dynamic are planned from the
        # checkpoint they loaded (a reload may take the slots of its tables from one of them).
        plan = self.saver.plan_model_bank(_pinned(entries, checkpoints), collective=True)
        current = plan.source_versions()
        changed = {i for i, entry in enumerate(entries) if _dynamic(entry) and current.get(i) != loaded.get(i)}
        names = {n for n, item in plan.items.items() if item.entry in changed}
        if not names:
            return None

        def check_static_parts() -> None:
            # What a reload takes from an entry that is not dynamic must be what it loaded: the same
            # version (its checkpoint, not gone, nor saved again since).
            for name in sorted(names_executed(plan, names)):
                i = plan.items[name].entry
                if i not in changed and current.get(i) != loaded.get(i):
                    raise CheckpointNotFoundError(
                        f"update_model_bank: model bank entry {i} (not is_dynamic) loaded {checkpoints[i]}, "
                        f"which is gone or was saved again since; reloading entry(ies) {sorted(changed)} needs "
                        f"{name!r} from it. Call load_model_bank again, or make entry {i} is_dynamic",
                        path=checkpoints[i], key=name)
        # Each rank decided its pins alone: a refusal on one raises on all before any collective.
        rank, world = dist.group()
        background.wait_for_every_write()  # any Saver's: this exchange runs on their group
        dist.run_everywhere("checking what update_model_bank takes from static entries", check_static_parts,
                            world, rank=rank)
        report = self.saver.execute_plan(plan, only=names)
        self._saved = None
        for i in changed:
            loaded[i] = current[i]
        return report



def _dynamic(entry: Any) -> bool:
    return isinstance(entry, dict) and bool(entry.get("is_dynamic"))


def _pinned(entries: Sequence[Any], checkpoints: Sequence[str]) -> List[Any]:
    """The entries, each one that is not dynamic pointing at the checkpoint it loaded (where that is
    still there): an output dir's newer checkpoint must not slip into an update."""
    out = []
    for entry, ckpt in zip(entries, checkpoints):
        if not _dynamic(entry) and isinstance(entry, dict) and ckpt and ckpt != entry.get("path"):
            storage = get_storage(ckpt)
            if storage.exists(storage.join(ckpt, index_mod.INDEX_FILE)):
                entry = {**entry, "path": ckpt}
        out.append(entry)
    return out


def _incremental_settings(full_every: Any, rebase_ratio: Any, evict: Any) -> Tuple[Optional[int], float,
                                                                                  Optional[Dict[str, int]]]:
    """Checks the settings of incremental checkpoints (wired in CheckpointManager.save)."""
    where = "CheckpointManager"
    check(full_every, int, "full_every", where, optional=True)
    check(rebase_ratio, (int, float), "rebase_ratio", where)
    check(evict, dict, "evict", where, optional=True,
          expected="a dict like {'older_than_steps': N, 'min_count': M}")
    if full_every is not None and full_every < 1:
        raise UsageError(f"{where}: full_every must be an int >= 1 or None, got {full_every!r}")
    if not (math.isfinite(rebase_ratio) and rebase_ratio > 0):
        raise UsageError(f"{where}: rebase_ratio must be a finite number > 0, got {rebase_ratio!r}")
    if evict is not None:
        odd = sorted(repr(k) for k in evict if k not in EVICT_KEYS)
        if odd or not evict:
            raise UsageError(f"{where}: evict takes the keys {EVICT_KEYS} (at least one), got "
                             f"{sorted(map(repr, evict))}", key="evict")
        for key, value in evict.items():
            check(value, int, f"evict[{key!r}]", where)
            if value < (1 if key == "min_count" else 0):
                raise UsageError(f"{where}: evict[{key!r}] must be an int >= {1 if key == 'min_count' else 0}, "
                                 f"got {value!r}", key="evict")
        evict = dict(evict)
    return full_every, rebase_ratio, evict
