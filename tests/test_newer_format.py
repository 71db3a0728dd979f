"""A checkpoint written by a newer recsave (its index has a higher format_version) is not damage:
fallback loads stop on it, and no save, rotation or gc deletes or replaces it."""
from __future__ import annotations

import hashlib
import os
import warnings

import pytest
from helpers import assert_jobs_equal, job_state, make_job, read_index_json, write_index_json

from recsave import CheckpointExistsError, CorruptCheckpointError, FormatVersionError, RecsaveError
from recsave.tools import catalog
from recsave.tools.cli import main as cli_main

NEWER = (r"written by a newer recsave \(format_version 5\); upgrade recsave, or restore an explicit "
         r"older step with restore\(global_step=\.\.\.\)")


def make_newer(ckpt_dir) -> None:
    """Rewrites the index of a committed checkpoint as a newer recsave would have written it: the
    same valid file, format_version 5."""
    index = read_index_json(ckpt_dir)
    index["format_version"] = 5
    write_index_json(ckpt_dir, index)


def tree(path) -> dict:
    """Relative path -> sha256 of every file under path."""
    out = {}
    for base, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(base, name), "rb") as f:
                out[os.path.relpath(os.path.join(base, name), path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def listed(out) -> list:
    with open(os.path.join(out, "checkpoint")) as f:
        return f.read().split()


def two_steps(out, **kw):
    """A manager job that committed ckpt_2 and ckpt_4; ckpt_4 is then made newer."""
    job = make_job(str(out), save_interval=2, **kw)
    job.train(2)
    state2 = job_state(job)
    job.train(2)
    job.manager.wait()
    make_newer(os.path.join(out, "ckpt_4"))
    return job, state2


def test_format_version_error_is_not_corruption():
    assert issubclass(FormatVersionError, RecsaveError)
    assert issubclass(FormatVersionError, ValueError)
    assert not issubclass(FormatVersionError, CorruptCheckpointError)


def test_fallback_restore_stops_on_a_newer_checkpoint_and_keeps_it(tmp_path):
    out = tmp_path / "out"
    job, state2 = two_steps(out)
    job.manager.close()
    before = tree(out / "ckpt_4")
    fresh = make_job(str(out), save_interval=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "falling back" warning: it does not fall back
        with pytest.raises(FormatVersionError, match=NEWER):
            fresh.manager.restore()
        with pytest.raises(FormatVersionError, match=NEWER):
            fresh.saver.load(fallback=True)
    assert fresh.saver.damaged_checkpoints == frozenset()
    assert fresh.manager.global_step == 0
    # An explicit older step restores.
    assert fresh.manager.restore(global_step=2) == 2
    assert_jobs_equal(job_state(fresh), state2)
    # Saving the newer checkpoint's id again is refused and leaves it alone.
    with pytest.raises(CheckpointExistsError, match=r"ckpt_4.*written by a newer recsave \(format_version 5\)"):
        fresh.saver.save("ckpt_4")
    assert tree(out / "ckpt_4") == before
    assert listed(out) == ["ckpt_2", "ckpt_4"]
    fresh.manager.close()


def test_save_never_replaces_an_unlisted_newer_checkpoint(tmp_path):
    out = tmp_path / "out"
    job, _ = two_steps(out)
    job.manager.close()
    with open(out / "checkpoint", "w") as f:  # ckpt_4 unlisted, like a leftover of a crashed save
        f.write("ckpt_2\n")
    before = tree(out / "ckpt_4")
    fresh = make_job(str(out))
    with pytest.raises(CheckpointExistsError, match=r"ckpt_4.*written by a newer recsave \(format_version 5\)"):
        fresh.saver.save("ckpt_4")
    assert tree(out / "ckpt_4") == before
    assert listed(out) == ["ckpt_2"]
    fresh.saver.close()


def test_rotation_keeps_a_newer_checkpoint_and_warns_once(tmp_path):
    out = tmp_path / "out"
    job, _ = two_steps(out, max_keep=2)
    before = tree(out / "ckpt_4")
    with pytest.warns(RuntimeWarning, match=r"ckpt_4.*written by a newer recsave \(format_version 5\).*not deleted"):
        job.train(2)   # saves ckpt_6: ckpt_2 falls out of max_keep=2 and is deleted
        job.train(2)   # saves ckpt_8: ckpt_4 falls out of max_keep, and is kept
        job.manager.wait()
    assert listed(out) == ["ckpt_4", "ckpt_6", "ckpt_8"]
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt_")) == ["ckpt_4", "ckpt_6", "ckpt_8"]
    assert tree(out / "ckpt_4") == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per checkpoint: the next rotation keeps it silently
        job.train(2)
        job.manager.wait()
    assert listed(out) == ["ckpt_4", "ckpt_8", "ckpt_10"]
    assert tree(out / "ckpt_4") == before
    job.manager.close()


def test_gc_keeps_a_newer_checkpoint(tmp_path, capsys):
    out = tmp_path / "out"
    job, _ = two_steps(out)
    job.manager.close()
    with open(out / "checkpoint", "w") as f:  # ckpt_4 is not listed: it looks like a leftover
        f.write("ckpt_2\n")
    before = tree(out / "ckpt_4")
    assert catalog.collect_garbage(str(out)) == []
    assert tree(out / "ckpt_4") == before
    assert cli_main(["gc", str(out)]) == 0
    assert tree(out / "ckpt_4") == before
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt_")) == ["ckpt_2", "ckpt_4"]
    with open(out / "checkpoint", "w") as f:  # emptied: rebuilt from the indexes, the newer one listed
        f.write("")
    with pytest.warns(RuntimeWarning, match="is empty; rebuilt .* indexes: ckpt_2, ckpt_4; rewrote the file"):
        assert catalog.collect_garbage(str(out)) == []
    assert tree(out / "ckpt_4") == before
    assert listed(out) == ["ckpt_2", "ckpt_4"]


def test_a_version_no_recsave_writes_is_damage_and_fallback_skips_it(tmp_path):
    out = tmp_path / "out"
    job, state2 = two_steps(out)
    job.manager.close()
    index = read_index_json(out / "ckpt_4")
    index["format_version"] = 0  # older than any recsave: not "newer", so damage
    write_index_json(out / "ckpt_4", index)
    fresh = make_job(str(out), save_interval=2)
    with pytest.warns(RuntimeWarning, match=r"ckpt_4 cannot be loaded \(CorruptCheckpointError.*no version any "
                                             r"recsave writes"):
        assert fresh.manager.restore() == 2
    assert_jobs_equal(job_state(fresh), state2)
    assert fresh.saver.damaged_checkpoints == frozenset({"ckpt_4"})
    fresh.manager.close()


@pytest.mark.parametrize("how", ["unknown_kind", "kind_not_first", "kind_with_other_chars"])
def test_rotation_keeps_a_sealed_newer_index_it_does_not_parse(tmp_path, how):
    """Rotation tells a checkpoint it may delete from the seal and the leading format_version /
    kind alone (it does not parse a pruned index): an intact index of a version this recsave reads
    only for other kinds, or whose kind is not where recsave writes it, still goes to the parser
    and is kept as a newer writer's."""
    import json

    from recsave.format import seal

    out = tmp_path / "out"
    job = make_job(str(out), save_interval=2, max_keep=2)
    job.train(4)  # ckpt_2, ckpt_4
    job.manager.wait()
    index = read_index_json(os.path.join(out, "ckpt_2"))
    index.pop(seal.KEY, None)
    body = {"unknown_kind": {"format_version": 4, "kind": "sharded"},
            "kind_not_first": {"format_version": 4},
            "kind_with_other_chars": {"format_version": 4, "kind": "Delta-2"}}[how]
    rest = {k: v for k, v in index.items() if k not in ("magic", "format_version", "kind")}
    if how == "kind_not_first":
        rest["kind"] = "sharded"
    doc = {"magic": index["magic"], **body, **rest}
    with open(os.path.join(out, "ckpt_2", "index"), "wb") as f:
        f.write(seal.seal(json.dumps(doc, separators=(",", ":")).encode()))
    before = tree(out / "ckpt_2")
    with pytest.warns(RuntimeWarning, match=r"ckpt_2.*written by a newer recsave"):
        job.train(2)  # ckpt_6: ckpt_2 falls out of max_keep=2
        job.manager.wait()
    assert tree(out / "ckpt_2") == before and "ckpt_2" in listed(out)
    job.manager.close()
