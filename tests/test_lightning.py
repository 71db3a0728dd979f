"""recsave.lightning.RecsaveCallback: a Lightning fit stopped mid-epoch resumes at the same batch and
ends bit-identical to an uninterrupted fit (tables, slots, dense, optimizers, loop counters)."""
from __future__ import annotations

import copy
from typing import Dict, List, Optional, Tuple

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from helpers import CTR, assert_obj_equal, assert_states_equal, item_ids, model_state, user_ids  # noqa: E402

from recsave import CheckpointManager, Saver  # noqa: E402
from recsave.errors import ArgumentTypeError  # noqa: E402
from recsave.lightning import RecsaveCallback  # noqa: E402
from recsave.tables.optim import SparseAdagrad  # noqa: E402

N_SAMPLES = 800
BATCH = 16          # 50 batches per epoch
EPOCHS = 4          # 200 batches in all
INTERVAL = 7        # autosave every 7 steps
FAIL_AT = 123       # global batch that raises: epoch 2, batch 23; the last save is step 119 (batch 19)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    uid = user_ids(torch.randint(0, 300, (N_SAMPLES,), generator=g))
    iid = item_ids(torch.randint(0, 200, (N_SAMPLES,), generator=g))
    label = torch.randint(0, 2, (N_SAMPLES,), generator=g).to(torch.float32)
    return torch.utils.data.TensorDataset(torch.arange(N_SAMPLES), uid, iid, label)


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

    def __init__(self, sampler: ResumableSampler, fail_at: Optional[int] = None):
        super().__init__()
        self.automatic_optimization = False  # the sparse optimizer is not a torch optimizer
        self.model = CTR(seed=3)
        self.sparse_opt = SparseAdagrad(self.model, lr=0.05, initial_accumulator_value=0.1)
        self.sampler, self.fail_at = sampler, fail_at
        self.seen: List[Tuple[int, int, int, List[int]]] = []  # (global step, epoch, batch_idx, samples)

    def training_step(self, batch, batch_idx):
        index, uid, iid, label = batch
        if self.fail_at is not None and len(self.seen) == self.fail_at:
            raise RuntimeError(f"killed at batch {self.fail_at}")
        self.seen.append((self.global_step, self.current_epoch, batch_idx, index.tolist()))
        dense = self.optimizers()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.model(uid, iid), label)
        dense.zero_grad()
        self.sparse_opt.zero_grad()
        self.manual_backward(loss)
        dense.step()
        self.sparse_opt.step()
        self.sampler.advance(self.current_epoch, batch_idx)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=1e-2)


def fit(output_dir: str, fail_at: Optional[int] = None, save_interval: int = INTERVAL):
    torch.manual_seed(0)
    sampler = ResumableSampler(N_SAMPLES, BATCH)
    module = Module(sampler, fail_at)
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
        saver.close()
    return module, trainer, callback


def state(module: Module, trainer) -> Dict[str, object]:
    return {"model": model_state(module.model), "sparse_opt": copy.deepcopy(module.sparse_opt.state_dict()),
            "dense_opt": copy.deepcopy(trainer.optimizers[0].state_dict()), "global_step": trainer.global_step,
            "epoch": trainer.current_epoch, "sampler": module.sampler.dump_io_state()}


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning: a plain DataLoader is "not resumable"
def test_fit_killed_mid_epoch_resumes_at_the_same_batch_and_ends_equal(tmp_path):
    ref_module, ref_trainer, _ = fit(str(tmp_path / "ref"))
    assert len(ref_module.seen) == EPOCHS * N_SAMPLES // BATCH

    out = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="killed at batch 123"):
        fit(out, fail_at=FAIL_AT)
    resumed, trainer, callback = fit(out)
    last_save = FAIL_AT // INTERVAL * INTERVAL  # 119
    assert callback.restored_step == last_save
    # The resumed fit starts at the batch after the last save: same step, epoch, batch index, samples.
    assert resumed.seen[0][:3] == (last_save, 2, last_save - 2 * 50)
    assert resumed.seen == ref_module.seen[last_save:]
    s_ref, s_run = state(ref_module, ref_trainer), state(resumed, trainer)
    assert_states_equal(s_ref.pop("model"), s_run.pop("model"), "model")  # tables, slots, dense: torch.equal
    assert_obj_equal(s_ref, s_run, "state")  # both optimizers, loop counters, sampler position
    assert callback.saved[-1].endswith(f"ckpt_{EPOCHS * 50}")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fresh_fit_saves_every_interval_and_at_the_end(tmp_path):
    module, trainer, callback = fit(str(tmp_path / "run"), save_interval=60)
    assert callback.restored_step is None
    assert [p.rsplit("/", 1)[-1] for p in callback.saved] == ["ckpt_60", "ckpt_120", "ckpt_180", "ckpt_200"]
    assert trainer.global_step == 200


def test_arguments_are_checked(tmp_path):
    saver = Saver(CTR(), output_dir=str(tmp_path))
    with pytest.raises(ArgumentTypeError):
        RecsaveCallback(saver)  # a Saver, not a CheckpointManager
    with pytest.raises(ArgumentTypeError):
        RecsaveCallback(CheckpointManager(saver, 5), restore=1)
