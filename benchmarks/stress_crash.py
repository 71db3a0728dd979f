"""Crash-consistency stress: SIGKILL an autosaving training job at random moments and check that the
latest committed checkpoint always restores bit for bit and that the job carries on from it.

    python benchmarks/stress_crash.py [--trials 200] [--seed 0] [--save-interval 2] [--json PATH]
    python benchmarks/stress_crash.py --full-every 3 [--trials 200] ...   (chain mode: delta saves)
    python benchmarks/stress_crash.py --mode load [--trials 200] [--seed 0]   (faults during loads:
        benchmarks/stress_load.py)
    python benchmarks/stress_crash.py --async-changed [--full-every K] ...   (async autosaves that copy
        only the rows changed since the previous one: knob stage_changed_rows)

The job is the small CTR job of tests/helpers.py (two hash tables with Adagrad slots, batch norm,
MLP, Adam registered as an extra, a reader registered as io state) driven by a CheckpointManager with
a small save_interval and max_keep=2, so pruning and the `checkpoint` rewrite happen at every save.

With ``--full-every K`` (chain mode) the manager autosaves a chain (docs/FORMAT.md section 10): a
full checkpoint, then deltas, a full one (a rebase) every K-th save (``full_every=K``, rebase_ratio
high enough never to force one), so rotation must keep every chain member a kept delta needs. The
kill points then also cover the delta path (save/delta.py: the chain check, taking the changes,
the delta index; the parent's index CRC32C; the manager's delta-or-full policy), and the parent
checks that every listed delta's chain is listed and on disk.

Each trial forks a child (torch is imported once, by this process, which itself never calls into the
C++ engine: its thread pool would not survive a fork) that restores the latest committed checkpoint,
checks it against the reference, and trains on (autosaving) until it is killed:

* `delay`: the parent SIGKILLs it after a random wall-clock delay (anywhere in the run: restore,
  training, inside the C++ shard writes, the commit, pruning);
* a kill point: the child wraps one function of the save path (``_RECSAVE_STRESS_KILL=
  target:k:before|after``) and SIGKILLs itself on the k-th call, before or after the real call.

After every kill a fresh forked process restores every checkpoint listed in `checkpoint` (the latest
through ``CheckpointManager.restore()``) into a fresh model and compares the job state (tables with
slots, row metadata and table step, dense params and buffers, both optimizers, reader position) bit
for bit with a reference run that was never interrupted. The parent also checks that the latest
committed step never goes back, that every listed directory has its index, and that leftovers of
killed saves (unlisted directories) are gone once a later save has committed. Exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
for p in (TESTS, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

os.environ.setdefault("RECSAVE_FSYNC", "0")  # SIGKILL keeps the page cache: fsync adds nothing here

sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/_common.py)
import torch  # noqa: E402
from helpers import assert_jobs_equal, job_state, make_job  # noqa: E402

import recsave  # noqa: E402
import recsave.format.chain  # noqa: E402
import recsave.format.ckptlist  # noqa: E402
import recsave.format.index  # noqa: E402
import recsave.format.torchio  # noqa: E402
import recsave.format.writer  # noqa: E402
import recsave.save.delta  # noqa: E402
import recsave.save.pipeline  # noqa: E402
import recsave.save.policy  # noqa: E402
import recsave.storage.local  # noqa: E402

KILL_ENV = "_RECSAVE_STRESS_KILL"  # not RECSAVE_*: recsave warns of unknown ones
MAX_KEEP = 2

# name -> (owner object, attribute, other (owner, attribute) pairs bound to the same function by
# `from ... import`, which must be patched too)
TARGETS: Dict[str, Tuple[Any, str, List[Tuple[Any, str]]]] = {
    "recsave.format.writer.write_shards": (recsave.format.writer, "write_shards",
                                           [(recsave.save.pipeline, "write_shards")]),
    "recsave.format.torchio.save": (recsave.format.torchio, "save", []),
    "recsave.format.torchio.save_bytes": (recsave.format.torchio, "save_bytes", []),
    # every index write goes through write_bytes (a save's commit calls it directly)
    "recsave.format.index.write_bytes": (recsave.format.index, "write_bytes", []),
    "recsave.format.ckptlist.write": (recsave.format.ckptlist, "write", []),
    "recsave.format.ckptlist.collect_garbage": (recsave.format.ckptlist, "collect_garbage", []),
    "recsave.storage.local.LocalStorage.write_atomic": (recsave.storage.local.LocalStorage, "write_atomic", []),
    "recsave.storage.local.LocalStorage.remove_tree": (recsave.storage.local.LocalStorage, "remove_tree", []),
    # rotation moves a pruned checkpoint into .recsave+pruned before a thread deletes it
    "recsave.storage.local.LocalStorage.move_tree_aside": (recsave.storage.local.LocalStorage, "move_tree_aside",
                                                           []),
}
# Chain mode only (a run without deltas never calls them): the delta-save path. Callers use them
# as module attributes (`delta.take`, `chain.read_with_crc`, `policy.wants_delta`), so patching the
# module is enough.
CHAIN_TARGETS: Dict[str, Tuple[Any, str, List[Tuple[Any, str]]]] = {
    "recsave.save.delta.why_full": (recsave.save.delta, "why_full", []),
    "recsave.save.delta.take": (recsave.save.delta, "take", []),
    "recsave.save.delta.with_tables": (recsave.save.delta, "with_tables", []),
    "recsave.save.delta.as_delta": (recsave.save.delta, "as_delta", []),
    "recsave.format.chain.read_with_crc": (recsave.format.chain, "read_with_crc", []),
    "recsave.format.chain.index_crc": (recsave.format.chain, "index_crc", []),
    "recsave.save.policy.chain_bytes": (recsave.save.policy, "chain_bytes", []),
    "recsave.save.policy.wants_delta": (recsave.save.policy, "wants_delta", []),
    # the commit point of a delta: index.write_bytes counting only calls that write a delta's index
    "recsave.format.index.write_bytes[delta]": (recsave.format.index, "write_bytes", []),
}
# Targets that count (and kill at) only the calls this predicate of (args, kwargs) accepts.
FILTERS: Dict[str, Callable[[tuple, dict], bool]] = {
    "recsave.format.index.write_bytes[delta]": lambda args, kwargs: b'"kind":"delta"' in bytes(
        args[1] if len(args) > 1 else kwargs.get("data", b"")),
}
# The run's settings, set by run() before anything forks: the manager's keywords (chain mode:
# full_every) and the kill targets.
MANAGER_KW: Dict[str, Any] = {}
ACTIVE: Dict[str, Tuple[Any, str, List[Tuple[Any, str]]]] = dict(TARGETS)
ASYNC_MODE = ["disabled"]


def configure(full_every: Optional[int], async_changed: bool = False) -> None:
    """Chain mode (`full_every` K) or the plain mode (None): manager keywords and kill targets. With
    `async_changed`, the manager saves asynchronously with the knob stage_changed_rows (set in the
    environment, so every forked child has it): every async save after a job's first copies only
    the rows changed since, and its checkpoints must still restore bit for bit."""
    MANAGER_KW.clear()
    ACTIVE.clear()
    ACTIVE.update(TARGETS)
    if full_every is not None:
        MANAGER_KW.update(full_every=full_every, rebase_ratio=1e9)
        ACTIVE.update(CHAIN_TARGETS)
    ASYNC_MODE[0] = "async" if async_changed else "disabled"
    if async_changed:
        os.environ["RECSAVE_STAGE_CHANGED_ROWS"] = "1"
    else:
        os.environ.pop("RECSAVE_STAGE_CHANGED_ROWS", None)


def new_job(out: str, interval: Optional[int]):
    return make_job(out, save_interval=interval, max_keep=MAX_KEEP, async_mode=ASYNC_MODE[0],
                    manager_kw=dict(MANAGER_KW))


def train(job, steps: int) -> None:
    """`steps` training steps, then (async mode) waits for the last autosave's write: a run that
    ends does not abandon a write in progress."""
    job.train(steps)
    job.manager.wait()


def state_of(job) -> Dict[str, Any]:
    """The job state with row metadata and table steps (what a delta must carry over too)."""
    return job_state(job, row_meta=True)


def _die() -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def install_kill_point(spec: str, counts: Optional[Counter] = None) -> None:
    """`spec` is ``target:k:before|after`` (SIGKILL on the k-th call), or, with `counts`, ``count``
    (count the calls of every target, kill nothing)."""
    if spec == "count":
        for name in ACTIVE:
            _wrap(name, lambda name=name: counts.__setitem__(name, counts[name] + 1), None)
        return
    target, k, when = spec.split(":")
    k = int(k)
    calls = [0]

    def before() -> None:
        calls[0] += 1
        if calls[0] == k and when == "before":
            _die()

    def after() -> None:
        if calls[0] == k and when == "after":
            _die()
    _wrap(target, before, after)


def _wrap(name: str, before: Callable[[], None], after: Optional[Callable[[], None]]) -> None:
    owner, attr, aliases = ACTIVE[name]
    original = getattr(owner, attr)
    accept = FILTERS.get(name)

    def wrapper(*args, **kwargs):
        if accept is not None and not accept(args, kwargs):
            return original(*args, **kwargs)
        before()
        result = original(*args, **kwargs)
        if after is not None:
            after()
        return result
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, attr, wrapper)
    for o, a in aliases:
        setattr(o, a, wrapper)


# ------------------------------------------------------------------------------------ processes
def _fork(fn: Callable[[], int]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 4
        try:
            code = fn()
        except BaseException:
            traceback.print_exc()
            code = 4
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"


def _wait(pid: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return _status(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.002)


def read_list(out: str) -> List[str]:
    """The committed ids. A kill between the first index and the first `checkpoint` write leaves no
    list: readers then rebuild it from the indexes (docs/FORMAT.md section 1)."""
    path = os.path.join(out, "checkpoint")
    ids: List[str] = []
    if os.path.exists(path):
        with open(path) as f:
            ids = [line.strip() for line in f if line.strip()]
    if not ids and os.path.isdir(out):
        ids = sorted((d for d in os.listdir(out) if os.path.isfile(os.path.join(out, d, "index"))), key=step_of)
    return ids


def step_of(ckpt_id: str) -> int:
    return int(ckpt_id.split("_", 1)[1])


# ---------------------------------------------------------------------------------- the children
def make_references(path: str, horizon: int, interval: int) -> None:
    """Runs the job uninterrupted (it never saves) and torch.saves its state at every save step."""
    def run() -> int:
        with tempfile.TemporaryDirectory() as tmp:
            job = new_job(tmp, None)
            states = {0: state_of(job)}
            for step in range(1, horizon + 1):
                job.train(1)
                if step % interval == 0:
                    states[step] = state_of(job)
            torch.save(states, path)
        return 0
    status = _wait(_fork(run), 600)
    if status != "exit 0":
        raise SystemExit(f"reference run failed ({status})")


def job_child(out: str, interval: int, expected_step: int, steps: int, refs: Dict[int, Any],
              kill: Optional[str], err_path: str) -> int:
    """The training job: restore, check, install the kill point, train (autosaving)."""
    try:
        job = new_job(out, interval)
        step = job.manager.restore()
        if step != expected_step:
            raise AssertionError(f"restore() returned step {step}, the checkpoint file's latest is {expected_step}")
        assert_jobs_equal(state_of(job), refs[step])
        if kill:
            os.environ[KILL_ENV] = kill
            install_kill_point(os.environ[KILL_ENV])
        train(job, steps)
        return 0
    except BaseException:
        with open(err_path, "w") as f:
            f.write(traceback.format_exc())
        return 5


def verify_child(out: str, interval: int, refs: Dict[int, Any], err_path: str, result_path: str) -> int:
    """A fresh process and fresh models: every listed checkpoint restores and equals the reference."""
    try:
        listed = read_list(out)
        verified = 0
        for i, ckpt_id in enumerate(listed):
            job = new_job(out, interval)
            if i == len(listed) - 1:
                step = job.manager.restore()
                if step != step_of(ckpt_id):
                    raise AssertionError(f"restore() gave step {step}, the latest listed is {ckpt_id}")
            else:
                step = job.manager.restore(step_of(ckpt_id))
            assert_jobs_equal(state_of(job), refs[step])
            verified += 1
        with open(result_path, "w") as f:
            f.write(str(verified))
        return 0
    except BaseException:
        with open(err_path, "w") as f:
            f.write(traceback.format_exc())
        return 6


def calibrate(work: str, interval: int, steps: int, refs: Dict[int, Any]) -> Tuple[Counter, float]:
    """Calls of each target and the wall time of one uninterrupted trial run (from a first save on)."""
    out = os.path.join(work, "calibrate")
    counts_path = os.path.join(work, "counts.json")

    def warm() -> int:  # step 0 -> one save, so the timed run restores like later trials
        job = new_job(out, interval)
        train(job, interval)
        return 0
    if _wait(_fork(warm), 300) != "exit 0":
        raise SystemExit("calibration warm-up failed")

    def count() -> int:
        counts: Counter = Counter()
        job = new_job(out, interval)
        job.manager.restore()
        install_kill_point("count", counts)
        train(job, steps)
        with open(counts_path, "w") as f:
            json.dump(counts, f)
        return 0
    t0 = time.monotonic()
    status = _wait(_fork(count), 300)
    elapsed = time.monotonic() - t0
    if status != "exit 0":
        raise SystemExit(f"calibration failed ({status})")
    with open(counts_path) as f:
        counts = Counter(json.load(f))
    missing = [t for t in ACTIVE if not counts.get(t)]
    if missing:
        raise SystemExit(f"calibration: kill targets never called during a run: {missing}")
    shutil.rmtree(out, ignore_errors=True)
    return counts, elapsed


# --------------------------------------------------------------------------------------- driver
def run(trials: int = 200, seed: int = 0, interval: int = 2, saves_per_trial: int = 3,
        horizon: int = 120, verbose: bool = False, full_every: Optional[int] = None,
        async_changed: bool = False) -> Dict[str, Any]:
    configure(full_every, async_changed)
    if full_every is not None:  # a trial crosses a rebase and then prunes the previous chain
        saves_per_trial = max(saves_per_trial, full_every + 1)
    rng = random.Random(seed)
    t_start = time.monotonic()
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking
    steps = interval * saves_per_trial
    work = tempfile.mkdtemp(prefix="recsave-stress-")
    out = os.path.join(work, "run")
    summary: Dict[str, Any] = {"trials": 0, "kills": 0, "completed_without_kill": 0, "kill_points": Counter(),
                               "restores_verified": 0, "leftovers_removed": 0, "commits_seen": 0,
                               "epochs": 1, "stray_temp_files": 0, "failures": [], "seconds": 0.0,
                               "full_every": full_every, "async_changed": async_changed,
                               "max_listed": 0, "deltas_listed": 0,
                               "trials_with_delta_listed": 0}
    try:
        ref_path = os.path.join(work, "references.pt")
        make_references(ref_path, horizon, interval)
        refs = torch.load(ref_path, weights_only=False)
        counts, run_seconds = calibrate(work, interval, steps, refs)
        summary["calls_per_run"] = dict(counts)
        summary["run_seconds"] = round(run_seconds, 3)
        prev_latest = 0
        leftovers_before: Dict[str, Tuple[int, int]] = {}
        for trial in range(trials):
            listed = read_list(out)
            latest = step_of(listed[-1]) if listed else 0
            if latest + steps > horizon:  # past the references: start a fresh job in a fresh dir
                shutil.rmtree(out, ignore_errors=True)
                summary["epochs"] += 1
                listed, latest, prev_latest, leftovers_before = [], 0, 0, {}
            if rng.random() < 0.45:
                kill, delay = None, rng.uniform(0.0, run_seconds * 1.1)
                label = "delay"
            else:
                target = rng.choice(sorted(ACTIVE))
                when = rng.choice(["before", "after"])
                k = rng.randint(1, counts[target])
                kill, delay, label = f"{target}:{k}:{when}", None, f"{target}:{when}"
            err = os.path.join(work, f"err-{trial}")
            pid = _fork(functools.partial(job_child, out, interval, latest, steps, refs, kill, err))
            if delay is not None:
                deadline = time.monotonic() + delay
                status = None
                while time.monotonic() < deadline:
                    done, st = os.waitpid(pid, os.WNOHANG)
                    if done:
                        status = _status(st)
                        break
                    time.sleep(0.001)
                if status is None:
                    os.kill(pid, signal.SIGKILL)
                    status = _wait(pid, 60)
            else:
                status = _wait(pid, 120)
            summary["trials"] += 1
            failure = None
            if status == f"signal {int(signal.SIGKILL)}":
                summary["kills"] += 1
                now = read_list(out)
                unlisted = _unlisted_dirs(out, now)
                if label == "delay":
                    label = "delay:mid-save" if unlisted or _has_temp(out) else "delay:outside-save"
                summary["kill_points"][label] += 1
            elif status == "exit 0":
                summary["completed_without_kill"] += 1
            else:
                detail = open(err).read() if os.path.exists(err) else ""
                failure = f"job child {status} (kill {kill or 'delay'}):\n{detail}"
            if failure is None:
                failure = _check_dir(out, latest, prev_latest, leftovers_before, summary, interval,
                                     finished=status == "exit 0", full_every=full_every)
            if failure is None:
                verr, vres = os.path.join(work, f"verr-{trial}"), os.path.join(work, f"vres-{trial}")
                vstatus = _wait(_fork(functools.partial(verify_child, out, interval, refs, verr, vres)), 120)
                if vstatus != "exit 0":
                    detail = open(verr).read() if os.path.exists(verr) else ""
                    failure = f"verification {vstatus}:\n{detail}"
                else:
                    summary["restores_verified"] += int(open(vres).read())
            if failure is not None:
                summary["failures"].append({"trial": trial, "kill": kill or f"delay {delay:.3f}s",
                                            "error": failure})
                # Keep the evidence, then start over in a fresh directory.
                keep = os.path.join(work, f"failed-{trial}")
                if os.path.exists(out):
                    shutil.copytree(out, keep, symlinks=True)
                    shutil.rmtree(out, ignore_errors=True)
                summary["epochs"] += 1
                prev_latest, leftovers_before = 0, {}
            else:
                now = read_list(out)
                prev_latest = step_of(now[-1]) if now else 0
                leftovers_before = _dir_ids(out, _unlisted_dirs(out, now))
            if verbose:
                print(f"trial {trial}: {kill or f'delay {delay:.3f}s'} -> {status}; "
                      f"listed {read_list(out)}; {'FAIL' if failure else 'ok'}", flush=True)
        summary["stray_temp_files"] = len(_temp_files(out))
    finally:
        summary["seconds"] = round(time.monotonic() - t_start, 1)
        summary["work_dir"] = work
        if not summary["failures"]:
            shutil.rmtree(work, ignore_errors=True)
    summary["kill_points"] = dict(sorted(summary["kill_points"].items()))
    return summary


def _unlisted_dirs(out: str, listed: List[str]) -> set:
    if not os.path.isdir(out):
        return set()
    return {n for n in os.listdir(out) if os.path.isdir(os.path.join(out, n)) and n not in listed}


def _dir_ids(out: str, names) -> Dict[str, Tuple[int, int]]:
    ids = {}
    for n in names:
        try:
            st = os.lstat(os.path.join(out, n))
        except FileNotFoundError:
            continue
        ids[n] = (st.st_ino, st.st_ctime_ns)
    return ids


def _temp_files(out: str) -> List[str]:
    found = []
    for dirpath, _, files in os.walk(out):
        found += [os.path.join(dirpath, f) for f in files if ".tmp-" in f]
    return found


def _has_temp(out: str) -> bool:
    return bool(_temp_files(out))


def _parent_of(out: str, ckpt_id: str) -> Optional[str]:
    """The parent id a checkpoint's index names (None: a full checkpoint), read as plain JSON (this
    process never calls into the C++ engine)."""
    with open(os.path.join(out, ckpt_id, "index"), "rb") as f:
        raw = json.loads(f.read())
    parent = raw.get("parent")
    return None if parent is None else str(parent["id"])


def _chain_problem(out: str, listed: List[str], summary: Dict[str, Any]) -> Optional[str]:
    """Every listed delta's chain (parents up to the base) is listed and committed: rotation kept
    what a kept delta needs (docs/FORMAT.md section 10)."""
    deltas = 0
    for ckpt_id in listed:
        seen, cur = {ckpt_id}, _parent_of(out, ckpt_id)
        deltas += cur is not None
        while cur is not None:
            if cur not in listed or not os.path.isfile(os.path.join(out, cur, "index")):
                return f"{ckpt_id} needs {cur}, which is not listed or has no index (listed {listed})"
            if cur in seen:
                return f"{ckpt_id}'s chain visits {cur} twice"
            seen.add(cur)
            cur = _parent_of(out, cur)
    summary["deltas_listed"] += deltas
    summary["trials_with_delta_listed"] += deltas > 0
    return None


def _check_dir(out: str, latest_before: int, prev_latest: int, leftovers_before: Dict[str, Tuple[int, int]],
               summary: Dict[str, Any], interval: int, finished: bool,
               full_every: Optional[int] = None) -> Optional[str]:
    """Checks on the output dir after a trial that need no restore."""
    try:
        listed = read_list(out)
    except Exception as exc:
        return f"the checkpoint file is unreadable: {exc!r}"
    latest = step_of(listed[-1]) if listed else 0
    if latest < prev_latest or latest < latest_before:
        return f"latest committed step went back: {latest_before} -> {latest} (listed {listed})"
    # Chain mode: the last MAX_KEEP plus the chain members they need; at most a whole chain of the
    # older one (K members) and the newest (a rebase, full).
    bound = MAX_KEEP if full_every is None else max(MAX_KEEP, full_every + 1)
    summary["max_listed"] = max(summary["max_listed"], len(listed))
    if len(listed) > bound:
        return f"{len(listed)} checkpoints listed with max_keep={MAX_KEEP}, full_every={full_every}: {listed}"
    for ckpt_id in listed:
        if not os.path.isfile(os.path.join(out, ckpt_id, "index")):
            return f"listed checkpoint {ckpt_id} has no index (listed {listed})"
    try:
        problem = _chain_problem(out, listed, summary)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        problem = f"a listed index cannot be read as JSON: {exc!r}"
    if problem:
        return problem
    unlisted = _unlisted_dirs(out, listed)
    if latest > latest_before:
        summary["commits_seen"] += 1
    # Saves of this trial that returned (the last commit of a killed run may have been cut short
    # between the `checkpoint` rewrite and its garbage collection).
    completed = (latest - latest_before) // interval - (0 if finished else 1)
    if completed >= 1:
        # A save completed during this trial: leftovers of earlier kills must be gone (or committed).
        # (A name re-created and committed by this trial, then pruned, is not the same leftover: the
        # directory's identity is its inode and ctime.)
        now_ids = _dir_ids(out, unlisted)
        stale = sorted(n for n in leftovers_before if now_ids.get(n) == leftovers_before[n])
        if stale:
            return f"leftover uncommitted dirs {stale} survived a later successful save (listed {listed})"
        summary["leftovers_removed"] += len(set(leftovers_before) - set(listed) - unlisted)
    # New this trial: at most the checkpoints one rotation dropped (one; a whole chain of K in
    # chain mode) whose removal a kill cut short, and the directory of a save cut short. Leftovers
    # of earlier trials may still be there when no save of this trial got through its garbage
    # collection (a kill between the `checkpoint` rewrite and the removal, trial after trial);
    # the check above makes sure the first completed save removes them.
    now_ids = _dir_ids(out, unlisted)
    new = sorted(n for n in unlisted if leftovers_before.get(n) is None or now_ids.get(n) != leftovers_before[n])
    if len(new) > (2 if full_every is None else full_every + 1):
        return f"uncommitted dirs accumulate: {new} new this trial (listed {listed}, unlisted {sorted(unlisted)})"
    return None


def print_summary(s: Dict[str, Any]) -> None:
    chain = f", chain mode full_every={s['full_every']}" if s.get("full_every") else ""
    chain += ", async saves copying changed rows (stage_changed_rows)" if s.get("async_changed") else ""
    print(f"recsave crash-consistency stress (SIGKILL during autosave, max_keep=2{chain})")
    print(f"  trials                 {s['trials']}")
    print(f"  kills (SIGKILL)        {s['kills']}   runs that finished before the kill: "
          f"{s['completed_without_kill']}")
    print("  kill points hit:")
    for name, n in s["kill_points"].items():
        print(f"    {name:<52} {n}")
    print(f"  saves committed in killed/finished runs (trials with a new commit): {s['commits_seen']}")
    print(f"  restores verified      {s['restores_verified']}  (bit-exact vs the uninterrupted reference)")
    if s.get("full_every"):
        print(f"  deltas listed after trials {s['deltas_listed']} (in {s['trials_with_delta_listed']} trials); "
              f"most checkpoints listed at once {s['max_listed']}")
    print(f"  leftover dirs removed by a later save: {s['leftovers_removed']}")
    print(f"  stray *.tmp-<pid> files at the end: {s['stray_temp_files']}")
    print(f"  job epochs (fresh output dirs)      {s['epochs']}")
    print(f"  failures (lost / wrong checkpoints) {len(s['failures'])}")
    print(f"  seconds                {s['seconds']}")
    for f in s["failures"][:10]:
        print(f"--- FAILURE trial {f['trial']} ({f['kill']}):\n{f['error']}")
    if s["failures"]:
        print(f"(evidence kept under {s['work_dir']})")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-interval", type=int, default=2)
    ap.add_argument("--horizon", type=int, default=120, help="steps of the reference run")
    ap.add_argument("--full-every", type=int, metavar="K",
                    help="chain mode: autosave deltas, a full checkpoint every K-th save (K >= 2)")
    ap.add_argument("--async-changed", action="store_true",
                    help="async autosaves with the knob stage_changed_rows (each copies only the rows changed since)")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--mode", choices=["save", "load"], default="save",
                    help="save: SIGKILL during autosaves; load: faults inside loads (stress_load.py)")
    args = ap.parse_args(argv)
    if args.mode == "load":
        import stress_load  # benchmarks/stress_load.py

        s = stress_load.run(args.trials, args.seed, verbose=args.verbose)
        stress_load.print_summary(s)
        return C.finish(s, args.json)
    if args.full_every is not None and args.full_every < 2:
        ap.error("--full-every must be >= 2 (1 would make every save full)")
    s = run(args.trials, args.seed, args.save_interval, horizon=args.horizon, verbose=args.verbose,
            full_every=args.full_every, async_changed=args.async_changed)
    print_summary(s)
    return C.finish(s, args.json)


if __name__ == "__main__":
    sys.exit(main())
