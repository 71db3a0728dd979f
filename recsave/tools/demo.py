"""End-to-end demo of recsave in a small CTR training job (``make demo``).

1. trains a two-table CTR model on synthetic clicks with autosave, and kills itself (SIGKILL) mid-run;
2. a new process restores the latest committed checkpoint and finishes the run;
3. a second model (with an extra feature table) warm-starts from the first through a model bank.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from recsave import CheckpointManager, HashTable, Saver
from recsave.tables.optim import SparseAdagrad

USERS, ITEMS, DIM, BATCH = 1000, 500, 16, 256


class CTR(torch.nn.Module):
    def __init__(self, with_context: bool = False):
        super().__init__()
        self.user = HashTable(DIM, name="user", seed=1)
        self.item = HashTable(DIM, name="item", seed=2)
        self.context = HashTable(DIM, name="context", seed=3) if with_context else None
        width = DIM * (3 if with_context else 2)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, uid, iid, ctx=None):
        parts = [self.user(uid), self.item(iid)]
        if self.context is not None:
            parts.append(self.context(ctx))
        return self.mlp(torch.cat(parts, -1)).squeeze(-1)


class ClickReader:
    """Synthetic clicks: a hidden user/item affinity decides the click. Its position is io state."""

    def __init__(self):
        self.position = 0
        g = torch.Generator().manual_seed(1234)
        self.user_taste = torch.randn(USERS, 4, generator=g)
        self.item_style = torch.randn(ITEMS, 4, generator=g)

    def next_batch(self):
        g = torch.Generator().manual_seed(self.position)
        self.position += 1
        uid = torch.randint(0, USERS, (BATCH,), generator=g)
        iid = torch.randint(0, ITEMS, (BATCH,), generator=g)
        p = torch.sigmoid((self.user_taste[uid] * self.item_style[iid]).sum(-1) * 2)
        click = (torch.rand(BATCH, generator=g) < p).float()
        return uid * 7919 + 13, iid * 104729 + 7, click  # feature hashes, not dense indices

    def dump_io_state(self):
        return {"position": self.position}

    def load_io_state(self, state):
        self.position = int(state["position"])


def build(output_dir: str, with_context: bool = False, save_interval: int = 50, max_keep: int = 3,
          async_mode: str = "disabled"):
    torch.manual_seed(0)
    model = CTR(with_context)
    sparse_opt = SparseAdagrad(model, lr=0.2)
    dense_opt = torch.optim.Adam(model.mlp.parameters(), lr=3e-3)
    reader = ClickReader()
    saver = Saver(model, sparse_optim=sparse_opt, output_dir=output_dir, max_keep=max_keep)
    saver.register_for_checkpointing("dense_opt", dense_opt)
    saver.register_io_state("train_reader", reader)
    return model, sparse_opt, dense_opt, reader, CheckpointManager(saver, save_interval, async_mode=async_mode)


def train(model, sparse_opt, dense_opt, reader, mgr, until: int, kill_at: int = -1, ctx: bool = False) -> float:
    loss_fn = torch.nn.BCEWithLogitsLoss()
    recent = []
    while mgr.global_step < until:
        uid, iid, click = reader.next_batch()
        logits = model(uid, iid, (uid % 97) if ctx else None)
        loss = loss_fn(logits, click)
        loss.backward()
        dense_opt.step()
        sparse_opt.step()
        dense_opt.zero_grad()
        sparse_opt.zero_grad()
        recent.append(loss.item())
        path = mgr.step()
        if path:
            how = "" if mgr.async_mode == "disabled" else " (async: snapshot taken, writing behind)"
            loss = sum(recent) / len(recent)
            print(f"  step {mgr.global_step:4d}  loss {loss:.4f}  saved {os.path.basename(path)}{how}"
                  f"  ({len(model.user)} users, {len(model.item)} items)", flush=True)
            recent = []
        if mgr.global_step == kill_at:
            print(f"  step {mgr.global_step:4d}  -- simulating a crash: SIGKILL --", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return sum(recent) / max(len(recent), 1)


def stage_train(output_dir: str, steps: int, kill_at: int) -> None:
    model, so, do, reader, mgr = build(output_dir)
    print(f"  restore() -> step {mgr.restore()} (nothing committed yet)", flush=True)
    train(model, so, do, reader, mgr, steps, kill_at)


def stage_resume(output_dir: str, steps: int) -> None:
    # The resumed run saves asynchronously: autosaves cost training only a snapshot.
    model, so, do, reader, mgr = build(output_dir, async_mode="async")
    step = mgr.restore()
    print(f"  restored {os.path.basename(mgr.saver.latest_checkpoint())}: global_step {step}, reader at "
          f"batch {reader.position}, {len(model.user)} users, {len(model.item)} items", flush=True)
    print(f"  {mgr.last_report.summary()}", flush=True)
    train(model, so, do, reader, mgr, steps)
    mgr.save()  # the final save waits until committed
    mgr.close()
    print(f"  finished at step {mgr.global_step}; committed: "
          f"{[os.path.basename(p) for p in mgr.saver.checkpoints()]}", flush=True)


def stage_warm_start(bank_dir: str, output_dir: str) -> None:
    model, so, do, reader, mgr = build(output_dir, with_context=True, save_interval=0)
    entries = [{"path": bank_dir, "load": ["user*", "item*"], "exclude": ["io_state"]}]
    print(f"  model bank: {entries}", flush=True)
    report = mgr.load_model_bank(entries)
    print(f"  {report.summary()}", flush=True)
    print(f"  loaded: {report.names()}", flush=True)
    print(f"  left initialised: {report.skipped}", flush=True)
    loss = train(model, so, do, reader, mgr, 50, ctx=True)
    print(f"  v2 trained 50 steps, loss {loss:.4f}; saved {os.path.basename(mgr.save())}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="work directory (default: a fresh temporary one, removed at the end)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kill-at", type=int, default=230)
    ap.add_argument("--stage", choices=["all", "train", "resume"], default="all", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stage == "train":
        stage_train(args.dir, args.steps, args.kill_at)
        return 0
    if args.stage == "resume":
        stage_resume(args.dir, args.steps)
        return 0

    work = args.dir or tempfile.mkdtemp(prefix="recsave-demo-")
    run_dir, v2_dir = os.path.join(work, "ctr_v1"), os.path.join(work, "ctr_v2")
    started = time.time()
    try:
        child = [sys.executable, "-m", "recsave.tools.demo", "--dir", run_dir, "--steps", str(args.steps)]
        print(f"[1/3] training ctr_v1 with autosave every 50 steps into {run_dir}", flush=True)
        rc = subprocess.run(child + ["--stage", "train", "--kill-at", str(args.kill_at)]).returncode
        print(f"  training process ended with {'SIGKILL' if rc == -signal.SIGKILL else f'exit code {rc}'}; "
              f"'checkpoint' lists: {open(os.path.join(run_dir, 'checkpoint')).read().split()}", flush=True)
        print("[2/3] a new process restores the latest checkpoint and continues", flush=True)
        subprocess.run(child + ["--stage", "resume"], check=True)
        print("[3/3] ctr_v2 (adds a 'context' table) warm-starts from ctr_v1 through the model bank", flush=True)
        stage_warm_start(run_dir, v2_dir)
        print(f"demo finished in {time.time() - started:.1f} s", flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
