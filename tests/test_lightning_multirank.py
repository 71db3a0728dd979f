"""recsave.lightning.RecsaveCallback in a real 2-rank DDP fit (gloo, CPU, one process per rank,
launched by the test as Lightning's LightningEnvironment expects): autosaves, validation saves with
a monitored metric ranked by keep_best, the end-of-fit save, and a second fit that resumes. The fit
is tests/lightning_ranks_job.py; each rank's tables are partitioned and its training_step looks up
only the ids it owns."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any, Dict, List

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning_job import ResumableSampler  # noqa: E402
from lightning_ranks_job import VAL_LOSS, Module  # noqa: E402

from recsave import Saver, describe, partition  # noqa: E402
from recsave.tools.catalog import list_checkpoints  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
pytestmark = pytest.mark.multirank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit_ranks(out: str, result: str, max_steps: int, max_keep: int, timeout: float = 300) -> List[Dict[str, Any]]:
    """One fit of tests/lightning_ranks_job.py with WORLD ranks, each its own process; the ranks'
    reports. A rank that fails, or a fit that outlasts `timeout` (a hang: every rank is killed),
    fails the test with every rank's output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "GROUP_RANK"))}
    env.update(RECSAVE_FSYNC="0", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD), NODE_RANK="0")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "lightning_ranks_job.py"), out, result,
                               str(max_steps), str(max_keep)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail(f"the {WORLD}-rank fit did not end within {timeout} s:\n" + "\n".join(outs))
    codes = [p.returncode for p in procs]
    assert codes == [0] * WORLD, "\n".join(f"--- rank {r}: exit {c}\n{o}" for r, (c, o) in enumerate(zip(codes, outs)))
    reports = []
    for r in range(WORLD):
        with open(f"{result}.{r}.json") as f:
            reports.append(json.load(f))
    assert [(rep["rank"], rep["world"]) for rep in reports] == [(r, WORLD) for r in range(WORLD)]
    return reports


def listed(out: str) -> List[str]:
    with open(os.path.join(out, "checkpoint")) as f:
        return f.read().split()


def assert_sharded(out: str, reports: List[Dict[str, Any]]) -> None:
    """Every listed checkpoint was written by both ranks (a shard and an io state each); the last
    one, loaded in this single process, holds exactly the rows both ranks held at the end."""
    for ckpt_id in listed(out):
        info = describe(os.path.join(out, ckpt_id))
        assert info["world_size"] == WORLD and info["missing"] == [], (ckpt_id, info)
        files = os.listdir(os.path.join(out, ckpt_id))
        assert {f"io_state_{r}.pt" for r in range(WORLD)} <= set(files), (ckpt_id, files)
        assert {f.split("-")[1] for f in files if f.startswith("sparse-")} == {str(r) for r in range(WORLD)}, files
        assert set(info["tables"]) == {"user", "item"}
    torch.manual_seed(0)
    module = Module(ResumableSampler(1, 1), 0, 1)
    Saver(module, output_dir=out).load(load_conf={"load": ["sparse"]})
    whole = module.tables()
    for name in ("user", "item"):
        ids = [torch.tensor(rep["at_end"][name][0], dtype=torch.int64) for rep in reports]
        for r, rank_ids in enumerate(ids):  # each rank held only the ids it owns
            assert bool((partition.owner_of(rank_ids, WORLD) == r).all()) and len(rank_ids) > 0
        rows = {i: row for rep in reports for i, row in zip(*rep["at_end"][name])}
        assert len(rows) == sum(len(i) for i in ids)  # no id on two ranks
        assert dict(zip(*whole[name])) == rows, name  # ids and rows of both ranks: bit-exact


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_rank_fit_autosaves_validates_keeps_best_and_resumes(tmp_path):
    out, result = str(tmp_path / "run"), str(tmp_path / "report")

    # Fit 1: 33 steps (epoch 0, then 13 batches of epoch 1), nothing pruned (max_keep=100). The
    # saves are those the job names in one process (run without WORLD_SIZE; the rules are
    # tests/test_lightning.py's): autosaves every 5 steps, steps 10, 20 and 30 saved by
    # validation's end with their val_loss, the sanity check not saved, the end of the fit.
    first = fit_ranks(out, result + "1", max_steps=33, max_keep=100)
    saved = [f"ckpt_{s}" for s in (5, 10, 15, 20, 25, 30, 33)]
    for rep in first:
        assert rep["restored_step"] is None and rep["global_step"] == 33
        assert rep["saved"] == saved
        assert [s for s, _, _ in rep["seen"]] == list(range(33))
        # The value logged with sync_dist=True is the mean over the ranks on every rank (each
        # rank logs its own, VAL_LOSS[step] -/+ 1/16): rank 0's alone would be 1/16 lower.
        assert rep["validated"] == [[s, VAL_LOSS[s]] for s in (10, 20, 30)]
    assert listed(out) == saved
    assert {c["id"]: c["metrics"] for c in list_checkpoints(out)} == {
        c: ({"val_loss": VAL_LOSS[int(c[5:])]} if int(c[5:]) % 10 == 0 else None) for c in saved}
    assert_sharded(out, first)

    # Fit 2 into the same dir: restores ckpt_33 on both ranks and trains steps 33..59 (the rest of
    # epoch 1 from batch 13, then epoch 2). Now max_keep=1 and keep_best=2 (lowest val_loss): of
    # the validations at 10..60 (0.5, 0.25, 0.75, 0.375, 0.625, 0.875) ckpt_20 and ckpt_40 are
    # kept as best, ckpt_60 (also the end-of-fit save) as the latest; every other one is pruned.
    second = fit_ranks(out, result + "2", max_steps=60, max_keep=1)
    for rep, before in zip(second, first):
        assert rep["restored_step"] == 33 and rep["global_step"] == 60
        assert [s for s, _, _ in rep["seen"]] == list(range(33, 60))
        # The batch after the last one trained. (Its epoch is not checked: Lightning ends the epoch
        # of a fit stopped by max_steps, so the resumed fit labels it epoch 2, as a fit resumed from
        # Lightning's own checkpoint of that fit does; an uninterrupted fit has epoch 1 there.)
        assert rep["seen"][0][2] == 13
        assert rep["at_start"] == before["at_end"]  # this rank's rows and ids, restored bit-exact
        assert rep["saved"] == [f"ckpt_{s}" for s in (35, 40, 45, 50, 55, 60)]
        assert rep["validated"] == [[s, VAL_LOSS[s]] for s in (40, 50, 60)]
    assert listed(out) == ["ckpt_20", "ckpt_40", "ckpt_60"]
    kept = {c["id"]: (c["metrics"], c["kept"]) for c in list_checkpoints(out)}
    assert kept == {"ckpt_20": ({"val_loss": 0.25}, ["best"]), "ckpt_40": ({"val_loss": 0.375}, ["best"]),
                    "ckpt_60": ({"val_loss": 0.875}, ["latest"])}
    assert sorted(os.listdir(out)) == ["checkpoint", "ckpt_20", "ckpt_40", "ckpt_60"]  # pruned dirs removed
    assert_sharded(out, second)
