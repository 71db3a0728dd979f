"""Child process of tests/test_preempt.py and benchmarks/stress_preempt.py (not a test module): a
training job with a CheckpointManager that is preempted by a real signal.

    python preempt_job.py train OUT STEPS RANK WORLD INIT [HOOK]
        trains up to STEPS steps (autosave every 5), printing "step N" after each; a SIGTERM /
        SIGUSR1 makes the manager save, commit and raise Preempted (exit status 143). HOOK:
        "second-signal" (a second SIGTERM arrives in the middle of the preemption save) or
        "kill-in-save" (SIGKILL in the middle of the preemption save, after one shard file).
    python preempt_job.py resume OUT STEPS RANK WORLD INIT RESULT
        restores the latest checkpoint (prints "restored N"), trains up to STEPS, saves its state.
    python preempt_job.py reference STEPS RANK WORLD INIT RESULT
        an uninterrupted run of STEPS steps that never saves; saves its state.
    python preempt_job.py timed OUT STEPS RANK WORLD INIT RESULT
        save_interval_seconds=4.5 with a test clock per rank (rank 0: one second per step; others
        skewed and faster); writes the steps at which step() saved to RESULT (JSON).

PREEMPT_JOB_ASYNC=1 makes train / resume autosave with async_mode="async" (background writes run
collectives while step() agrees on the next save). WORLD 1 runs without torch.distributed (INIT is
then ignored). With several ranks each rank trains on the ids it owns (recsave.partition) and dense
gradients are averaged over the ranks.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from gloo_exit import exit_now
from helpers import Reader, model_state

import recsave
import recsave.save.pipeline
from recsave import CheckpointManager, HashTable, Saver, partition
from recsave.tables.optim import SparseAdagrad

torch.set_num_threads(1)
STEP_SECONDS = 0.004  # a small pause per step, so that a signal lands mid-run


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.user = HashTable(8, name="user", seed=5, init_std=0.05)
        self.item = HashTable(8, name="item", seed=6, init_std=0.05)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.mlp = torch.nn.Linear(16, 1)


class Job:
    def __init__(self, out, rank, world, *, save_interval=5, **manager_kw):
        self.rank, self.world = rank, world
        self.model = Model()
        self.sparse_opt = SparseAdagrad(self.model, lr=0.05)
        self.dense_opt = torch.optim.Adam(self.model.mlp.parameters(), lr=1e-2)
        self.reader = Reader()
        self.saver = Saver(self.model, sparse_optim=self.sparse_opt, output_dir=out, max_keep=None, concurrency=1)
        self.saver.register_for_checkpointing("dense_opt", self.dense_opt)
        self.saver.register_io_state("reader", self.reader)
        self.manager = CheckpointManager(self.saver, save_interval, **manager_kw) if save_interval is not None \
            else None

    def train_step(self):
        uid, iid, label = self.reader.next_batch()
        if self.world > 1:
            mine = (partition.owner_of(uid, self.world) == self.rank) & \
                (partition.owner_of(iid, self.world) == self.rank)
            uid, iid, label = uid[mine], iid[mine], label[mine]
        logits = self.model.mlp(torch.cat([self.model.user(uid), self.model.item(iid)], -1)).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label, reduction="sum")
        loss.backward()
        if self.world > 1:
            for p in self.model.mlp.parameters():
                dist.all_reduce(p.grad)
        for opt in (self.dense_opt, self.sparse_opt):
            opt.step()
            opt.zero_grad()

    def state(self):
        return {"model": model_state(self.model), "dense_opt": self.dense_opt.state_dict(),
                "sparse_opt": self.sparse_opt.state_dict(), "reader": self.reader.offset}


def install_hook(hook, job):
    original = recsave.save.pipeline.write_shards

    def write_shards(*args, **kwargs):
        part = original(*args, **kwargs)
        if job.manager.preempted:
            if hook == "second-signal":
                os.kill(os.getpid(), signal.SIGTERM)
            elif hook == "kill-in-save":
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return part
    recsave.save.pipeline.write_shards = write_shards


def train(job, steps, hook=None):
    if hook:
        install_hook(hook, job)
    while job.manager.global_step < steps:
        job.train_step()
        job.manager.step()
        print(f"step {job.manager.global_step}", flush=True)
        time.sleep(STEP_SECONDS)
    job.manager.close()
    print("finished", flush=True)


def main(argv):
    mode = argv[1]
    if mode == "reference":
        steps, rank, world, init, result = int(argv[2]), int(argv[3]), int(argv[4]), argv[5], argv[6]
        out = None
    else:
        out, steps, rank, world, init = argv[2], int(argv[3]), int(argv[4]), int(argv[5]), argv[6]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
    kw = {"async_mode": "async"} if os.environ.get("PREEMPT_JOB_ASYNC") else {}
    try:
        if mode == "train":
            train(Job(out, rank, world, **kw), steps, argv[7] if len(argv) > 7 else None)
        elif mode == "resume":
            job = Job(out, rank, world, **kw)
            print(f"restored {job.manager.restore()}", flush=True)
            train(job, steps)
            torch.save(job.state(), argv[7])
        elif mode == "reference":
            job = Job(os.path.dirname(result), rank, world, save_interval=None)
            for _ in range(steps):
                job.train_step()
            torch.save(job.state(), result)
        elif mode == "timed":
            now = {"t": 0.0}
            job = Job(out, rank, world, save_interval=0, save_interval_seconds=4.5, clock=lambda: now["t"])
            saved = []
            while job.manager.global_step < steps:
                job.train_step()
                step = job.manager.global_step + 1
                now["t"] = float(step) if rank == 0 else 1000.0 + 3.7 * step  # skewed, faster clock
                if job.manager.step() is not None:
                    saved.append(step)
            job.manager.close()
            with open(argv[7], "w") as f:
                json.dump(saved, f)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        status = main(sys.argv)
    except SystemExit as stop:  # Preempted: status 143
        if not isinstance(stop.code, int):
            raise
        status = stop.code
    exit_now(status)
