"""Short runs of the reliability tools in benchmarks/: SIGKILL during autosave and faults during loads
(stress_crash.py, --mode load) and
corruption fuzzing of the reader (fuzz.py). Each runs as its own process (it forks jobs after
importing torch, and this test process has used the C++ engine's thread pool already)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # many processes, SIGKILLed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _run(script, args, tmp_path, timeout=300):
    out = tmp_path / "summary.json"
    env = dict(os.environ, RECSAVE_FSYNC="0")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), *args, "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc.stdout


def test_sigkill_during_autosave_never_loses_the_last_checkpoint(tmp_path):
    s, text = _run("stress_crash.py", ["--trials", "20", "--seed", "7"], tmp_path)
    assert s["trials"] == 20
    assert s["failures"] == [], text
    assert s["kills"] >= 10, text
    point_kills = sum(n for name, n in s["kill_points"].items() if not name.startswith("delay"))
    assert point_kills >= 5, text
    assert s["restores_verified"] >= s["trials"] // 2, text


def test_faults_inside_loads_leave_the_model_before_or_loaded_never_mixed(tmp_path):
    s, text = _run("stress_crash.py", ["--mode", "load", "--trials", "40", "--seed", "7"], tmp_path)
    assert s["mode"] == "load" and s["trials"] == 40
    assert s["failures"] == [], text
    assert s["faults_fired"] >= 30, text
    assert set(s["outcomes"]) <= {"unchanged", "loaded"}, text
    assert len({name.split(":")[0] for name in s["kill_points"]}) == 3, text  # restore, load, bank


def test_corrupted_checkpoints_raise_or_load_identical(tmp_path):
    s, text = _run("fuzz.py", ["--mutations", "300", "--seed", "3"], tmp_path)
    assert s["mutations"] == 300
    assert s["failures"] == [], text
    errors = sum(n for c in s["tally"].values() for k, n in c.items() if k.endswith(":error"))
    assert errors > 300, text  # most mutations are detected (both loaders count)


def test_damaged_checkpoint_list_never_loses_a_committed_checkpoint(tmp_path):
    s, text = _run("fuzz.py", ["--mutations", "40", "--seed", "5", "--kinds", "list,dirs"], tmp_path)
    assert s["mutations"] == 40
    assert s["failures"] == [], text
    assert sum(c.get("restore:newest-intact", 0) for c in s["tally"].values()) == 40, text
    assert sum(c.get("after:kept-exactly", 0) for c in s["tally"].values()) == 40, text
    assert sum(c.get("warned:rebuilt", 0) for c in s["tally"].values()) >= 10, text


def test_sigkill_during_delta_saves_rebases_and_pruning_keeps_every_chain(tmp_path):
    s, text = _run("stress_crash.py", ["--full-every", "3", "--trials", "20", "--seed", "11"], tmp_path)
    assert s["full_every"] == 3 and s["trials"] == 20
    assert s["failures"] == [], text
    assert s["kills"] >= 10, text
    assert s["trials_with_delta_listed"] >= 10, text  # the listed checkpoints were chains
    assert "recsave.save.delta.as_delta" in s["calls_per_run"], text  # the delta kill points were armed
    assert s["max_listed"] > 2, text  # rotation kept a kept delta's parents beyond max_keep=2
    assert s["restores_verified"] >= s["trials"], text


def test_damage_to_a_delta_or_its_parent_is_detected(tmp_path):
    s, text = _run("fuzz.py", ["--chain", "--mutations", "80", "--seed", "3"], tmp_path)
    assert s["chain"] is True and s["mutations"] == 80
    assert s["failures"] == [], text
    detected = sum(n for note, n in s["notes"].items()
                   if note.startswith("chain: only the parent's index / rows damaged -> load error"))
    assert detected >= 5, text  # parent-only damage made the delta refuse to load


def test_sigkill_during_async_saves_that_copy_only_changed_rows(tmp_path):
    s, text = _run("stress_crash.py", ["--async-changed", "--trials", "20", "--seed", "6"], tmp_path)
    assert s["async_changed"] is True and s["trials"] == 20
    assert s["failures"] == [], text  # every listed checkpoint restores bit for bit
    assert s["kills"] >= 10, text
    assert s["restores_verified"] >= s["trials"], text
