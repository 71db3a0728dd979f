"""Faults during loads (``stress_crash.py --mode load``): a job holding a trained model loads a
checkpoint (``CheckpointManager.restore()``, ``Saver.load()`` or ``Saver.load_model_bank``) and the
load is cut at a kill point inside the load path. A SIGKILLed process takes its memory with it, so
the kill points here raise an exception instead (before or after the k-th call of one function of
the load path, k drawn over the calls an uninterrupted load makes), in process. Afterwards the job
state (tables with slots, dense params and buffers, both optimizers, reader position: tests/helpers.py
job_state) must be exactly the state before the load or exactly the loaded one, never a mix; the
checkpoint directory must be byte-identical (a load writes nothing).
"""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from helpers import Reader, assert_jobs_equal, job_state, make_job  # tests/helpers.py

import recsave.format.reader
import recsave.format.torchio
import recsave.load.sources
import recsave.load.transaction
import recsave.tables.hashtable
import recsave.tables.optim
import recsave.tables.staging

CKPT_STEP, TRAINED_STEPS = 4, 7  # the checkpoint's step; the live model trains on past it

# name -> (owner, attribute, aliases bound by `from ... import`)
TARGETS: Dict[str, Tuple[Any, str, List[Tuple[Any, str]]]] = {
    "format.reader.read_tensors": (recsave.format.reader, "read_tensors",
                                   [(recsave.load.sources, "read_tensors")]),
    "format.torchio.load": (recsave.format.torchio, "load", []),
    # (defined by HashTable's staging mixin: patched where they are defined, so HashTable gets them)
    "HashTable.prepare_load": (recsave.tables.staging.TableStaging, "prepare_load", []),
    "HashTable.load_rows": (recsave.tables.staging.TableStaging, "load_rows", []),
    "HashTable.swap_contents": (recsave.tables.staging.TableStaging, "swap_contents", []),
    "LoadTransaction.apply": (recsave.load.transaction.LoadTransaction, "apply", []),
    "Optimizer.load_state_dict": (torch.optim.Optimizer, "load_state_dict", []),
    "SparseOptimizer.load_state_dict": (recsave.tables.optim.SparseOptimizer, "load_state_dict", []),
    "Reader.load_io_state": (Reader, "load_io_state", []),
}


class InjectedFault(Exception):
    """Raised by a kill point."""


def _wrap(name: str, hook: Callable[[str], None]) -> Callable[[], None]:
    """Wraps target `name` so that hook("before") / hook("after") run around every call; returns
    the function that undoes the wrapping."""
    owner, attr, aliases = TARGETS[name]
    original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        hook("before")
        result = original(*args, **kwargs)
        hook("after")
        return result
    setattr(owner, attr, wrapper)
    for o, a in aliases:
        setattr(o, a, wrapper)

    def undo() -> None:
        setattr(owner, attr, original)
        for o, a in aliases:
            setattr(o, a, original)
    return undo


def _count_calls(op: Callable[[], Any]) -> Counter:
    counts: Counter = Counter()
    undos = [_wrap(n, lambda when, n=n: counts.update([n]) if when == "before" else None) for n in TARGETS]
    try:
        op()
    finally:
        for undo in undos:
            undo()
    return counts


def _fault_at(name: str, k: int, when: str) -> Tuple[Callable[[], None], List[int]]:
    calls, fired = [0], []

    def hook(phase: str) -> None:
        if phase == "before":
            calls[0] += 1
        if calls[0] == k and phase == when and not fired:
            fired.append(1)
            raise InjectedFault(f"{name}:{k}:{when}")
    return _wrap(name, hook), fired


def _tree(path: str) -> Dict[str, str]:
    out = {}
    for base, _, files in os.walk(path):
        for f in files:
            if f.startswith(".recsave-writer.lock"):
                continue
            with open(os.path.join(base, f), "rb") as fh:
                out[os.path.relpath(os.path.join(base, f), path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    try:
        assert_jobs_equal(a, b)
        return True
    except AssertionError:
        return False


OPS = ("restore", "load", "load_model_bank")


def _run_op(job: Any, op: str, out: str) -> None:
    if op == "restore":
        job.manager.restore()
    elif op == "load":
        job.saver.load()
    else:
        job.saver.load_model_bank([{"path": out}])


def run(trials: int = 200, seed: int = 0, verbose: bool = False) -> Dict[str, Any]:
    rng = random.Random(seed)
    t_start = time.monotonic()
    work = tempfile.mkdtemp(prefix="recsave-stress-load-")
    out = os.path.join(work, "run")
    summary: Dict[str, Any] = {"mode": "load", "trials": 0, "faults_fired": 0, "no_fault": 0,
                               "outcomes": Counter(), "kill_points": Counter(), "failures": [], "seconds": 0.0}

    def trained_job() -> Any:
        job = make_job(out, save_interval=10**6, max_keep=2)
        job.train(TRAINED_STEPS)
        return job
    try:
        saving = make_job(out, save_interval=CKPT_STEP, max_keep=2)
        saving.train(CKPT_STEP)
        saving.manager.close()
        saved = job_state(saving)
        tree = _tree(out)
        before = job_state(trained_job())
        if _same(before, saved):
            raise SystemExit("the live model equals the checkpoint: the check could not tell them apart")
        loaded: Dict[str, Dict[str, Any]] = {}
        calls: Dict[str, Counter] = {}
        for op in OPS:  # uninterrupted: what each load gives, and the calls it makes
            job = trained_job()
            calls[op] = _count_calls(lambda job=job, op=op: _run_op(job, op, out))
            loaded[op] = job_state(job)
            job.saver.close()
        for op in ("restore", "load"):
            assert_jobs_equal(loaded[op], saved)  # a full load is exactly the checkpoint
        summary["calls_per_load"] = {op: dict(c) for op, c in calls.items()}
        for trial in range(trials):
            op = rng.choice(OPS)
            name = rng.choice(sorted(n for n in calls[op] if calls[op][n]))
            k, when = rng.randint(1, calls[op][name]), rng.choice(["before", "after"])
            job = trained_job()
            undo, fired = _fault_at(name, k, when)
            error: Optional[BaseException] = None
            try:
                _run_op(job, op, out)
            except InjectedFault as exc:
                error = exc
            except Exception as exc:  # any other error is a finding, reported below
                error = exc
            finally:
                undo()
            summary["trials"] += 1
            label = f"{op}:{name}:{when}"
            state = job_state(job)
            job.saver.close()
            failure = None
            if error is not None and not isinstance(error, InjectedFault):
                failure = f"{label}:{k}: the load raised {type(error).__name__}: {error}"
            elif fired:
                summary["faults_fired"] += 1
                summary["kill_points"][label] += 1
                outcome = "unchanged" if _same(state, before) else "loaded" if _same(state, loaded[op]) else "mixed"
                summary["outcomes"][outcome] += 1
                if outcome == "mixed":
                    failure = f"{label}:{k}: the job state is neither the one before the load nor the loaded one"
            else:
                summary["no_fault"] += 1
                if not _same(state, loaded[op]):
                    failure = f"{label}:{k}: no fault fired, yet the load differs from an uninterrupted one"
            if failure is None and _tree(out) != tree:
                failure = f"{label}:{k}: the checkpoint directory changed during a load"
            if failure is not None:
                summary["failures"].append({"trial": trial, "error": failure})
            if verbose:
                print(f"trial {trial}: {label}:{k} -> {'FAIL ' + failure if failure else 'ok'}", flush=True)
    finally:
        summary["seconds"] = round(time.monotonic() - t_start, 1)
        summary["work_dir"] = work
        if not summary["failures"]:
            shutil.rmtree(work, ignore_errors=True)
    summary["outcomes"] = dict(summary["outcomes"])
    summary["kill_points"] = dict(sorted(summary["kill_points"].items()))
    return summary


def print_summary(s: Dict[str, Any]) -> None:
    print("recsave load fault stress (an exception at a kill point inside the load path)")
    print(f"  trials                 {s['trials']}")
    print(f"  faults fired           {s['faults_fired']}   (no fault fired: {s['no_fault']})")
    print(f"  outcomes               {s['outcomes']}  (unchanged = as before the load, loaded = the checkpoint)")
    print("  kill points hit:")
    for name, n in s["kill_points"].items():
        print(f"    {name:<60} {n}")
    print(f"  failures (mixed states, stray errors, changed checkpoint) {len(s['failures'])}")
    print(f"  seconds                {s['seconds']}")
    for f in s["failures"][:10]:
        print(f"--- FAILURE trial {f['trial']}: {f['error']}")
    if s["failures"]:
        print(f"(evidence kept under {s['work_dir']})")
