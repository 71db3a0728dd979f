"""recsave.lightning.RecsaveCallback: a Lightning fit stopped mid-epoch (by an exception, or SIGKILLed
in a child process) resumes at the batch after the last autosave and ends bit-identical to an
uninterrupted fit (tables, slots, dense, optimizers, loop counters, sampler); Lightning's own
ModelCheckpoint round-trips a module holding HashTables."""
from __future__ import annotations

import glob
import os
import pickle
import signal
import subprocess
import sys
from typing import List

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from helpers import CTR, assert_obj_equal, assert_states_equal, model_state  # noqa: E402
from lightning_job import BATCH, EPOCHS, INTERVAL, N_SAMPLES, Module, ResumableSampler, dataset, fit, state  # noqa: E402

from recsave import CheckpointManager, Saver  # noqa: E402
from recsave.errors import ArgumentTypeError, UsageError  # noqa: E402
from recsave.lightning import RecsaveCallback  # noqa: E402
from recsave.tools.catalog import list_checkpoints  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FAIL_AT = 123       # global batch that raises: epoch 2, batch 23; the last save is step 119 (batch 19)
KILL_AT = 131       # global batch whose child is SIGKILLed: epoch 2, batch 31; the last save is step 126


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted fit: the batches it trained, and its end state."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Lightning: a plain DataLoader is "not resumable"
        module, trainer, _ = fit(str(tmp_path_factory.mktemp("ref")))
    assert len(module.seen) == EPOCHS * N_SAMPLES // BATCH
    return module.seen, state(module, trainer)


def assert_resumed_equal(reference, resumed, trainer, callback, last_save: int) -> None:
    """`resumed` restored ckpt_<last_save>, started at the batch after it and ended equal to `reference`."""
    ref_seen, ref_state = reference
    assert callback.restored_step == last_save
    # The resumed fit starts at the batch after the last save: same step, epoch, batch index, samples.
    epoch, batch_idx = divmod(last_save, N_SAMPLES // BATCH)
    assert resumed.seen[0][:3] == (last_save, epoch, batch_idx)
    assert resumed.seen == ref_seen[last_save:]
    s_ref, s_run = dict(ref_state), state(resumed, trainer)
    assert_states_equal(s_ref.pop("model"), s_run.pop("model"), "model")  # tables, slots, dense: torch.equal
    assert_obj_equal(s_ref, s_run, "state")  # both optimizers, loop counters, sampler position
    assert callback.saved[-1].endswith(f"ckpt_{EPOCHS * 50}")


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning: a plain DataLoader is "not resumable"
def test_fit_stopped_mid_epoch_resumes_at_the_same_batch_and_ends_equal(tmp_path, reference):
    out = str(tmp_path / "run")
    # The failed fit's Saver is left open (kept alive by the traceback): the callback released
    # its writer lock, else the retry's Saver met WriterLockedError.
    with pytest.raises(RuntimeError, match="killed at batch 123"):
        fit(out, fail_at=FAIL_AT, close=False)
    resumed, trainer, callback = fit(out)
    assert_resumed_equal(reference, resumed, trainer, callback, FAIL_AT // INTERVAL * INTERVAL)  # 119


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fit_sigkilled_mid_epoch_in_a_child_resumes_and_ends_equal(tmp_path, reference):
    out, progress = tmp_path / "run", tmp_path / "progress"
    env = dict(os.environ, RECSAVE_FSYNC="0", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, os.path.join(HERE, "lightning_job.py"), "kill", str(out), str(KILL_AT),
                            str(progress)], env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, f"exit {child.returncode}\n{child.stdout}\n{child.stderr}"
    # The child reached global batch KILL_AT (epoch 2, batch 31) and died there, 5 batches past its
    # last autosave: the checkpoints on disk are the two autosaves kept (max_keep=2) and nothing later.
    assert progress.read_text().split() == [str(KILL_AT), "2", str(KILL_AT - 2 * 50)]
    last_save = KILL_AT // INTERVAL * INTERVAL  # 126
    assert 0 < last_save < KILL_AT
    assert sorted(p.name for p in out.glob("ckpt_*")) == [f"ckpt_{last_save - INTERVAL}", f"ckpt_{last_save}"]
    resumed, trainer, callback = fit(str(out))  # this process: the same callback, model and data
    assert_resumed_equal(reference, resumed, trainer, callback, last_save)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_fit_sent_sigterm_saves_exits_143_and_resumes_equal(tmp_path, reference):
    """The callback runs the manager's step(): a preemption notice saves the next step, waits for
    the commit and exits 143, and a restart resumes right after it."""
    out = tmp_path / "run"
    env = dict(os.environ, RECSAVE_FSYNC="0", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, os.path.join(HERE, "lightning_job.py"), "term", str(out), str(KILL_AT),
                            "-"], env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == 143, f"exit {child.returncode}\n{child.stdout}\n{child.stderr}"
    saved = KILL_AT + 1  # the signal arrives during batch KILL_AT; the step that ends it saves
    assert (out / "checkpoint").read_text().split()[-1] == f"ckpt_{saved}"
    resumed, trainer, callback = fit(str(out))
    assert_resumed_equal(reference, resumed, trainer, callback, saved)


def run_child(*args: str) -> subprocess.CompletedProcess:
    """A child Python (a script path or ``-c`` and its code) with tests/ on its path."""
    env = dict(os.environ, RECSAVE_FSYNC="0", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_fit_sent_sigterm_in_on_train_epoch_end_saves_exits_143_and_resumes_equal(tmp_path, reference):
    """The module's on_train_epoch_end runs after every callback hook of the epoch; Lightning then
    ends the fit (SIGTERMException: exit 0, and the autosave of step 98 the latest). The
    callback's on_exception saves the end of the epoch (step 100) and makes the exit 143; a
    restart begins the next epoch and ends equal to an uninterrupted fit."""
    out = tmp_path / "run"
    child = run_child(os.path.join(HERE, "lightning_job.py"), "term-epoch-end", str(out), "1", "-")
    assert child.returncode == 143, f"exit {child.returncode}\n{child.stdout}\n{child.stderr}"
    assert (out / "checkpoint").read_text().split() == ["ckpt_98", "ckpt_100"]
    resumed, trainer, callback = fit(str(out))
    assert_resumed_equal(reference, resumed, trainer, callback, 100)


_SIGTERM_IN_VALIDATION = """
import os, signal, sys, warnings
warnings.filterwarnings("ignore")
import lightning.pytorch as pl
import torch
import lightning_job as J
from recsave import CheckpointManager, Saver
from recsave.lightning import RecsaveCallback

class Module(J.Module):
    def term(self):
        if self.global_step >= 10 and not getattr(self, "termed", False):
            self.termed = True
            os.kill(os.getpid(), signal.SIGTERM)

    def validation_step(self, batch, batch_idx):
        if sys.argv[2] == "validation_step":
            self.term()

    def on_validation_epoch_end(self):  # e.g. an AUC over the whole validation set
        if sys.argv[2] == "on_validation_epoch_end":
            self.term()

    def on_validation_end(self):  # after the callback's on_validation_end
        if sys.argv[2] == "on_validation_end":
            self.term()

sampler = J.ResumableSampler(J.N_SAMPLES, J.BATCH)
module = Module(sampler)
saver = Saver(module, sparse_optim=module.sparse_opt, output_dir=sys.argv[1], max_keep=2)
saver.register_io_state("sampler", sampler)
trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=J.EPOCHS, logger=False,
                     callbacks=[RecsaveCallback(CheckpointManager(saver, 100))], enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     val_check_interval=5, limit_val_batches=2)
trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(J.dataset(), batch_size=J.BATCH, sampler=sampler),
            val_dataloaders=torch.utils.data.DataLoader(J.dataset(), batch_size=16))
"""


@pytest.mark.parametrize("where", ["validation_step", "on_validation_epoch_end", "on_validation_end"])
def test_a_fit_sent_sigterm_during_validation_saves_and_exits_143(tmp_path, where):
    """Lightning ends a validation loop on SIGTERM right after the batch, or the fit right after
    validation (exit 0, nothing saved); the callback saves the fit's state first and raises
    Preempted (a signal in the module's on_validation_end, after the callback's: saves in
    on_exception of the SIGTERMException Lightning raises next, exit 143 as well)."""
    out = tmp_path / "run"
    env = dict(os.environ, RECSAVE_FSYNC="0", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, "-c", _SIGTERM_IN_VALIDATION, str(out), where], env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 143, f"exit {child.returncode}\n{child.stdout}\n{child.stderr}"
    assert (out / "checkpoint").read_text().split() == ["ckpt_10"]


_SIGTERM_IN_ACCUMULATION = """
import os, signal, sys, warnings
warnings.filterwarnings("ignore")
import lightning.pytorch as pl
import torch
import lightning_job as J
from recsave import CheckpointManager, Saver
from recsave.lightning import RecsaveCallback

class Module(J.Module):
    def training_step(self, batch, batch_idx):  # steps every 2 batches: gradient accumulation
        index, uid, iid, label = batch
        if batch_idx == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGTERM)
        dense = self.optimizers()
        self.manual_backward(torch.nn.functional.binary_cross_entropy_with_logits(self.model(uid, iid), label))
        if batch_idx % 2 == 1:
            dense.step(); self.sparse_opt.step()
            dense.zero_grad(); self.sparse_opt.zero_grad()
        self.sampler.advance(self.current_epoch, batch_idx)

sampler = J.ResumableSampler(J.N_SAMPLES, J.BATCH)
module = Module(sampler)
saver = Saver(module, sparse_optim=module.sparse_opt, output_dir=sys.argv[1], max_keep=2)
saver.register_io_state("sampler", sampler)
trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                     callbacks=[RecsaveCallback(CheckpointManager(saver, 3))], enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(J.dataset(), batch_size=J.BATCH, sampler=sampler))
"""


@pytest.mark.parametrize("batch_idx, latest", [(10, "ckpt_5"), (12, "ckpt_6")])
def test_a_fit_sent_sigterm_in_a_batch_that_does_not_step_saves_and_exits_143(tmp_path, batch_idx, latest):
    """A batch without an optimizer step (gradient accumulation) has no new global step, and
    Lightning ends the fit right after it on SIGTERM (exit 0, nothing saved): the callback acts on
    the preemption there too, saving ckpt_<global step> (batch 10: step 5, not autosaved; batch 12:
    step 6, whose autosave holds it already) and raising Preempted."""
    out = tmp_path / "run"
    env = dict(os.environ, RECSAVE_FSYNC="0", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, "-c", _SIGTERM_IN_ACCUMULATION, str(out), str(batch_idx)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 143, f"exit {child.returncode}\n{child.stdout}\n{child.stderr}"
    assert (out / "checkpoint").read_text().split()[-1] == latest


def test_a_plain_checkpoint_restored_into_a_fit_that_accumulates_gradients(tmp_path):
    """A checkpoint without Lightning state (a plain manager's) restores the model and starts the
    loop at 0; a first batch without an optimizer step (gradient accumulation) then has global
    step 0, which the callback used to turn into the manager's global_step -1 (UsageError)."""
    out = tmp_path / "run"
    env = dict(os.environ, RECSAVE_FSYNC="0", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    plain = _SIGTERM_IN_ACCUMULATION.replace("trainer = pl.Trainer", """
plain_saver = Saver(module, sparse_optim=module.sparse_opt, output_dir=sys.argv[1])
plain_saver.register_io_state("sampler", sampler)
mgr = CheckpointManager(plain_saver, 100)
mgr.global_step = 5
mgr.save()
mgr.close()
trainer = pl.Trainer""") + "print('steps', trainer.global_step)\n"
    child = subprocess.run([sys.executable, "-c", plain, str(out), "-1"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stdout}\n{child.stderr}"
    assert "steps 25" in child.stdout
    assert (out / "checkpoint").read_text().split()[-1] == "ckpt_25"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fresh_fit_saves_every_interval_and_at_the_end(tmp_path):
    module, trainer, callback = fit(str(tmp_path / "run"), save_interval=60)
    assert callback.restored_step is None
    assert [p.rsplit("/", 1)[-1] for p in callback.saved] == ["ckpt_60", "ckpt_120", "ckpt_180", "ckpt_200"]
    assert trainer.global_step == 200


VAL_AUC = [0.5, 0.875, 0.75, 0.625]  # logged at the end of each epoch's validation (exact in float32)


class ValidatedModule(Module):
    """The fit's module with a validation at each epoch's end that logs auc[epoch] as `metric`."""

    def __init__(self, sampler: ResumableSampler, metric: str, auc: List[float]):
        super().__init__(sampler)
        self.metric, self.auc = metric, auc

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        self.log(self.metric, self.auc[self.current_epoch])


def monitored_fit(output_dir: str, logged: str = "val_auc", auc: List[float] = VAL_AUC,
                  val_samples: int = N_SAMPLES) -> RecsaveCallback:
    """A 4-epoch fit (a sanity check, then validation at each epoch's end: global steps 50, 100,
    150, 200) autosaving every 25 steps, keeping the latest and the 2 best by val_auc. With
    val_samples=0 the validation loader has no batches: Lightning then skips every validation."""
    torch.manual_seed(0)
    sampler = ResumableSampler(N_SAMPLES, BATCH)
    module = ValidatedModule(sampler, logged, auc)
    saver = Saver(module, sparse_optim=module.sparse_opt, output_dir=output_dir, max_keep=1)
    saver.register_io_state("sampler", sampler)
    manager = CheckpointManager(saver, 25, keep_best=2, best_metric="val_auc", best_mode="max")
    callback = RecsaveCallback(manager, monitor="val_auc")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=EPOCHS, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=2, limit_val_batches=2)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, sampler=sampler)
    try:
        validation = torch.utils.data.Subset(dataset(), range(val_samples))
        trainer.fit(module, train_dataloaders=loader, val_dataloaders=torch.utils.data.DataLoader(validation, 64))
    finally:
        saver.close()
    return callback


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("error:.*not recorded:RuntimeWarning")
def test_monitor_records_each_validation_metric_and_keep_best_ranks_them(tmp_path):
    """Each validation's end saves its step with {monitor: value}; the step's autosave is left to
    that save (saved first, it would take the id and the manager could not record the metric:
    "not recorded" warning, made an error here); the sanity check saves nothing; other autosaves
    and the end-of-training save go on."""
    out = str(tmp_path / "run")
    callback = monitored_fit(out)
    assert [p.rsplit("/", 1)[-1] for p in callback.saved] == [f"ckpt_{s}" for s in range(25, 201, 25)]
    listed = {c["id"]: (c["metrics"], c["kept"]) for c in list_checkpoints(out)}
    # ckpt_50 (0.5) and the autosaves without metrics are pruned: 0.875 and 0.75 are the 2 best.
    assert listed == {"ckpt_100": ({"val_auc": 0.875}, ["best"]), "ckpt_150": ({"val_auc": 0.75}, ["best"]),
                      "ckpt_200": ({"val_auc": 0.625}, ["latest"])}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_monitor_autosaves_a_step_whose_validation_lightning_skips(tmp_path):
    """The autosave of a step that validation is to follow is left to validation's end; where
    Lightning then runs none (here: a validation loader with no batches, whose loop skips every
    hook), the next hook takes it. Lost, every autosave at an epoch's end was: 50, 100 and 150."""
    out = str(tmp_path / "run")
    callback = monitored_fit(out, val_samples=0)
    assert [p.rsplit("/", 1)[-1] for p in callback.saved] == [f"ckpt_{s}" for s in range(25, 201, 25)]
    assert all(c["metrics"] is None for c in list_checkpoints(out))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_monitor_of_a_metric_not_logged_raises_naming_the_logged_ones(tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(UsageError, match=r"^RecsaveCallback\(monitor='val_auc'\): the validation that ended at "
                                         r"global step 50 logged no 'val_auc' \(trainer.callback_metrics has "
                                         r"\['val_loss'\]\); log it with self.log\('val_auc', ...\)"):
        monitored_fit(out, logged="val_loss")
    assert [c["id"] for c in list_checkpoints(out)] == ["ckpt_25"]  # step 50's save was validation's


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_monitor_of_a_nan_saves_without_metrics(tmp_path, caplog):
    """The manager refuses a NaN metric (an index stores finite numbers): the save goes on without
    it, so the checkpoint is never kept as best, as ModelCheckpoint ranks a NaN last."""
    out = str(tmp_path / "run")
    monitored_fit(out, auc=VAL_AUC[:3] + [float("nan")])
    listed = {c["id"]: (c["metrics"], c["kept"]) for c in list_checkpoints(out)}
    assert listed == {"ckpt_100": ({"val_auc": 0.875}, ["best"]), "ckpt_150": ({"val_auc": 0.75}, ["best"]),
                      "ckpt_200": (None, ["latest"])}
    assert "val_auc is nan at global step 200: ckpt_200 is saved without metrics" in caplog.text


def lightning_fit(module: Module, root, *, max_epochs: int, callbacks=(), ckpt_path=None, weights_only=None):
    """A plain Lightning fit of `module` with Lightning's own ModelCheckpoint on (under `root`)."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, callbacks=list(callbacks),
                         logger=False, enable_checkpointing=True, default_root_dir=str(root),
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, sampler=module.sampler)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path, weights_only=weights_only)
    return trainer


def fresh_module() -> Module:
    torch.manual_seed(0)
    return Module(ResumableSampler(N_SAMPLES, BATCH))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_model_checkpoint_of_hashtables_restores_with_weights_only_false(tmp_path):
    trained = fresh_module()
    trainer = lightning_fit(trained, tmp_path / "pl", max_epochs=1)
    files = glob.glob(str(tmp_path / "pl" / "**" / "*.ckpt"), recursive=True)
    assert [os.path.basename(f) for f in files] == ["epoch=0-step=50.ckpt"]
    ckpt, want = files[0], model_state(trained.model)
    assert len(trained.model.user) > 0 and len(trained.model.user.slot_names()) == 1  # rows and Adagrad slots

    # Lightning 2.6 passes weights_only=None to torch.load, which (torch >= 2.6) means True: a
    # pickled HashTable is refused (docs/API.md section 9).
    with pytest.raises(pickle.UnpicklingError, match="HashTable"):
        Module.load_from_checkpoint(ckpt, sampler=ResumableSampler(N_SAMPLES, BATCH))
    with pytest.raises(pickle.UnpicklingError, match="HashTable"):
        lightning_fit(fresh_module(), tmp_path / "again", max_epochs=1, ckpt_path=ckpt)

    loaded = Module.load_from_checkpoint(ckpt, sampler=ResumableSampler(N_SAMPLES, BATCH), weights_only=False)
    assert_states_equal(want, model_state(loaded.model), "load_from_checkpoint")  # ids, rows, slots, dense

    resumed = fresh_module()
    t2 = lightning_fit(resumed, tmp_path / "again", max_epochs=1, ckpt_path=ckpt, weights_only=False)
    assert_states_equal(want, model_state(resumed.model), "fit(ckpt_path)")
    assert t2.global_step == 50 and resumed.seen == []  # the epoch was done: nothing trained again
    assert_obj_equal(trainer.optimizers[0].state_dict(), t2.optimizers[0].state_dict(), "dense optimizer")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fit_with_ckpt_path_is_not_also_restored_by_the_callback(tmp_path):
    first = fresh_module()
    lightning_fit(first, tmp_path / "pl", max_epochs=1)  # epoch=0-step=50.ckpt
    ckpt, want = glob.glob(str(tmp_path / "pl" / "**" / "*.ckpt"), recursive=True)[0], model_state(first.model)
    _, _, callback = fit(str(tmp_path / "run"))  # recsave checkpoints up to ckpt_200: another state
    assert callback.saved[-1].endswith("ckpt_200")

    module = fresh_module()
    saver = Saver(module, sparse_optim=module.sparse_opt, output_dir=str(tmp_path / "run"))
    callback = RecsaveCallback(CheckpointManager(saver, INTERVAL), save_on_train_end=False)
    try:
        trainer = lightning_fit(module, tmp_path / "pl2", max_epochs=1, callbacks=[callback], ckpt_path=ckpt,
                                weights_only=False)
    finally:
        saver.close()
    assert callback.restored_step is None  # the .ckpt alone was restored: model, optimizer and loop agree
    assert_states_equal(want, model_state(module.model), "model")
    assert trainer.global_step == 50


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_fit_resumed_at_its_last_step_trains_nothing_and_saves_nothing(tmp_path):
    """fit(ckpt_path=...) of a finished run (Lightning's .ckpt at step 50, recsave's ckpt_50
    committed by the same run): no step runs and Lightning skips on_train_end, so the callback
    neither overwrites ckpt_50 nor meets the manager's refusal of a committed id (which a save of
    that step, not made by this manager, gets)."""
    def run(ckpt_path=None):
        module = fresh_module()
        saver = Saver(module, sparse_optim=module.sparse_opt, output_dir=str(tmp_path / "run"))
        callback = RecsaveCallback(CheckpointManager(saver, 25))
        try:
            trainer = lightning_fit(module, tmp_path / "pl", max_epochs=1, callbacks=[callback],
                                    ckpt_path=ckpt_path, weights_only=False)
        finally:
            saver.close()
        return trainer, callback

    trainer, callback = run()
    assert trainer.global_step == 50 and callback.saved[-1].endswith("ckpt_50")
    listed = open(tmp_path / "run" / "checkpoint").read()
    index = (tmp_path / "run" / "ckpt_50" / "index").read_bytes()
    ckpt = glob.glob(str(tmp_path / "pl" / "**" / "*.ckpt"), recursive=True)[0]
    trainer, callback = run(ckpt)
    assert trainer.global_step == 50 and callback.saved == []
    assert open(tmp_path / "run" / "checkpoint").read() == listed
    assert (tmp_path / "run" / "ckpt_50" / "index").read_bytes() == index


def test_arguments_are_checked(tmp_path):
    saver = Saver(CTR(), output_dir=str(tmp_path))
    with pytest.raises(ArgumentTypeError):
        RecsaveCallback(saver)  # a Saver, not a CheckpointManager
    with pytest.raises(ArgumentTypeError):
        RecsaveCallback(CheckpointManager(saver, 5), restore=1)


def test_monitor_must_be_the_metric_keep_best_ranks_by(tmp_path):
    def manager(name: str, **kw) -> CheckpointManager:
        return CheckpointManager(Saver(CTR(), output_dir=str(tmp_path / name)), 5, **kw)
    with pytest.raises(ArgumentTypeError, match="monitor must be a str or None"):
        RecsaveCallback(manager("a"), monitor=1)
    with pytest.raises(UsageError, match="monitor must be a metric name or None, got ''"):
        RecsaveCallback(manager("b"), monitor="")
    with pytest.raises(UsageError, match=r"^RecsaveCallback: monitor='val_loss', but the manager's keep_best "
                                         r"ranks by 'auc'; give monitor='auc', or best_metric='val_loss' to"):
        RecsaveCallback(manager("c", keep_best=1, best_metric="auc", best_mode="max"), monitor="val_loss")
    with pytest.warns(RuntimeWarning, match=r"keeps the 2 best checkpoints by 'auc', but no monitor is given"):
        RecsaveCallback(manager("d", keep_best=2, best_metric="auc"))
    assert RecsaveCallback(manager("e"), monitor="val_loss").monitor == "val_loss"  # recorded, not ranked
