"""One process of the Lightning fit of tests/test_lightning_multirank.py (not a test module).

    python lightning_ranks_job.py OUT RESULT MAX_STEPS MAX_KEEP

A fit into OUT of at most MAX_STEPS global steps (20 batches per epoch), autosaving every
SAVE_INTERVAL steps, validating every VAL_EVERY batches with RecsaveCallback(monitor="val_loss")
and a manager that keeps the KEEP_BEST lowest val_loss checkpoints (and the Saver's MAX_KEEP
newest); it restores OUT's latest checkpoint first, when there is one. With WORLD_SIZE=2 (and
RANK, LOCAL_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT) in the environment the process is one rank
of a DDP fit over gloo launched by the test (Lightning's LightningEnvironment, nothing spawned);
each rank's tables are partitioned (set_partition) and its training_step looks up only the ids of
the batch that the rank owns. Without WORLD_SIZE it is a plain 1-process fit (the reference).
Every rank writes what it saw to RESULT.<rank>.json.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl
import lightning_job
import torch
from gloo_exit import exit_now
from lightning_job import ResumableSampler

from recsave import CheckpointManager, HashTable, Saver, partition
from recsave.lightning import RecsaveCallback
from recsave.tables.optim import SparseAdagrad

torch.set_num_threads(1)

N_SAMPLES = 320
BATCH = 16           # 20 batches per epoch
SAVE_INTERVAL = 5
VAL_EVERY = 10       # validation after batches 10 and 20 of each epoch: global steps 10, 20, 30, ...
KEEP_BEST = 2
DIM = 4
# The val_loss of the validation at each global step (0: the sanity check); exact in float32. Rank
# r logs VAL_LOSS[step] + RANK_SHIFT[r]: the mean over the ranks (sync_dist=True) is VAL_LOSS[step],
# rank 0's own value is not.
VAL_LOSS = {0: 9.0, 10: 0.5, 20: 0.25, 30: 0.75, 40: 0.375, 50: 0.625, 60: 0.875}
RANK_SHIFT = (-0.0625, 0.0625)


def dataset() -> torch.utils.data.TensorDataset:
    return lightning_job.dataset(N_SAMPLES, users=120, items=80, seed=11)


class Module(pl.LightningModule):
    """Two partitioned tables and a dense head; sparse Adagrad stepped by hand, dense Adam by Lightning."""

    def __init__(self, sampler: ResumableSampler, rank: int, world: int):
        super().__init__()
        self.automatic_optimization = False
        self.rank_, self.world = rank, world
        self.user = HashTable(DIM, name="user", seed=5, init_std=0.05)
        self.item = HashTable(DIM, name="item", seed=6, init_std=0.05)
        if world > 1:  # a rank inserts only the ids it owns (anything else raises UsageError)
            self.user.set_partition(rank, world)
            self.item.set_partition(rank, world)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.head = torch.nn.Linear(2 * DIM, 1)
        self.sparse_opt = SparseAdagrad(self, lr=0.05)
        self.sampler = sampler
        self.seen: List[List[int]] = []           # [global step, epoch, batch_idx] of each training batch
        self.validated: List[List[float]] = []    # [global step, val_loss in callback_metrics] per validation
        self.at_start: Dict[str, Any] = {}          # the tables when training starts (after a restore)

    def tables(self) -> Dict[str, Any]:
        """Each table's ids (sorted) and their rows, as lists."""
        out = {}
        for name, table in (("user", self.user), ("item", self.item)):
            ids, rows, _ = table.export()
            order = torch.argsort(ids)
            out[name] = [ids[order].tolist(), rows[order].tolist()]
        return out

    def on_train_start(self):
        self.at_start = self.tables()

    def embed(self, table: HashTable, ids: torch.Tensor) -> torch.Tensor:
        """The rows of the ids this rank owns, zeros for the others."""
        if self.world == 1:
            return table(ids)
        out = torch.zeros(len(ids), DIM)
        mine = partition.owner_of(ids, self.world) == self.rank_
        out[mine] = table(ids[mine])
        return out

    def training_step(self, batch, batch_idx):
        _, uid, iid, label = batch
        self.seen.append([self.global_step, self.current_epoch, batch_idx])
        logits = self.head(torch.cat([self.embed(self.user, uid), self.embed(self.item, iid)], -1)).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label)
        lightning_job.manual_step(self, loss)
        self.sampler.advance(self.current_epoch, batch_idx)

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        shift = RANK_SHIFT[self.rank_] if self.world > 1 else 0.0
        self.log("val_loss", VAL_LOSS[self.global_step] + shift, sync_dist=True)

    def on_validation_end(self):  # after the callback's on_validation_end (its save)
        if not self.trainer.sanity_checking:
            self.validated.append([self.global_step, float(self.trainer.callback_metrics["val_loss"])])

    def configure_optimizers(self):
        return torch.optim.Adam(self.head.parameters(), lr=1e-2)


def main() -> None:
    warnings.filterwarnings("ignore")  # Lightning's tips and "not resumable" warnings
    out, result, max_steps, max_keep = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    sampler = ResumableSampler(N_SAMPLES, BATCH)
    module = Module(sampler, rank, world)
    saver = Saver(module, sparse_optim=module.sparse_opt, output_dir=out, max_keep=max_keep)
    saver.register_io_state("sampler", sampler)
    manager = CheckpointManager(saver, SAVE_INTERVAL, keep_best=KEEP_BEST, best_metric="val_loss", best_mode="min")
    callback = RecsaveCallback(manager, monitor="val_loss")
    if world > 1:
        strategy: Any = pl.strategies.DDPStrategy(process_group_backend="gloo")
    else:
        strategy = "auto"
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=max_steps,
                         callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                         val_check_interval=VAL_EVERY, limit_val_batches=1, use_distributed_sampler=False)
    train = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, sampler=sampler)
    val = torch.utils.data.DataLoader(dataset(), batch_size=BATCH)
    try:
        trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    finally:
        saver.close()
    report: Dict[str, Any] = {
        "rank": trainer.global_rank, "world": trainer.world_size, "global_step": trainer.global_step,
        "restored_step": callback.restored_step, "saved": [os.path.basename(p) for p in callback.saved],
        "seen": module.seen, "validated": module.validated,
        "at_start": module.at_start, "at_end": module.tables(),
    }
    with open(f"{result}.{rank}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
    exit_now(0)
