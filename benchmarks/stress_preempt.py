"""Preemption stress: send a real SIGTERM / SIGUSR1 to a training job (1 rank, or 2 gloo ranks) at a
random step and check that it exits with status 143 after committing ``ckpt_<step>``, and that a
restart restores that step and ends bit-exact with a run that was never interrupted.

    python benchmarks/stress_preempt.py [--runs 50] [--seed 0] [--world 1] [--json PATH]

The job is tests/preempt_job.py (two hash tables with Adagrad slots, an MLP with Adam registered as an
extra, a reader registered as io state; CheckpointManager(save_interval=5), save_on_preemption on).
Each run picks a step in [3, 40] and one of: a plain signal (to every rank, or with 2 ranks to rank 1
only), a second SIGTERM in the middle of the preemption save (nothing may change), or a SIGKILL in
the middle of it (the grace period ran out: the previous autosave must restore bit-exact). The checks
are those of tests/test_preempt.py. Exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, TESTS)

from test_preempt import preempt_and_check, reference_states  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--world", type=int, choices=[1, 2], default=1)
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    outcomes: Counter = Counter()
    failures = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="recsave-stress-preempt-") as tmp:
        reference = reference_states(pathlib.Path(tmp), args.world)
        for run in range(args.runs):
            kind = rng.choice(["signal", "signal", "second-signal", "kill-in-save"])
            sig = rng.choice([signal.SIGTERM, signal.SIGUSR1])
            to = [1] if args.world == 2 and kind == "signal" and rng.random() < 0.5 else None
            work = pathlib.Path(tmp) / f"run{run}"
            work.mkdir()
            label = f"{kind}/{sig.name}" + ("/rank1" if to else "")
            try:
                step = preempt_and_check(work, args.world, reference, rng.randrange(1 << 30), sig=sig, to=to,
                                         hook=None if kind == "signal" else kind)
                outcomes[label] += 1
                print(f"run {run}: {label}: restored step {step}, bit-exact", flush=True)
            except BaseException as exc:  # an AssertionError from the checks, or worse
                failures.append({"run": run, "kind": label, "error": "".join(traceback.format_exception(exc))[-2000:]})
                print(f"run {run}: {label}: FAILED\n{failures[-1]['error']}", flush=True)
    summary = {"runs": args.runs, "world": args.world, "seed": args.seed, "ok": dict(outcomes),
               "failures": failures, "seconds": round(time.monotonic() - start, 1)}
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, sort_keys=True),
          f"failures: {len(failures)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
