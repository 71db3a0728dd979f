"""The Lightning fit of tests/test_lightning.py (not a test module): the model, a resumable sampler,
the fit itself and its end state; also a child script for the SIGKILL test.

    python lightning_job.py kill OUT K PROGRESS   fit into OUT, autosaving every INTERVAL steps; at
                                                  global batch K write "STEP EPOCH BATCH_IDX" (the
                                                  batch reached, not trained) to PROGRESS and SIGKILL
                                                  this process
    python lightning_job.py term OUT K -          the same, sending SIGTERM (a preemption notice) at
                                                  global batch K instead
    python lightning_job.py term-epoch-end OUT E -  the same, sending SIGTERM from the module's
                                                  on_train_epoch_end of epoch E
"""
from __future__ import annotations

import copy
import os
import signal
import sys
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl
import torch
from helpers import CTR, item_ids, model_state, user_ids

from recsave import CheckpointManager, Saver
from recsave.lightning import RecsaveCallback
from recsave.tables.optim import SparseAdagrad

N_SAMPLES = 800
BATCH = 16          # 50 batches per epoch
EPOCHS = 4          # 200 batches in all
INTERVAL = 7        # autosave every 7 steps


def manual_step(module: pl.LightningModule, loss: torch.Tensor) -> None:
    """One step of a module's dense optimizer (Lightning's) and its `sparse_opt`, by hand."""
    dense = module.optimizers()
    dense.zero_grad()
    module.sparse_opt.zero_grad()
    module.manual_backward(loss)
    dense.step()
    module.sparse_opt.step()


def dataset(n: int = N_SAMPLES, users: int = 300, items: int = 200, seed: int = 7) -> torch.utils.data.TensorDataset:
    """(sample index, user id, item id, label) of `n` samples drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    uid = user_ids(torch.randint(0, users, (n,), generator=g))
    iid = item_ids(torch.randint(0, items, (n,), generator=g))
    label = torch.randint(0, 2, (n,), generator=g).to(torch.float32)
    return torch.utils.data.TensorDataset(torch.arange(n), uid, iid, label)


class ResumableSampler(torch.utils.data.Sampler):
    """A shuffled order per epoch whose io state is the position *training* reached (Lightning
    fetches a batch ahead, so the sampler's own progress would be one batch too far): training_step
    calls advance(epoch, batch_idx); __iter__ starts after the batches done in that epoch."""

    def __init__(self, n: int, batch_size: int, seed: int = 0):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.batches_done = 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if self.batches_done * self.batch_size >= self.n:  # the previous epoch is complete
            self.epoch, self.batches_done = self.epoch + 1, 0
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter(order[self.batches_done * self.batch_size:].tolist())

    def advance(self, epoch: int, batch_idx: int) -> None:
        self.epoch, self.batches_done = epoch, batch_idx + 1

    def dump_io_state(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_io_state(self, state: Dict[str, int]) -> None:
        self.epoch, self.batches_done = int(state["epoch"]), int(state["batches_done"])


class Module(pl.LightningModule):
    """The helpers' CTR model; dense Adam from configure_optimizers, sparse Adagrad stepped by hand."""

    def __init__(self, sampler: ResumableSampler, fail_at: Optional[int] = None, kill_at: Optional[int] = None,
                 progress: Optional[str] = None, term_at_epoch_end: Optional[int] = None):
        super().__init__()
        self.automatic_optimization = False  # the sparse optimizer is not a torch optimizer
        self.model = CTR(seed=3)
        self.sparse_opt = SparseAdagrad(self.model, lr=0.05, initial_accumulator_value=0.1)
        self.sampler, self.fail_at, self.kill_at, self.progress = sampler, fail_at, kill_at, progress
        self.term_at_epoch_end = term_at_epoch_end
        self.seen: List[Tuple[int, int, int, List[int]]] = []  # (global step, epoch, batch_idx, samples)

    def training_step(self, batch, batch_idx):
        index, uid, iid, label = batch
        if self.fail_at is not None and len(self.seen) == self.fail_at:
            raise RuntimeError(f"killed at batch {self.fail_at}")
        if self.kill_at is not None and len(self.seen) == self.kill_at:
            if self.progress == "SIGTERM":  # a preemption notice: the callback saves and exits 143
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                _die(self.progress, (self.global_step, self.current_epoch, batch_idx))
        self.seen.append((self.global_step, self.current_epoch, batch_idx, index.tolist()))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.model(uid, iid), label)
        manual_step(self, loss)
        self.sampler.advance(self.current_epoch, batch_idx)
        return loss

    def on_train_epoch_end(self):
        # A preemption notice during epoch-end work (e.g. a metric over the whole epoch): after
        # the callback's on_train_epoch_end, which Lightning calls before the module's.
        if self.term_at_epoch_end == self.current_epoch:
            os.kill(os.getpid(), signal.SIGTERM)

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=1e-2)


def fit(output_dir: str, fail_at: Optional[int] = None, save_interval: int = INTERVAL, *,
        kill_at: Optional[int] = None, progress: Optional[str] = None, term_at_epoch_end: Optional[int] = None,
        close: bool = True):
    """A 4-epoch fit autosaving every `save_interval` steps into `output_dir` (resuming from it when
    it holds a checkpoint); it raises at global batch `fail_at`, or SIGKILLs itself at `kill_at`
    (SIGTERM with progress="SIGTERM"), or SIGTERMs itself at the end of epoch `term_at_epoch_end`.
    With `close` the Saver is closed after the fit, as a careful script does; without, only the
    callback releases it."""
    torch.manual_seed(0)
    sampler = ResumableSampler(N_SAMPLES, BATCH)
    module = Module(sampler, fail_at, kill_at, progress, term_at_epoch_end)
    saver = Saver(module, sparse_optim=module.sparse_opt, output_dir=output_dir, max_keep=2)
    saver.register_io_state("sampler", sampler)
    callback = RecsaveCallback(CheckpointManager(saver, save_interval))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=EPOCHS, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, sampler=sampler)
    try:
        trainer.fit(module, train_dataloaders=loader)
    finally:
        if close:
            saver.close()
    return module, trainer, callback


def state(module: Module, trainer) -> Dict[str, object]:
    return {"model": model_state(module.model), "sparse_opt": copy.deepcopy(module.sparse_opt.state_dict()),
            "dense_opt": copy.deepcopy(trainer.optimizers[0].state_dict()), "global_step": trainer.global_step,
            "epoch": trainer.current_epoch, "sampler": module.sampler.dump_io_state()}


def _die(progress: Optional[str], reached: Tuple[int, int, int]) -> None:
    """Records the batch reached, then dies the hard way: no exception, no callback, no cleanup."""
    if progress is not None:
        with open(progress, "w") as f:
            f.write(" ".join(map(str, reached)))
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")  # Lightning's tips and "not resumable" warnings
    command, out, kill_at, progress = sys.argv[1:]
    if command == "term-epoch-end":
        fit(out, term_at_epoch_end=int(kill_at))
    elif command in ("kill", "term"):
        fit(out, kill_at=int(kill_at), progress="SIGTERM" if command == "term" else progress)
    else:
        sys.exit(f"unknown command {command!r}")
    sys.exit("the fit ended without being killed")
