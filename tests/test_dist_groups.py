"""recsave's own gloo groups ("save", "step") belong to torch.distributed: destroy_process_group()
frees them and their gloo threads, so none is left running into interpreter exit (where tearing
them down aborted processes with "terminate called without an active exception"), and a new init
gets new, working groups."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import datetime, gc, json, os, sys, weakref
    import torch.distributed as dist
    from recsave.storage import dist as rdist

    def gloo_threads():
        names = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    names.append(f.read().strip())
            except OSError:  # the thread ended meanwhile
                pass
        return sorted(n for n in names if "gloo" in n)

    out = {}
    for attempt in range(2):
        dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}-{attempt}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
        save, step = rdist.recsave_group("save"), rdist.recsave_group("step")
        dist.barrier(group=save)
        dist.barrier(group=step)
        out[f"same_{attempt}"] = rdist.recsave_group("save") is save and save is not step
        refs = [weakref.ref(save), weakref.ref(step)]
        del save, step
        out[f"running_{attempt}"] = len(gloo_threads())
        dist.destroy_process_group()
        gc.collect()
        out[f"freed_{attempt}"] = [r() is None for r in refs]
        out[f"left_{attempt}"] = gloo_threads()
    print(json.dumps(out))
""")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through /proc")
def test_destroy_process_group_frees_recsaves_groups_and_their_threads(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "init")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for attempt in range(2):
        assert out[f"same_{attempt}"] is True  # one group per purpose, reused
        assert out[f"running_{attempt}"] > 0  # the groups did start gloo threads
        assert out[f"freed_{attempt}"] == [True, True]
        assert out[f"left_{attempt}"] == []


def test_run_everywhere_agrees_on_one_value_of_one_kind():
    """agree (a value given) and agree_on_result (fn's result) are exclusive, and the result is agreed
    on only where every rank runs fn."""
    from recsave.storage import dist

    assert dist.run_everywhere("x", lambda: 3, 1, agree_on_result="the answer") == 3
    with pytest.raises(ValueError, match="agree or agree_on_result, not both"):
        dist.run_everywhere("x", lambda: 3, 1, agree=("a", 1), agree_on_result="b")
    with pytest.raises(ValueError, match="needs fn run on every rank"):
        dist.run_everywhere("x", lambda: 3, 1, only_rank0=True, agree_on_result="b")
