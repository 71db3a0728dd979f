"""CheckpointManager: autosave every N steps, restore by global step, warm start from a model bank."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from recsave.argcheck import check
from recsave.errors import CheckpointNotFoundError, UsageError
from recsave.load.plan import LoadPlan
from recsave.load.report import LoadReport
from recsave.save.saver import Saver

GLOBAL_STEP = "global_step"
ASYNC_MODES = ("disabled", "async", "async_pinned")


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


class CheckpointManager:
    """Drives a Saver from the training loop. Checkpoint ids are ``ckpt_<global_step>``.

    Call step() once per training step; every `save_interval` steps it saves (0 disables autosave).
    `async_mode`: ``disabled`` saves synchronously; ``async`` makes autosaves Saver.async_save
    calls (training waits only for the snapshot); ``async_pinned`` also stages CUDA tensors in
    page-locked memory. Call wait() or close() at the end of training (save() waits by default).
    """

    def __init__(self, saver: Saver, save_interval: int, async_mode: str = "disabled"):
        check(saver, Saver, "saver", "CheckpointManager", expected="a recsave.Saver")
        check(save_interval, int, "save_interval", "CheckpointManager")
        check(async_mode, str, "async_mode", "CheckpointManager")
        if save_interval < 0:
            raise UsageError(f"save_interval must be an int >= 0 (0: no autosave), got {save_interval!r}")
        if async_mode not in ASYNC_MODES:
            raise UsageError(f"async_mode must be one of {ASYNC_MODES}, got {async_mode!r}")
        self.saver = saver
        self.async_mode = async_mode
        self._save_interval = save_interval
        self._global_step = 0
        self._bank: Optional[Tuple[List[Dict[str, Any]], Dict[int, str]]] = None
        self.last_report: Optional[LoadReport] = None
        # Optional: checkpoints of a plain Saver lack it, and still load (restore() then takes the
        # step from the checkpoint id).
        saver.register_for_checkpointing(GLOBAL_STEP, _StepState(self), optional=True)

    @property
    def global_step(self) -> int:
        return self._global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        check(value, int, "global_step", "CheckpointManager")
        if value < 0:
            raise UsageError(f"global_step must be an int >= 0, got {value!r}")
        self._global_step = value

    @property
    def save_interval(self) -> int:
        return self._save_interval

    def register_for_checkpointing(self, name: str, obj: Any, optional: bool = False) -> None:
        """Saver.register_for_checkpointing (see there for `optional`)."""
        self.saver.register_for_checkpointing(name, obj, optional=optional)

    def step(self) -> Optional[str]:
        """Advances the global step; saves when it reaches a multiple of save_interval (returns the
        checkpoint path then, else None). In an async mode the save is only started: training waits
        for the snapshot (and for the previous write, if it is still running)."""
        self._global_step += 1
        if self._save_interval and self._global_step % self._save_interval == 0:
            return self.save(wait=False)
        return None

    def save(self, wait: bool = True) -> str:
        """Saves ``ckpt_<global_step>`` now; returns its path. If the latest checkpoint (or the one
        being written in the background) is this step already, returns it without saving again; an
        older committed checkpoint of this step (after restoring an earlier step) raises
        CheckpointExistsError.

        In an async mode, `wait` (default) waits until it is committed — the save at the end of
        training; with wait=False it returns once the snapshot is taken."""
        check(wait, bool, "wait", "CheckpointManager.save")
        saver = self.saver
        ckpt_id = f"ckpt_{self._global_step}"
        ckpt_dir = saver.storage.join(saver.output_dir, ckpt_id)
        if saver.pending_checkpoint == ckpt_id:  # written in the background already
            if wait:
                saver.wait()
            return ckpt_dir
        latest = saver.latest_checkpoint()
        if latest is not None and latest.rstrip("/").rsplit("/", 1)[-1] == ckpt_id \
                and ckpt_id not in saver.damaged_checkpoints:
            return latest
        if self.async_mode == "disabled":
            return saver.save(ckpt_id)
        saver.async_save(ckpt_id, pinned=self.async_mode == "async_pinned")
        if wait:
            saver.wait()
        return ckpt_dir

    def wait(self) -> Optional[str]:
        """Waits for the background write of an async save; returns its path (None if none was
        pending) or raises its error."""
        return self.saver.wait()

    def close(self) -> None:
        """Waits for a background write (raising its error) and releases the Saver's resources."""
        self.saver.close()

    def restore(self, global_step: Optional[int] = None, fallback: bool = True) -> int:
        """Loads ``ckpt_<global_step>``, or the latest committed checkpoint; returns the global step.
        With nothing to restore (global_step None and no checkpoint) returns 0 and changes nothing.
        With `fallback` (and global_step None), a corrupt or incomplete latest checkpoint is skipped
        with a warning and the previous committed one restored (see Saver.load); one written by a
        newer recsave stops it (FormatVersionError). A checkpoint without global_step (written by a
        plain Saver) restores too: global_step becomes the step of its id (``ckpt_<N>``), else 0,
        and ``last_report.notes`` says so."""
        check(global_step, int, "global_step", "CheckpointManager.restore", optional=True)
        check(fallback, bool, "fallback", "CheckpointManager.restore")
        saver = self.saver
        if global_step is None:
            if saver.latest_checkpoint() is None:
                return 0
            report = saver.load(fallback=fallback)
        else:
            if global_step < 0:
                raise UsageError(f"global_step must be an int >= 0, got {global_step!r}")
            ckpt_id = f"ckpt_{global_step}"
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in saver.checkpoints()]
            if ckpt_id not in names:
                raise CheckpointNotFoundError(
                    f"{saver.output_dir}: no committed checkpoint {ckpt_id}; committed: {names or 'none'}",
                    path=saver.output_dir)
            report = saver.load(ckpt_id=ckpt_id)
        if GLOBAL_STEP not in report.loaded:  # e.g. a plain Saver's checkpoint: step of its id, or 0
            self._global_step = int(report.step) if report.step is not None else 0
            where = report.checkpoints[-1] if report.checkpoints else saver.output_dir
            origin = "the step of its id" if report.step is not None else "its id carries no step"
            report.notes.append(f"{where}: global_step set to {self._global_step} ({origin}); the "
                                f"checkpoint holds no global_step")
        self.last_report = report
        return self._global_step

    def plan_model_bank(self, entries: Sequence[Dict[str, Any]]) -> LoadPlan:
        """Dry run of load_model_bank: per name, the source checkpoint and name, rows and bytes to
        read, and what stays initialised. Changes nothing."""
        return self.saver.plan_model_bank(entries)

    def load_model_bank(self, entries: Sequence[Dict[str, Any]]) -> LoadReport:
        """Warm start: applies bank entries in order (the last entry wins a name). Entries with
        ``is_dynamic: True`` are remembered for update_model_bank()."""
        plan = self.saver.plan_model_bank(entries)
        report = self.saver.execute_plan(plan)
        self._bank = (list(entries), plan.source_versions())
        return report

    def update_model_bank(self) -> Optional[LoadReport]:
        """Re-loads the names won by ``is_dynamic`` entries whose source has a newer committed
        version since the last load (and only then); returns the report, or None when nothing is
        newer. For jobs that follow another job's embeddings."""
        if self._bank is None:
            return None
        entries, loaded = self._bank
        plan = self.saver.plan_model_bank(entries)
        current = plan.source_versions()
        changed = {i for i, entry in enumerate(entries)
                   if isinstance(entry, dict) and entry.get("is_dynamic") and current.get(i) != loaded.get(i)}
        names = {n for n, item in plan.items.items() if item.entry in changed}
        if not names:
            return None
        report = self.saver.execute_plan(plan, only=names)
        for i in changed:
            loaded[i] = current[i]
        return report

