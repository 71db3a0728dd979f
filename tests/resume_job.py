"""Child process of tests/test_resume.py (not a test module): a training job in a fresh interpreter.

    python resume_job.py resume OUT K RESULT   restore ckpt_K from OUT, train K more steps (the manager
                                               autosaves ckpt_2K), torch.save the job's state to RESULT
    python resume_job.py kill POINT OUT        train 5 steps (autosave ckpt_5), train 5 more and get
                                               SIGKILLed at POINT inside the save of ckpt_10
    python resume_job.py kill-all BASE         `kill POINT BASE/POINT` for every kill point, each in a
                                               process forked from this one (torch is imported once);
                                               prints one line per point: POINT STATUS, where STATUS
                                               is "signal N" or "exit N"

Kill points: after_first_shard (one shard file written), after_model_pt, before_index (model.pt and
extra.pt written), after_index (index written, the `checkpoint` list not yet rewritten); with an
``async-`` prefix, the same inside the background write of an async save.
"""
from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from helpers import job_state, make_job

import recsave.format.index
import recsave.format.torchio
import recsave.save.pipeline

KILL_POINTS = ("after_first_shard", "after_model_pt", "before_index", "after_index")
# The same points inside the background write of an async save (CheckpointManager async_mode).
ASYNC_KILL_POINTS = ("async-after_first_shard", "async-after_index")


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill_point(point: str) -> None:
    if point == "after_first_shard":
        original = recsave.save.pipeline.write_shards

        def write_shards(*args, **kwargs):
            part = original(*args, **kwargs)
            _die()
            return part
        recsave.save.pipeline.write_shards = write_shards
    elif point == "after_model_pt":
        original_save = recsave.format.torchio.save

        def save(storage, directory, fname, obj, rank):
            entry = original_save(storage, directory, fname, obj, rank)
            if fname == "model.pt":
                _die()
            return entry
        recsave.format.torchio.save = save
    elif point in ("before_index", "after_index"):
        original_write = recsave.format.index.write_bytes  # every index write goes through it

        def write(*args, **kwargs):
            if point == "before_index":
                _die()
            path = original_write(*args, **kwargs)
            _die()
            return path
        recsave.format.index.write_bytes = write
    else:
        raise SystemExit(f"unknown kill point {point!r}")


def kill_run(point: str, out: str) -> int:
    mode = "async" if point.startswith("async-") else "disabled"
    job = make_job(out, save_interval=5, max_keep=3, async_mode=mode)
    job.train(5)
    job.manager.wait()  # ckpt_5 is committed before the kill point is armed
    install_kill_point(point.removeprefix("async-"))
    job.train(5)
    job.manager.wait()  # an async save of ckpt_10 is killed in its background thread
    print(f"kill point {point} was never reached", file=sys.stderr)
    return 3


def kill_all(base: str) -> int:
    # torch.optim imports torch._dynamo on first use (seconds): do it once, before forking.
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    for point in KILL_POINTS + ASYNC_KILL_POINTS:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the job: trains, saves, and is killed (or exits 3 if the kill point is missed)
            code = 4
            try:
                code = kill_run(point, os.path.join(base, point))
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            print(f"{point} signal {os.WTERMSIG(status)}", flush=True)
        else:
            print(f"{point} exit {os.WEXITSTATUS(status)}", flush=True)
    return 0


def main(argv) -> int:
    mode = argv[1]
    if mode == "resume":
        out, k, result = argv[2], int(argv[3]), argv[4]
        job = make_job(out, save_interval=k, max_keep=None)
        step = job.manager.restore()
        if step != k:
            raise SystemExit(f"restored step {step}, expected {k}")
        job.train(k)
        if job.manager.global_step != 2 * k:
            raise SystemExit(f"global step {job.manager.global_step} after training, expected {2 * k}")
        torch.save(job_state(job), result)
        return 0
    if mode == "kill":
        return kill_run(argv[2], argv[3])
    if mode == "kill-all":
        return kill_all(argv[2])
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
