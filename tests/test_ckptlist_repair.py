"""A lost, emptied, garbled or cut-short `checkpoint` file is rebuilt from the committed checkpoints' indexes
(docs/FORMAT.md sections 1 and 5): restore, listing, rotation and gc never fall back to "nothing
committed" and never delete a committed checkpoint; `recsave repair` rewrites the file."""
from __future__ import annotations

import collections
import json
import os
import shutil
import warnings

import pytest
from helpers import assert_jobs_equal, job_state, make_job, read_index_json, write_index_json

import recsave
from recsave.format import chain, ckptlist
from recsave.storage import LocalStorage, get_storage
from recsave.tools import catalog
from recsave.tools.cli import main as cli_main

IDS = ["ckpt_10", "ckpt_20", "ckpt_30"]
FULL = "ckpt_10\nckpt_20\nckpt_30\n"

# damage -> (what it does to the `checkpoint` file, the problem the warning names)
DAMAGE = {
    "deleted": (None, "is missing"),
    "emptied": (b"", "is empty"),
    "blank_lines": (b"\n \n\n", "is empty"),
    "not_utf8": (b"ckpt_10\n\xff\xfe\n", "is not UTF-8 text"),
    "bad_line": (b"ckpt_10\n../x\nckpt_30\n", "line 2 '../x' is not a checkpoint id"),
    "all_stale": (b"ckpt_99\nckpt_98\n", "lists no checkpoint whose index exists: ckpt_99, ckpt_98"),
    # cut inside its last line: trusting ckpt_10 and ckpt_20 would prune ckpt_30, the newest
    "cut_short": (b"ckpt_10\nckpt_20\nckpt_", "is cut short: its last line 'ckpt_' has no newline and names no "
                                                 "checkpoint"),
}
REBUILT = r"rebuilt the list of committed checkpoints from their indexes: ckpt_10, ckpt_20, ckpt_30"


def _list_path(out) -> str:
    return os.path.join(out, "checkpoint")


def _list_file(out):
    """The `checkpoint` file's bytes, None when it is missing."""
    try:
        with open(_list_path(out), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _damage(out, damage: str) -> None:
    data = DAMAGE[damage][0]
    if data is None:
        os.remove(_list_path(out))
    else:
        with open(_list_path(out), "wb") as f:
            f.write(data)


def _dirs(out):
    return sorted(n for n in os.listdir(out) if os.path.isdir(os.path.join(out, n)))


@pytest.fixture()
def run(tmp_path):
    """ckpt_10/20/30 committed by a manager job (max_keep 3), plus a crash leftover without index
    and an unrelated directory; returns (output dir, job state at step 30)."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=10, max_keep=3)
    for step in (10, 20, 30):
        job.train(1)
        job.manager.global_step = step
        job.manager.save()
    state = job_state(job)
    job.saver.close()
    shutil.copytree(os.path.join(out, "ckpt_30"), os.path.join(out, "ckpt_35"))
    os.remove(os.path.join(out, "ckpt_35", "index"))  # a crash before the commit point
    os.makedirs(os.path.join(out, "notes"))
    assert _list_file(out) == FULL.encode()
    return out, state


def _warning(caught, out, damage):
    """The one rebuild warning among `caught`; checks it names the file and the problem."""
    rebuilt = [w for w in caught if "rebuilt the list" in str(w.message)]
    assert len(rebuilt) == 1, [str(w.message) for w in caught]
    assert rebuilt[0].category is RuntimeWarning
    msg = str(rebuilt[0].message)
    assert msg.startswith(f"{_list_path(out)}: {DAMAGE[damage][1]}; "), msg
    assert f"from their indexes: {', '.join(IDS)}" in msg
    return msg


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_restore_rebuilds_in_memory_and_warns_once(run, damage):
    out, state = run
    _damage(out, damage)
    before = _list_file(out)
    fresh = make_job(out, save_interval=10, max_keep=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fresh.manager.restore() == 30
    msg = _warning(caught, out, damage)
    assert f"run `recsave repair {out}`" in msg
    assert_jobs_equal(job_state(fresh), state)
    assert _list_file(out) == before  # a pure read does not write
    assert _dirs(out) == ["ckpt_10", "ckpt_20", "ckpt_30", "ckpt_35", "notes"]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_saver_listing_is_rebuilt(run, damage):
    out, _ = run
    _damage(out, damage)
    before = _list_file(out)
    saver = make_job(out, max_keep=3).saver
    with pytest.warns(RuntimeWarning, match=REBUILT):
        assert saver.checkpoints() == [os.path.join(out, i) for i in IDS]
    assert saver.latest_checkpoint() == os.path.join(out, "ckpt_30")
    assert _list_file(out) == before


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_plain_load_of_the_output_dir_uses_the_rebuilt_list(run, damage):
    out, state = run
    _damage(out, damage)
    fresh = make_job(out, max_keep=3)
    with pytest.warns(RuntimeWarning, match=REBUILT):
        report = fresh.saver.load()
    assert report.checkpoints == [os.path.join(out, "ckpt_30")]
    assert_jobs_equal(job_state(fresh), state)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_rotation_after_a_save_prunes_the_rebuilt_list(run, damage):
    out, state = run
    _damage(out, damage)
    fresh = make_job(out, save_interval=10, max_keep=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fresh.manager.restore() == 30
        fresh.train(1)
        fresh.manager.global_step = 40
        fresh.manager.save()
    msgs = [str(w.message) for w in caught if "rebuilt the list" in str(w.message)]
    assert len(msgs) == 2, msgs  # the read, then the save that rewrote the file
    assert msgs[1].endswith("; rewrote the file"), msgs[1]
    fresh.saver.close()
    assert _list_file(out) == b"ckpt_20\nckpt_30\nckpt_40\n"
    assert _dirs(out) == ["ckpt_20", "ckpt_30", "ckpt_40", "notes"]  # ckpt_10 pruned, the leftover gone
    check = make_job(out, save_interval=10)
    assert check.manager.restore(30) == 30
    assert_jobs_equal(job_state(check), state)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_gc_keeps_every_committed_checkpoint_and_rewrites_the_file(run, damage):
    out, _ = run
    _damage(out, damage)
    with pytest.warns(RuntimeWarning, match=REBUILT + "; rewrote the file"):
        assert catalog.collect_garbage(out) == ["ckpt_35"]
    assert _list_file(out) == FULL.encode()
    assert _dirs(out) == ["ckpt_10", "ckpt_20", "ckpt_30", "notes"]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_repair_rewrites_the_file(run, damage, capsys):
    out, _ = run
    _damage(out, damage)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # repair reports, it does not warn
        assert cli_main(["repair", out]) == (1 if damage in ("all_stale", "cut_short") else 0)  # stale ids left out
    text = capsys.readouterr().out
    assert f"{_list_path(out)}: {DAMAGE[damage][1]}" in text
    assert "rebuilt from the indexes: ckpt_10, ckpt_20, ckpt_30" in text
    assert _list_file(out) == FULL.encode()
    assert _dirs(out) == ["ckpt_10", "ckpt_20", "ckpt_30", "ckpt_35", "notes"]  # repair deletes nothing
    # and again: the file is fine now
    assert cli_main(["repair", out]) == 0
    assert f"{_list_path(out)}: fine, lists 3 checkpoint(s): ckpt_10, ckpt_20, ckpt_30" in capsys.readouterr().out


def test_repair_api_reports_what_it_did(run):
    out, _ = run
    _damage(out, "not_utf8")
    result = catalog.repair(out)
    assert result == {"output_dir": out, "file": _list_path(out), "problem": "is not UTF-8 text",
                      "ids": IDS, "stale": [], "left_out": {}, "rebuilt": True, "rewritten": True}
    assert catalog.repair(out) == {"output_dir": out, "file": _list_path(out), "problem": None, "ids": IDS,
                                   "stale": [], "left_out": {}, "rebuilt": False, "rewritten": False}


def test_repair_exits_1_when_something_damaged_is_left_out(run, capsys):
    out, _ = run
    with open(os.path.join(out, "ckpt_20", "index"), "w") as f:
        f.write("{not json")
    os.remove(_list_path(out))
    assert cli_main(["repair", out]) == 1
    text = capsys.readouterr().out
    assert "rebuilt from the indexes: ckpt_10, ckpt_30" in text
    assert "left out ckpt_20: " in text and "index is not UTF-8 JSON" in text
    assert _list_file(out) == b"ckpt_10\nckpt_30\n"


def test_repair_drops_a_listed_checkpoint_whose_index_is_damaged(run, capsys):
    """The list reads fine but names ckpt_20, whose index no longer validates (ls says so and
    points at repair): repair said "fine" and exited 0. It leaves the list now, its directory
    stays, and the exit status is 1."""
    out, _ = run
    with open(os.path.join(out, "ckpt_20", "index"), "w") as f:
        f.write("{not json")
    assert cli_main(["repair", out]) == 1
    text = capsys.readouterr().out
    assert "it lists ckpt_20, whose index is damaged; rewrote it without them: ckpt_10, ckpt_30" in text
    assert "left out ckpt_20: " in text and "index is not UTF-8 JSON" in text
    assert _list_file(out) == b"ckpt_10\nckpt_30\n" and os.path.isdir(os.path.join(out, "ckpt_20"))
    assert cli_main(["repair", out]) == 0  # nothing left to repair


def test_repair_leaves_listed_an_index_it_cannot_read_whole(run, capsys):
    """An index over this process's knob max_index_bytes (a job that raised it for a large index)
    is not proven damaged: unlisting it would roll the job back to the checkpoint before."""
    out, _ = run
    size = os.path.getsize(os.path.join(out, "ckpt_30", "index"))
    with recsave.knobs.override(max_index_bytes=size - 1):
        assert cli_main(["repair", out]) == 0
    assert _list_file(out) == FULL.encode()


def test_a_directory_in_place_of_the_list_is_named_not_an_io_error(run, capsys):
    """repair and gc failed with exit 3 ("writing failed: Is a directory"), and ls pointed at
    repair: each says to move the directory away now, and nothing of it is changed."""
    out, _ = run
    os.remove(_list_path(out))
    os.mkdir(_list_path(out))
    with open(os.path.join(_list_path(out), "mine.txt"), "w") as f:
        f.write("x")
    with pytest.warns(RuntimeWarning, match="a directory is in its place: move it away"):
        assert cli_main(["ls", out]) == 0
    for command in ("repair", "gc"):
        assert cli_main([command, out]) == 2
        assert "is a directory, where recsave keeps the list of committed checkpoints; move it away" in \
            capsys.readouterr().err
    assert os.listdir(_list_path(out)) == ["mine.txt"]
    os.rename(_list_path(out), os.path.join(out, "moved"))
    assert cli_main(["repair", out]) == 0 and _list_file(out) == FULL.encode()


def test_repair_exits_1_for_stale_entries_and_2_when_nothing_is_there(run, tmp_path, capsys):
    out, _ = run
    with open(_list_path(out), "w") as f:
        f.write("ckpt_10\nckpt_15\nckpt_20\nckpt_30\n")
    shutil.rmtree(os.path.join(out, "ckpt_10"))
    assert cli_main(["repair", out]) == 1
    text = capsys.readouterr().out
    assert "lists checkpoints whose directory or index is gone: ckpt_10, ckpt_15" in text
    assert "rewrote it without them: ckpt_20, ckpt_30" in text and "dropped ckpt_10, ckpt_15" in text
    assert _list_file(out) == b"ckpt_20\nckpt_30\n"
    assert cli_main(["repair", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err



def test_repair_drops_a_list_whose_every_id_is_gone(tmp_path, capsys):
    """Every listed checkpoint's directory removed: nothing to rebuild from, yet the ids are stale.
    repair drops them (an empty list), says so and exits 1 (it said "fine" and exited 0)."""
    out = tmp_path / "run"
    job = _two_saved(out)
    job.saver.close()
    shutil.rmtree(out / "ckpt_1")
    shutil.rmtree(out / "ckpt_2")
    assert cli_main(["repair", str(out)]) == 1
    text = capsys.readouterr().out
    assert "lists no checkpoint whose index exists: ckpt_1, ckpt_2; rewrote it without them: none" in text
    assert "dropped ckpt_1, ckpt_2" in text and _list_file(str(out)) == b""
    assert cli_main(["repair", "--json", str(out)]) == 0  # now it is only empty, nothing stale
    assert json.loads(capsys.readouterr().out)["stale"] == []


def _one_damaged_checkpoint(out) -> None:
    """An output dir whose only checkpoint, ckpt_1, has a damaged index."""
    job = make_job(str(out), max_keep=None)
    job.train(1)
    job.saver.save("ckpt_1")
    job.saver.close()
    (out / "ckpt_1" / "index").write_bytes(b"{garbage")


def test_repair_of_a_lost_list_with_only_a_damaged_directory_exits_1_in_text_and_json(tmp_path, capsys):
    out = tmp_path / "run"
    _one_damaged_checkpoint(out)
    os.remove(_list_path(str(out)))
    assert cli_main(["repair", str(out)]) == 1
    text = capsys.readouterr().out
    assert "is missing; left as it is, nothing to rebuild it from: none" in text and "left out ckpt_1: " in text
    assert cli_main(["repair", "--json", str(out)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["problem"] == "is missing" and list(doc["left_out"]) == ["ckpt_1"]
    assert (out / "ckpt_1" / "index").read_bytes() == b"{garbage"


@pytest.mark.parametrize("damage", ["deleted", "emptied"])
def test_a_lost_list_with_only_damaged_directories_is_not_a_fresh_output_dir(tmp_path, capsys, damage):
    """Nothing to rebuild the list from but a directory whose index is damaged: `recsave ls` said
    "no committed checkpoint" and restore() started at step 0, both without a word about it. ls
    names the directory left out and exits 1, as repair does."""
    out = tmp_path / "run"
    _one_damaged_checkpoint(out)
    _damage(str(out), damage)
    with pytest.warns(RuntimeWarning) as caught:
        assert cli_main(["ls", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{out}: no committed checkpoint" and len(lines) == 2
    assert lines[1].startswith("left out ckpt_1: ") and "index is not UTF-8 JSON" in lines[1]
    assert lines[1].endswith(f"; `recsave repair {out}` names it")
    assert [str(w.message).partition(" (")[0] for w in caught] == [
        f"{_list_path(str(out))}: {DAMAGE[damage][1]}; no checkpoint readable here to rebuild the list from; left out "
        f"ckpt_1"]
    job = make_job(str(out), save_interval=10)
    with pytest.warns(RuntimeWarning, match=r"left out ckpt_1 \(.*index is not UTF-8 JSON"):
        assert job.manager.restore() == 0
    job.saver.close()
    assert (out / "ckpt_1" / "index").read_bytes() == b"{garbage"


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("ckpt_20", ["intact", "damaged"])
def test_ls_and_repair_agree_on_what_a_rebuilt_list_left_out(run, capsys, damage, ckpt_20):
    """A lost or garbled list rebuilt without ckpt_20, whose index is damaged, or without ids the
    file listed whose directory is gone: repair exits 1, ls exited 0 and did not name them. ls
    names each (text and --json `left_out`) and exits 1 too; 0 when nothing was left out."""
    out, _ = run
    if ckpt_20 == "damaged":
        with open(os.path.join(out, "ckpt_20", "index"), "w") as f:
            f.write("{not json")
    _damage(out, damage)
    gone = {"all_stale": ["ckpt_98", "ckpt_99"], "cut_short": ["ckpt_"]}.get(damage, [])
    left = sorted(gone + (["ckpt_20"] if ckpt_20 == "damaged" else []))
    expected = 1 if left else 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the rebuild's warning (tested above)
        assert cli_main(["ls", "--json", out]) == expected
        doc = json.loads(capsys.readouterr().out)
        assert cli_main(["ls", out]) == expected
        text = capsys.readouterr().out
    assert [e["id"] for e in doc["checkpoints"]] == [i for i in IDS if i not in left]
    assert sorted(e["id"] for e in doc["left_out"]) == left
    for e in doc["left_out"]:
        assert sorted(e) == ["damaged", "id", "path", "problem"] and e["damaged"] is True
        assert e["path"] == os.path.join(out, e["id"]) and f"left out {e['id']}: {e['problem']}" in text
        assert e["problem"] == ("listed in the 'checkpoint' file, but its directory or index is gone" if e["id"] in gone
                                else e["problem"])
    if ckpt_20 == "damaged":
        assert "index is not UTF-8 JSON" in next(e for e in doc["left_out"] if e["id"] == "ckpt_20")["problem"]
    assert cli_main(["repair", out]) == expected


def test_ls_names_directories_left_out_over_max_index_bytes_without_calling_them_damage(run, capsys):
    """A lost list rebuilt under a knob max_index_bytes below every index: the directories are
    left out as unreadable here, which is not damage (they may be intact): named, exit 0."""
    out, _ = run
    _damage(out, "deleted")
    smallest = min(os.path.getsize(os.path.join(out, i, "index")) for i in IDS)
    with recsave.knobs.override(max_index_bytes=smallest - 1), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert cli_main(["ls", "--json", out]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert cli_main(["ls", out]) == 0
        text = capsys.readouterr().out
    assert doc["checkpoints"] == [] and [e["id"] for e in doc["left_out"]] == IDS
    assert all(e["damaged"] is False and f"over the {smallest - 1}-byte limit (the knob max_index_bytes)"
               in e["problem"] for e in doc["left_out"])
    assert text.splitlines()[0] == f"{out}: no committed checkpoint" and "`recsave repair" not in text
    assert [line.split(":")[0] for line in text.splitlines()[1:]] == [f"left out {i}" for i in IDS]


def test_garbled_file_error_points_to_repair(run):
    out, _ = run
    _damage(out, "bad_line")
    with pytest.raises(recsave.CorruptCheckpointError, match=r"run `recsave repair .*run`"):
        ckptlist.read(get_storage(out), out)


def test_writers_drop_stale_entries_before_rotation(run):
    """A listed id whose directory is gone never takes a max_keep slot from a committed one."""
    out, _ = run
    with open(_list_path(out), "w") as f:
        f.write("ckpt_10\nckpt_20\nckpt_30\nckpt_33\n")
    fresh = make_job(out, save_interval=10, max_keep=3)
    with pytest.warns(RuntimeWarning, match="ckpt_33.*falling back.*ckpt_30"):
        assert fresh.manager.restore() == 30
    fresh.manager.global_step = 40
    with pytest.warns(RuntimeWarning, match=r"lists checkpoints whose directory or index is gone: ckpt_33; "
                                            r"dropped them; rewrote the file"):
        fresh.manager.save()
    fresh.saver.close()
    assert _list_file(out) == b"ckpt_20\nckpt_30\nckpt_40\n"
    assert _dirs(out) == ["ckpt_20", "ckpt_30", "ckpt_40", "notes"]


def test_rebuild_orders_bycommit_time_then_step_then_id(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=None)
    for ckpt_id in ("zeta", "alpha", "ckpt_5", "ckpt_3"):
        job.train(1)
        job.saver.save(ckpt_id)
    job.saver.close()
    shutil.copytree(os.path.join(out, "ckpt_5"), os.path.join(out, "ckpt_5b"))  # same step and time
    index = read_index_json(os.path.join(out, "alpha"))
    index["created_at"] = "yesterday"  # not a UTC time: first
    write_index_json(os.path.join(out, "alpha"), index)
    os.remove(_list_path(out))
    with pytest.warns(RuntimeWarning, match="from their indexes: alpha, zeta, ckpt_5, ckpt_5b, ckpt_3;"):
        names = [os.path.basename(p) for p in make_job(out, max_keep=None).saver.checkpoints()]
    assert names == ["alpha", "zeta", "ckpt_5", "ckpt_5b", "ckpt_3"]


def test_a_rebuild_lists_each_delta_after_its_parent_whatever_the_clocks_said(tmp_path):
    """A delta commits after its parent, whichever host's clock stamped them: ordered by
    `created_at` alone, a delta stamped by a clock running behind came before its chain, so a
    restore took its base for the latest and rotation pruned the base first."""
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=None)
    for ckpt_id in ("base", "d1", "d2"):
        job.train(1)
        job.saver.save(ckpt_id, incremental=ckpt_id != "base")
    job.saver.close()
    assert recsave.format.read_index(os.path.join(out, "d2")).parent.id == "d1"
    index = read_index_json(os.path.join(out, "d2"))  # no delta names d2's bytes: its edit breaks no chain
    index["created_at"] = "2001-01-01T00:00:00Z"
    write_index_json(os.path.join(out, "d2"), index)
    os.remove(_list_path(out))
    with pytest.warns(RuntimeWarning, match="from their indexes: base, d1, d2;"):
        names = [os.path.basename(p) for p in make_job(out, max_keep=None).saver.checkpoints()]
    assert names == ["base", "d1", "d2"]


def testcommit_time_without_a_fraction_sorts_by_time_not_by_string():
    early, late = "2026-11-26T10:00:05Z", "2026-11-26T10:00:05.5Z"
    assert early > late  # as strings
    assert ckptlist.commit_time(early) < ckptlist.commit_time(late)
    assert ckptlist.commit_time("2026-11-26T10:00:05+01:00") == float("-inf")
    # any number of fraction digits (datetime.fromisoformat takes only 3 or 6 before Python 3.11)
    assert ckptlist.commit_time("2026-11-26T10:00:05.123456789Z") > ckptlist.commit_time("2026-11-26T10:00:05.1Z")
    assert ckptlist.commit_time("2026-13-26T10:00:05Z") == float("-inf")


def test_a_rebuild_after_a_rewind_resumes_the_new_branch_not_the_abandoned_one(tmp_path):
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=None)
    for step in (10, 20, 30):
        job.train(1)
        job.saver.save(f"ckpt_{step}")
    job.saver.load(os.path.join(out, "ckpt_10"))  # rewind: 20 and 30 are abandoned
    job.train(2)
    job.saver.save("ckpt_15")
    expected = job_state(job)
    job.saver.close()
    os.remove(_list_path(out))
    fresh = make_job(out, max_keep=None)
    with pytest.warns(RuntimeWarning, match="from their indexes: ckpt_10, ckpt_20, ckpt_30, ckpt_15;"):
        assert fresh.saver.load(out).step == 15
    assert_jobs_equal(job_state(fresh), expected)


def test_rebuild_keeps_newer_format_checkpoints(run):
    out, _ = run
    index = read_index_json(os.path.join(out, "ckpt_30"))
    index["format_version"] = 5
    write_index_json(os.path.join(out, "ckpt_30"), index)
    _damage(out, "emptied")
    with pytest.warns(RuntimeWarning, match=REBUILT):
        assert catalog.collect_garbage(out) == ["ckpt_35"]
    assert _list_file(out) == FULL.encode()
    assert _dirs(out) == ["ckpt_10", "ckpt_20", "ckpt_30", "notes"]


def test_a_fresh_output_dir_is_not_damage(tmp_path):
    out = str(tmp_path / "run")
    os.makedirs(os.path.join(out, "ckpt_7"))  # a leftover only: nothing committed, nothing to rebuild
    with open(os.path.join(out, "ckpt_7", "model.pt"), "wb") as f:
        f.write(b"partial")
    job = make_job(out, save_interval=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert job.saver.checkpoints() == []
        assert job.manager.restore() == 0
    assert _list_file(out) is None


# ------------------------------------------------------------------ damaged directories (review)
def _two_saved(out):
    job = make_job(str(out), max_keep=None)
    job.train(1)
    job.saver.save("ckpt_1")
    job.train(1)
    job.saver.save("ckpt_2")
    return job


@pytest.mark.parametrize("then", ["save", "repair_then_save", "repair_then_gc"])
def test_a_directory_with_a_damaged_index_survives_saves_and_gc(tmp_path, then):
    """A rebuild leaves out ckpt_2 (its index no longer validates) and names it; neither the next
    save's rotation nor gc may delete it afterwards, also once the rewritten list is intact."""
    out = tmp_path / "run"
    job = _two_saved(out)
    with open(out / "ckpt_2" / "index", "wb") as f:
        f.write(b"{not json")
    _damage(out, "bad_line")
    job.saver.close()  # repair and gc take the writer lock (a later save takes it again)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if then.startswith("repair"):
            assert catalog.repair(str(out))["left_out"].keys() == {"ckpt_2"}
        if then.endswith("gc"):
            assert catalog.clean_output_dir(str(out))["removed_checkpoints"] == []
        else:
            job.train(1)
            job.saver.save("ckpt_3")
    assert "ckpt_2" in _dirs(out) and (out / "ckpt_2" / "index").read_bytes() == b"{not json"
    assert ckptlist.damaged(get_storage(str(out)), str(out), "ckpt_2") is not None


def test_a_save_never_removes_a_users_directory_named_like_the_id(tmp_path):
    out = tmp_path / "run"
    job = make_job(str(out))
    (out / "eval").mkdir(parents=True)
    (out / "eval" / "notes.txt").write_text("mine")
    job.train(1)
    with pytest.raises(recsave.CheckpointExistsError, match="holds files recsave did not write"):
        job.saver.save("eval")
    assert (out / "eval" / "notes.txt").read_text() == "mine"
    (out / "notes").write_text("a file named like the id")
    with pytest.raises(recsave.CheckpointExistsError, match="is a file or holds files recsave did not write"):
        job.saver.save("notes")
    assert (out / "notes").read_text() == "a file named like the id"
    (out / "empty").mkdir()  # an empty directory is a leftover (a crash right after mkdir): replaced
    job.saver.save("empty")
    assert (out / "empty" / "index").exists()


def test_repair_json(tmp_path, capsys):
    out = tmp_path / "run"
    _two_saved(out)
    _damage(out, "emptied")
    assert cli_main(["repair", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ids"] == ["ckpt_1", "ckpt_2"] and doc["rebuilt"] is True and doc["left_out"] == {}


def test_a_list_cut_to_another_committed_id_is_rebuilt(tmp_path):
    """ckpt_30 cut to ckpt_3, which is committed too: a last line without its newline that begins an
    unlisted directory's name is a cut, not the latest checkpoint (a restore would go back 27 steps)."""
    out = str(tmp_path / "run")
    job = make_job(out, save_interval=0, max_keep=None)
    for step in (3, 10, 20, 30):
        job.train(1)
        job.manager.global_step = step
        job.manager.save()
    job.saver.close()
    with open(_list_path(out), "wb") as f:
        f.write(b"ckpt_3\nckpt_10\nckpt_20\nckpt_3")
    again = make_job(out, save_interval=0, max_keep=None)
    with pytest.warns(RuntimeWarning, match="is cut short: its last line 'ckpt_3' has no newline and begins the "
                                            "name of a directory it does not list"):
        assert again.manager.restore() == 30
    again.manager.close()


# ------------------------------------------------------------------------------ broken delta chains
def _chain_saved(out):
    """ckpt_1 (full) <- ckpt_2 <- ckpt_3 (deltas), then ckpt_4 (full); the Saver closed."""
    job = make_job(str(out), max_keep=None)
    for k, incremental in ((1, False), (2, True), (3, True), (4, False)):
        job.train(1)
        job.saver.save(f"ckpt_{k}", incremental=incremental)
        assert job.saver.last_save_kind == ("delta" if incremental else "full")
    job.saver.close()


CHAIN_BROKEN = {
    # what happens to the chain -> (listed after repair, the deltas left out -> the member named)
    "base_gone": (["ckpt_4"], {"ckpt_2": "ckpt_1, whose directory or index is gone",
                               "ckpt_3": "ckpt_1, whose directory or index is gone"}),
    "base_gone_list_lost": (["ckpt_4"], {"ckpt_2": "ckpt_1, whose directory or index is gone",
                                         "ckpt_3": "ckpt_1, whose directory or index is gone"}),
    "middle_gone": (["ckpt_1", "ckpt_4"], {"ckpt_3": "ckpt_2, whose directory or index is gone"}),
    "middle_damaged": (["ckpt_1", "ckpt_4"], {"ckpt_3": "ckpt_2, whose index is damaged"}),
    # ckpt_2 deleted, then saved again (full) by another job: ckpt_3 is no delta of the new one
    "middle_saved_again": (["ckpt_1", "ckpt_4", "ckpt_2"],
                           {"ckpt_3": "ckpt_2, whose index is not the one ckpt_3 was saved against (saved again "
                                      "since)"}),
}


def _break_chain(out, broken):
    """Does to _chain_saved's chain what CHAIN_BROKEN names."""
    if broken.startswith("base_gone"):
        shutil.rmtree(out / "ckpt_1")
    elif broken in ("middle_gone", "middle_saved_again"):
        shutil.rmtree(out / "ckpt_2")
    elif broken == "middle_damaged":
        (out / "ckpt_2" / "index").write_bytes(b"{not json")
    if broken == "middle_saved_again":
        job = make_job(str(out), max_keep=None)
        job.train(2)
        job.saver.save("ckpt_2")
        job.saver.close()
    if broken.endswith("list_lost"):
        os.remove(_list_path(str(out)))


@pytest.mark.parametrize("broken", sorted(CHAIN_BROKEN))
def test_repair_unlists_a_delta_whose_chain_is_broken(tmp_path, broken, capsys):
    """A delta needs every member of its chain to load. repair kept listing ckpt_2 and ckpt_3 when
    their base (or the delta between) was deleted or its index garbled, and exited 0 after a
    rebuild ("rebuilt", nothing wrong): a restore of the latest would then fail. They leave the
    list now, named with the member they lack, their directories stay, and the exit status is 1."""
    out = tmp_path / "run"
    _chain_saved(out)
    _break_chain(out, broken)
    listed, left_out = CHAIN_BROKEN[broken]
    dirs = _dirs(str(out))
    assert cli_main(["repair", str(out)]) == 1
    text = capsys.readouterr().out
    for delta, member in left_out.items():
        assert f"left out {delta}: delta checkpoint {delta} needs {member}: it cannot be restored without its " \
               f"whole chain; restore another checkpoint" in text
    assert _list_file(str(out)) == "".join(f"{i}\n" for i in listed).encode()
    assert _dirs(str(out)) == dirs  # repair deletes nothing
    assert cli_main(["repair", "--json", str(out)]) == 0  # the list is fine now
    assert json.loads(capsys.readouterr().out)["ids"] == listed


LS_CHAIN_BROKEN = {
    # what happens to the chain -> (ls's exit status, what it lists, the deltas it names -> the member)
    **{broken: (1, ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"], left_out) for broken, (_, left_out)
       in CHAIN_BROKEN.items() if not broken.endswith(("list_lost", "saved_again"))},
    "middle_saved_again": (1, ["ckpt_1", "ckpt_3", "ckpt_4", "ckpt_2"], CHAIN_BROKEN["middle_saved_again"][1]),
    # the list rebuilt from the indexes left: the deltas of the lost base are left out of it (named
    # on "left out" lines, test_a_rebuilt_list_leaves_out_a_kept_delta_whose_chain_is_broken)
    "base_gone_list_lost": (1, ["ckpt_4"], {}),
    # an intact base that is not listed: the chain loads, nothing is wrong
    "base_unlisted": (0, ["ckpt_2", "ckpt_3", "ckpt_4"], {}),
}


@pytest.mark.parametrize("broken", sorted(LS_CHAIN_BROKEN))
def test_ls_names_a_listed_delta_whose_chain_is_broken(tmp_path, broken, capsys):
    """ls showed ckpt_2 and ckpt_3 as fine ("latest") when their base or the delta between was
    deleted or its index garbled, and exited 0 when that member was not listed (a rebuilt list):
    repair unlists them, and a restore of them fails. ls names each on its line with repair's
    message, its step, size and commit time still shown, and exits 1 (damage found)."""
    out = tmp_path / "run"
    _chain_saved(out)
    _break_chain(out, broken)
    if broken == "base_unlisted":
        with open(_list_path(str(out)), "w") as f:
            f.write("ckpt_2\nckpt_3\nckpt_4\n")
    code, listed, named = LS_CHAIN_BROKEN[broken]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rebuilt list's warning
        assert cli_main(["ls", "--json", str(out)]) == code
        entries = {e["id"]: e for e in json.loads(capsys.readouterr().out)["checkpoints"]}
        assert cli_main(["ls", str(out)]) == code
    lines = [line for line in capsys.readouterr().out.splitlines()[1:] if not line.startswith("left out ")]
    assert [line.split()[0] for line in lines] == list(entries) == listed
    hint = f"; `recsave repair {out}` drops or names it"
    for line in lines:
        e = entries[line.split()[0]]
        if e["id"] in named:
            why = (f"delta checkpoint {e['id']} needs {named[e['id']]}: it cannot be restored without its whole "
                   f"chain; restore another checkpoint (its directory stays: `recsave gc` keeps it, `recsave gc "
                   f"--remove-broken` removes it)")
            assert (e["problem"], e["damaged"], e["step"]) == (why, True, int(e["id"][-1]))
            assert e["bytes"] > 0 and e["created_at"] is not None
            assert line[24:35].strip() == str(e["step"]) and line.endswith(f"  {e['created_at']}  {why}{hint}")
        elif e["bytes"] is not None:  # intact, its chain whole
            assert e["problem"] is None and e["damaged"] is False
            assert line.endswith(f"  {e['created_at']}  {', '.join(e['kept'])}")
        else:  # the listed member that is gone or damaged, as before
            assert e["damaged"] is True and line.endswith(f"{e['problem']}{hint}")
    assert entries["ckpt_4"]["problem"] is None and entries["ckpt_4"]["kept"] == ["latest"]
    # ls names the deltas repair leaves out for their chain
    assert cli_main(["repair", "--json", str(out)]) == code
    left_out = json.loads(capsys.readouterr().out)["left_out"]
    expected = {i: entries[i]["problem"] for i in named}
    if broken == "base_gone_list_lost":  # left out by the rebuild already, in the same words
        expected = {i: chain.broken_why(i, [m]) for i, m in CHAIN_BROKEN[broken][1].items()}
    assert {i: why for i, why in left_out.items() if why.startswith("delta ")} == expected


def test_repair_keeps_a_delta_whose_chain_it_cannot_read_whole(tmp_path, capsys):
    """Indexes over this process's knob max_index_bytes are unknown, not damage: every chain stays."""
    out = tmp_path / "run"
    _chain_saved(out)
    smallest = min(os.path.getsize(out / f"ckpt_{k}" / "index") for k in (1, 2, 3, 4))
    with recsave.knobs.override(max_index_bytes=smallest - 1):
        assert cli_main(["repair", str(out)]) == 0
    assert _list_file(str(out)) == b"ckpt_1\nckpt_2\nckpt_3\nckpt_4\n"


def test_ls_and_repair_agree_an_index_over_max_index_bytes_is_not_damage(tmp_path, capsys):
    """ls called an index over this process's knob max_index_bytes damaged (exit 1, "repair drops
    or names it") while repair left it listed and exited 0: it may be intact, written by a job that
    raised the knob. ls names it, not as damage, and both exit 0."""
    out = tmp_path / "run"
    _chain_saved(out)
    big = os.path.getsize(out / "ckpt_3" / "index")
    with recsave.knobs.override(max_index_bytes=big - 1):
        assert cli_main(["ls", "--json", str(out)]) == 0
        entries = {e["id"]: e for e in json.loads(capsys.readouterr().out)["checkpoints"]}
        assert cli_main(["repair", str(out)]) == 0
    over = [i for i, e in entries.items() if e["problem"] is not None]
    assert over and all(os.path.getsize(out / i / "index") > big - 1 for i in over)
    for i in over:
        assert entries[i]["damaged"] is False
        assert entries[i]["problem"].endswith(f"over the {big - 1}-byte limit (the knob max_index_bytes): the "
                                              f"index may be intact, written by a job that raised the knob; raise "
                                              f"it here to read it")
    assert _list_file(str(out)) == b"ckpt_1\nckpt_2\nckpt_3\nckpt_4\n"


# ------------------------------------------------------------------ gc after repair left a delta out
# The deltas repair leaves out because of their chain, with an index of their own that validates
# (what gc took for pruned checkpoints): gc names them in repair's words (CHAIN_BROKEN: one rule,
# chain.broken_chains); a damaged member stays, as damaged directories always do.
GC_BROKEN = {broken: left_out for broken, (_, left_out) in CHAIN_BROKEN.items()}


def _repaired_broken_chain(tmp_path, broken):
    """_chain_saved's chain broken as `broken` names, then repaired (its warnings not shown): the
    output dir."""
    out = tmp_path / "run"
    _chain_saved(out)
    _break_chain(out, broken)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        catalog.repair(str(out))
    return out


def _check_kept_broken(out, broken, kept):
    """gc's kept_broken names what GC_BROKEN says, in the words repair leaves them out with."""
    assert kept == {delta: chain.broken_why(delta, [member]) for delta, member in GC_BROKEN[broken].items()}


@pytest.mark.parametrize("then", ["gc", "save"])
@pytest.mark.parametrize("broken", sorted(GC_BROKEN))
def test_gc_and_rotation_keep_a_delta_repair_left_out_for_its_chain(tmp_path, broken, then, capsys):
    """repair unlists a delta whose chain lost a member (gone, damaged, saved again): nothing wrong
    with the delta itself, and a member restored from a backup (a damaged index replaced) makes it
    loadable again. The next `recsave gc`, or the next save's rotation, deleted it as a pruned
    checkpoint. Both keep it now; gc names it (exit 0)."""
    out = tmp_path / "run"
    _chain_saved(out)
    _break_chain(out, broken)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the rebuilt list's
        left_out = catalog.repair(str(out))["left_out"]
    assert sorted(i for i, why in left_out.items() if why.startswith("delta ")) == sorted(GC_BROKEN[broken])
    dirs = _dirs(str(out))
    listed = _list_file(str(out))
    if then == "gc":
        assert cli_main(["gc", "--json", str(out)]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["removed_checkpoints"] == []
        _check_kept_broken(out, broken, doc["kept_broken"])
        assert cli_main(["gc", str(out)]) == 0
        text = capsys.readouterr().out
        assert text.startswith("removed 0 directories\n")
        assert f"kept {len(GC_BROKEN[broken])} delta checkpoint(s) whose chain is broken: " \
               f"{', '.join(sorted(GC_BROKEN[broken]))}; `recsave gc --remove-broken {out}` removes them\n" in text
        for delta, why in doc["kept_broken"].items():
            assert f"\n  kept {delta}: {' '.join(why.split())}\n" in text
    else:
        job = make_job(str(out), max_keep=None)
        job.train(1)
        job.saver.save("ckpt_5")
        job.saver.close()
        dirs = sorted([*dirs, "ckpt_5"])
        listed += b"ckpt_5\n"
    assert _dirs(str(out)) == dirs
    assert _list_file(str(out)) == listed


@pytest.mark.parametrize("broken", sorted(GC_BROKEN))
def test_gc_remove_broken_removes_only_the_deltas_whose_chain_is_broken(tmp_path, broken, capsys):
    """Asked explicitly (`--remove-broken`), gc removes those deltas; a member whose index is damaged
    stays (the user's to look at), as does everything listed."""
    out = _repaired_broken_chain(tmp_path, broken)
    dirs = _dirs(str(out))
    listed = _list_file(str(out))
    assert cli_main(["gc", "--remove-broken", "--json", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["removed_checkpoints"], doc["kept_broken"]) == (sorted(GC_BROKEN[broken]), {})
    assert _dirs(str(out)) == [d for d in dirs if d not in GC_BROKEN[broken]]
    assert _list_file(str(out)) == listed
    if broken == "middle_damaged":
        assert (out / "ckpt_2" / "index").read_bytes() == b"{not json"


def test_gc_still_removes_a_delta_left_by_a_save_that_crashed_before_listing_it(tmp_path):
    """An unlisted delta whose chain is whole is a save that crashed between its index and the
    list (or a pruned one): gc removes it as before, also without --remove-broken."""
    out = tmp_path / "run"
    _chain_saved(out)
    (out / "checkpoint").write_bytes(b"ckpt_1\nckpt_2\nckpt_4\n")
    assert catalog.clean_output_dir(str(out)) == {"removed_checkpoints": ["ckpt_3"], "removed_temp_files": [],
                                                   "aborted_uploads": [], "kept_broken": {}}
    assert _dirs(str(out)) == ["ckpt_1", "ckpt_2", "ckpt_4"]


def test_gc_keeps_the_unlisted_chain_of_a_listed_delta(tmp_path):
    """ckpt_1 and ckpt_2 are not listed, ckpt_3 (a delta of ckpt_2 of ckpt_1) is: gc keeps its whole
    chain (safe already before; this proves it)."""
    out = tmp_path / "run"
    _chain_saved(out)
    (out / "checkpoint").write_bytes(b"ckpt_3\nckpt_4\n")
    for remove_broken in (False, True):
        assert catalog.clean_output_dir(str(out), remove_broken=remove_broken)["removed_checkpoints"] == []
    assert _dirs(str(out)) == ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"]
    assert _list_file(str(out)) == b"ckpt_3\nckpt_4\n"


# ------------------------------------------------------------------- how often a repair reads an index
class CountingStorage(LocalStorage):
    """Local disk, counting whole-file reads (read_bytes) per path relative to `root`."""

    def __init__(self, root):
        super().__init__()
        self.root = str(root)
        self.reads = collections.Counter()

    def read_bytes(self, path, limit):
        self.reads[os.path.relpath(path, self.root)] += 1
        return super().read_bytes(path, limit)


# the state of _chain_saved's chain -> the index paths a repair tries to read (each exactly once)
REPAIR_READS = {
    "intact": ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"],
    "base_gone": ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"],  # ckpt_1: a read that finds no index
    # the rebuild finds ckpt_1 gone from the directory listing: its deltas are left out, unread again
    "base_gone_list_lost": ["ckpt_2", "ckpt_3", "ckpt_4"],
    "middle_gone": ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"],
    "middle_damaged": ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"],
    "middle_saved_again": ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"],
}


@pytest.mark.parametrize("broken", sorted(REPAIR_READS))
def test_repair_reads_each_index_once(tmp_path, broken, monkeypatch):
    """A repair asks of each index whether it validates, what the checkpoint needs, and (for a
    chain) its CRC32C: it read one member's index up to four times (the list, damage, the chain's
    parents, the CRC check). Each index is read once now, with the same outcome."""
    out = tmp_path / "run"
    _chain_saved(out)
    if broken != "intact":
        _break_chain(out, broken)
    storage = CountingStorage(out)
    monkeypatch.setattr(catalog, "get_storage", lambda path: storage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the rebuilt list's
        done = catalog.repair(str(out))
    listed, left_out = CHAIN_BROKEN.get(broken, (["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"], {}))
    assert done["ids"] == listed
    assert {i: why for i, why in done["left_out"].items() if why.startswith("delta ")} == \
        {i: f"delta checkpoint {i} needs {member}: it cannot be restored without its whole chain; restore another "
            f"checkpoint (its directory stays: `recsave gc` keeps it, `recsave gc --remove-broken` removes it)"
         for i, member in left_out.items()}
    expected = {f"{i}/index": 1 for i in REPAIR_READS[broken]}
    expected[".recsave-writer.lock"] = 1  # taking the lock
    if not broken.endswith("list_lost"):
        expected["checkpoint"] = 1
    assert dict(storage.reads) == expected


def test_read_once_remembers_bytes_and_absence_but_not_a_failed_read(tmp_path):
    """ReadOnce answers a path's later reads from its first (bytes, or the error of an index that is
    absent), but a StorageError (maybe transient) is read again next time."""
    from recsave.errors import CheckpointNotFoundError, StorageError
    from recsave.format.readonce import ReadOnce

    (tmp_path / "index").write_bytes(b"{}")
    storage = CountingStorage(tmp_path)
    fail = [True]

    def flaky(path, limit):
        storage.reads[os.path.relpath(path, storage.root)] += 1
        if fail.pop() if fail else False:
            raise StorageError(f"{path}: injected timeout", path=path)
        return LocalStorage.read_bytes(storage, path, limit)
    storage.read_bytes = flaky
    once = ReadOnce()
    index, missing = str(tmp_path / "index"), str(tmp_path / "gone" / "index")
    with pytest.raises(StorageError, match="injected timeout"):
        once.read(storage, index, 100)
    assert [once.read(storage, index, 100) for _ in range(2)] == [b"{}", b"{}"]
    for _ in range(2):
        with pytest.raises(CheckpointNotFoundError) as exc:
            once.read(storage, missing, 100)
        assert exc.value.path == missing
    assert dict(storage.reads) == {"index": 2, "gone/index": 1}


def test_read_once_remembers_no_more_bytes_than_its_budget(tmp_path):
    """Past its budget ReadOnce reads again instead of holding every index of the output dir."""
    from recsave.format.readonce import ReadOnce

    for name, size in (("a", 60), ("b", 50), ("c", 30)):
        (tmp_path / name).write_bytes(b"x" * size)
    storage = CountingStorage(tmp_path)
    once = ReadOnce(budget=100)
    for _ in range(3):
        assert [len(once.read(storage, str(tmp_path / n), 1000)) for n in "abc"] == [60, 50, 30]
    assert dict(storage.reads) == {"a": 1, "b": 3, "c": 1}  # b no longer fits beside a; c does


@pytest.mark.parametrize("broken", sorted(GC_BROKEN))
def test_a_rebuilt_list_leaves_out_a_kept_delta_whose_chain_is_broken(tmp_path, broken, capsys):
    """gc and rotation keep a delta repair left out for its chain; when the `checkpoint` file is
    lost later, the rebuild from the indexes listed it again (its own index validates): the job's
    save of that id then failed as "committed already", keep_best could rank it, a restore of it
    failed. The rebuild leaves such a delta out, ls calls it damage (exit 1) as repair does, and
    a save of its id replaces the directory."""
    out = _repaired_broken_chain(tmp_path, broken)
    deltas = sorted(GC_BROKEN[broken])
    listed = _list_file(str(out)).decode().split()
    os.remove(_list_path(str(out)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert cli_main(["ls", "--json", str(out)]) == 1
        doc = json.loads(capsys.readouterr().out)
    assert [e["id"] for e in doc["checkpoints"]] == listed
    left = {e["id"]: e for e in doc["left_out"] if e["id"] in deltas}
    assert sorted(left) == deltas and all(e["damaged"] for e in left.values())
    assert all(e["problem"].startswith(f"delta checkpoint {i} needs ") for i, e in left.items())
    job = make_job(str(out), max_keep=None)
    job.train(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        job.saver.save(deltas[-1])  # replaces the kept directory: nothing listed needs it
    job.saver.close()
    assert _list_file(str(out)).decode().split() == [*listed, deltas[-1]]
    assert read_index_json(str(out / deltas[-1])).get("kind", "full") == "full"


# ------------------------------------------------------------------ the one rule for broken chains
def _states(**members):
    """MemberStates by id: "gone", "damaged", "unknown" (bytes not read), (crc,) of a full
    checkpoint, ("serving", crc) of a serving export, (crc, parent id, parent crc, base) of a delta,
    ("newer", crc, parent id, parent crc, base) of a newer recsave's delta."""
    from recsave.format.records import KIND_FULL, Parent

    out = {}
    for name, what in members.items():
        if what in ("gone", "damaged"):
            out[name] = chain.MemberState(problem=chain.GONE if what == "gone" else chain.DAMAGED)
        elif what == "unknown":
            out[name] = chain.MemberState(unread="over the limit")
        elif len(what) == 1:
            out[name] = chain.MemberState(crc32c=what[0], kind=KIND_FULL)
        elif what[0] == "serving":
            out[name] = chain.MemberState(crc32c=what[1], kind="serving")
        elif what[0] == "newer":  # parent id None: one its bytes name in a form this recsave cannot read
            out[name] = chain.MemberState(crc32c=what[1], parent=None if what[2] is None else Parent(what[2], what[3]),
                                          base=what[4], unread="written by a newer recsave")
        else:
            out[name] = chain.MemberState(crc32c=what[0], parent=Parent(what[1], what[2]), base=what[3],
                                          kind="delta")
    return lambda name: out.get(name, chain.MemberState(problem=chain.GONE))


NEWER = "ckpt_2, whose index cannot be read here (written by a newer recsave)"
BROKEN_RULE = {
    # members -> (delta ckpt_3's lost member, with unknown_breaks too when it differs)
    "whole": (dict(ckpt_1=(11,), ckpt_2=(12, "ckpt_1", 11, "ckpt_1")), None, None),
    "base_gone": (dict(ckpt_2=(12, "ckpt_1", 11, "ckpt_1")), "ckpt_1, whose directory or index is gone", None),
    "middle_damaged": (dict(ckpt_1=(11,), ckpt_2="damaged"), "ckpt_2, whose index is damaged", None),
    "middle_saved_again": (dict(ckpt_1=(11,), ckpt_2=(99, "ckpt_1", 11, "ckpt_1")),
                           "ckpt_2, whose index is not the one ckpt_3 was saved against (saved again since)", None),
    "middle_unknown": (dict(ckpt_1=(11,), ckpt_2="unknown"), None,
                       "ckpt_2, whose index cannot be read here (over the limit)"),
    # the walk stops at the unknown member, but the base ckpt_3 names is gone: broken either way
    "middle_unknown_base_gone": (dict(ckpt_2="unknown"), "ckpt_1, whose directory or index is gone",
                                 "ckpt_2, whose index cannot be read here (over the limit)"),
    # a newer recsave's member is followed by the parent its bytes name (review)
    "middle_newer": (dict(ckpt_1=(11,), ckpt_2=("newer", 12, "ckpt_1", 11, "ckpt_1")), None, NEWER),
    "middle_newer_base_gone": (dict(ckpt_2=("newer", 12, "ckpt_1", 11, "ckpt_1")),
                               "ckpt_1, whose directory or index is gone", NEWER),
    # its parent link unreadable here: it may or may not be the base, the walk ends there (review)
    "middle_newer_parent_unreadable": (dict(ckpt_1=(11,), ckpt_2=("newer", 12, None, None, "ckpt_1")), None, NEWER),
    "middle_newer_parent_unreadable_base_gone": (dict(ckpt_2=("newer", 12, None, None, "ckpt_1")),
                                                 "ckpt_1, whose directory or index is gone", NEWER),
    "middle_newer_saved_again": (dict(ckpt_1=(11,), ckpt_2=("newer", 99, "ckpt_1", 11, "ckpt_1")),
                                 "ckpt_2, whose index is not the one ckpt_3 was saved against (saved again since)",
                                 None),
    "loop": (dict(ckpt_1=(11, "ckpt_2", 12, "ckpt_1"), ckpt_2=(12, "ckpt_1", 11, "ckpt_1")),
             "ckpt_2, whose chain of parents loops back to it", None),
    "other_base": (dict(ckpt_0=(10,), ckpt_1=(11,), ckpt_2=(12, "ckpt_0", 10, "ckpt_0")),
                   "ckpt_1, which its index names as its chain's base, where its parents end at ckpt_0", None),
    # a chain must end at a full checkpoint, as a restore checks (review: gc deleted such a delta)
    "serving_base": (dict(ckpt_1=("serving", 11), ckpt_2=(12, "ckpt_1", 11, "ckpt_1")),
                     "ckpt_1, a checkpoint of kind 'serving' where a chain's base must be a full checkpoint", None),
}


@pytest.mark.parametrize("case", sorted(BROKEN_RULE))
def test_broken_chains_is_one_rule_for_rebuild_ls_repair_and_gc(case):
    """chain.broken_chains: what a rebuilt list, ls, repair (unknown breaks nothing) and gc (unknown
    breaks: it keeps) decide of delta ckpt_3 (parent ckpt_2 of CRC 12, base ckpt_1); a full
    checkpoint and an id unreadable itself are never broken."""
    members, lost, lost_for_gc = BROKEN_RULE[case]
    state_of = _states(ckpt_3=(13, "ckpt_2", 12, "ckpt_1"), ckpt_4=(14,), ckpt_5="unknown", **members)
    ids = ["ckpt_3", "ckpt_4", "ckpt_5"]
    for unknown_breaks, member in ((False, lost), (True, lost_for_gc or lost)):
        expected = {} if member is None else {"ckpt_3": chain.broken_why("ckpt_3", [member])}
        assert chain.broken_chains(ids, state_of, unknown_breaks=unknown_breaks) == expected


def _made_newer(out, member, child):
    """`member`'s index rewritten as a newer recsave writes it (format_version 5), `child` (a
    delta of it) recording the CRC32C of those bytes, as if saved against them."""
    index = read_index_json(out / member)
    index["format_version"] = 5
    write_index_json(out / member, index)
    delta = read_index_json(out / child)
    delta["parent"]["crc32c"] = chain.index_crc(get_storage(str(out)), str(out / member))
    write_index_json(out / child, delta)


def test_gc_keeps_a_delta_whose_member_it_cannot_read_and_a_rebuild_lists_it(tmp_path, capsys):
    """A member written by a newer recsave (unreadable here, maybe whole): gc keeps the unlisted
    delta of it, and a rebuilt list keeps that delta listed (leaving it out would roll the job
    back); gc --remove-broken removes it."""
    out = tmp_path / "run"
    _chain_saved(out)
    with open(_list_path(str(out)), "w") as f:
        f.write("ckpt_1\nckpt_4\n")  # ckpt_3 unlisted: one of gc's candidates
    _made_newer(out, "ckpt_2", "ckpt_3")
    storage = get_storage(str(out))
    kept = {}
    assert ckptlist.collect_garbage(storage, str(out), ["ckpt_1", "ckpt_4"], kept_broken=kept) == []
    assert list(kept) == ["ckpt_3"] and "ckpt_2, whose index cannot be read here (written by a newer" in kept["ckpt_3"]
    os.remove(_list_path(str(out)))
    assert ckptlist.rebuild(storage, str(out)) == (["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"], {}, set())
    assert ckptlist.collect_garbage(storage, str(out), ["ckpt_1", "ckpt_4"], remove_broken=True) == ["ckpt_3"]


@pytest.mark.parametrize("by", ["gc", "rotation"])
def test_pruning_a_chain_goes_newest_first_so_a_kill_leaves_it_whole(tmp_path, by, monkeypatch):
    """Pruning ckpt_1 <- ckpt_2 <- ckpt_3 removed ckpt_1 first (directory order): a process killed
    after that left ckpt_2 and ckpt_3 as unlisted deltas of a gone base, which gc then kept for
    ever. The pruned go newest first now: killed after the first removal, the chain left is whole,
    and the next gc removes it."""
    out = tmp_path / "run"
    _chain_saved(out)
    storage = get_storage(str(out))
    order = []

    def killed_after_one(path):
        order.append(os.path.basename(path))
        if len(order) == 2:
            raise KeyboardInterrupt  # the process dies here
        storage.remove_tree(path)
    if by == "gc":
        with pytest.raises(KeyboardInterrupt):
            ckptlist.collect_garbage(storage, str(out), ["ckpt_4"], remove=killed_after_one,
                                     pruned=["ckpt_1", "ckpt_2", "ckpt_3"])
    else:
        job = make_job(str(out), max_keep=2)
        job.train(1)
        from recsave.save.pruning import Pruner
        real = Pruner.remove

        def remove(self, path, lock=None):  # the first removal done, the others lost with the process
            order.append(os.path.basename(path))
            if len(order) == 1:
                real(self, path, lock)
        monkeypatch.setattr(Pruner, "remove", remove)
        job.saver.save("ckpt_5")
        job.saver.close()
    assert order[:2] == ["ckpt_3", "ckpt_2"]
    keep = ["ckpt_4"] if by == "gc" else ["ckpt_4", "ckpt_5"]
    assert _dirs(str(out)) == ["ckpt_1", "ckpt_2", *keep]
    kept = {}
    assert ckptlist.collect_garbage(storage, str(out), keep, kept_broken=kept) == ["ckpt_1", "ckpt_2"]
    assert kept == {}


def test_a_member_gone_beyond_a_newer_recsaves_member_breaks_the_chain(tmp_path, capsys):
    """ckpt_1 <- ckpt_2 <- ckpt_3 <- ckpt_5, ckpt_3 rewritten by a newer recsave, ckpt_2 gone: no
    recsave can restore ckpt_5. The one rule stopped at the member it could not read and called
    ckpt_5 whole (ls exited 0, repair kept it listed); it follows the parent the newer index names
    (review)."""
    out = tmp_path / "run"
    job = make_job(str(out), max_keep=None)
    for k, incremental in ((1, False), (2, True), (3, True), (5, True)):
        job.train(1)
        job.saver.save(f"ckpt_{k}", incremental=incremental)
    job.saver.close()
    _made_newer(out, "ckpt_3", "ckpt_5")
    shutil.rmtree(out / "ckpt_2")
    os.remove(_list_path(str(out)))
    why = chain.broken_why("ckpt_5", ["ckpt_2, whose directory or index is gone"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert ckptlist.rebuild(get_storage(str(out)), str(out)) == (["ckpt_1", "ckpt_3"], {"ckpt_5": why}, {"ckpt_5"})
        assert cli_main(["ls", str(out)]) == 1
        repaired = catalog.repair(str(out))
    assert repaired["ids"] == ["ckpt_1", "ckpt_3"] and repaired["left_out"] == {"ckpt_5": why}


def test_a_rebuild_moves_a_deltas_parent_before_it_not_the_delta_after_the_parent():
    """docs/FORMAT.md: the parent that sorted after its delta moves to just before it; what
    sorted between them (after a rewind, the new branch stamped by the delta's clock) follows."""
    parents = {"d": "b", "d2": "d"}
    assert ckptlist._parents_first(["a", "d", "y", "b"], parents.get) == ["a", "b", "d", "y"]
    assert ckptlist._parents_first(["d2", "y", "d", "b"], parents.get) == ["b", "d", "d2", "y"]
    assert ckptlist._parents_first(["b", "y", "d"], parents.get) == ["b", "y", "d"]  # in order: unchanged
    loop = {"p": "q", "q": "p"}
    assert ckptlist._parents_first(["p", "q"], loop.get) == ["q", "p"]  # a loop ends the walk
