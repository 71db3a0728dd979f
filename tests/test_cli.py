"""The `recsave` command line: ls, inspect, verify, gc (export is in test_export.py)."""
import contextlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import make_job, read_index_json, write_index_json

import recsave
from recsave.errors import UsageError
from recsave.storage import LocalStorage
from recsave.storage.lock import LOCK_FILE, WriterLock
from recsave.tools import catalog
from recsave.tools.cli import build_parser, main


@pytest.fixture()
def output_dir(tmp_path):
    job = make_job(str(tmp_path / "run"), max_keep=2)
    for step in (2, 4):
        job.train(2)
        job.saver.save(f"ckpt_{step}")
    return tmp_path / "run"


def test_ls_lists_committed_checkpoints(output_dir, capsys):
    assert main(["ls", str(output_dir)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()[1:]
    assert [line.split()[0] for line in lines] == ["ckpt_2", "ckpt_4"]
    assert [line.split()[1] for line in lines] == ["2", "4"]


def test_inspect_describes_tables_and_dense(output_dir, capsys):
    assert main(["inspect", str(output_dir)]) == 0
    out = capsys.readouterr().out
    assert "ckpt_4: step 4, 1 rank(s), format 4" in out
    assert "user:" in out and "dim 8 float32, slots adagrad_acc" in out
    assert "mlp.0.weight" in out and "extras: dense_opt, sparse_optim" in out
    assert "io states: reader" in out


def test_verify_passes_then_finds_a_flipped_byte(output_dir, capsys):
    ckpt = output_dir / "ckpt_4"
    assert main(["verify", str(ckpt)]) == 0
    assert "all checksums match" in capsys.readouterr().out
    shard = next(p for p in ckpt.iterdir() if p.name.endswith(".safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    extra = ckpt / "extra.pt"
    raw = bytearray(extra.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    extra.write_bytes(bytes(raw))
    assert main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert out.count("BAD") == 2 and shard.name in out and "extra.pt" in out


def test_gc_removes_only_leftovers(output_dir, capsys):
    (output_dir / "ckpt_9").mkdir()
    (output_dir / "ckpt_9" / "sparse-0-0.safetensors.tmp-1-0").write_bytes(b"partial")
    (output_dir / "notes").mkdir()
    (output_dir / "notes" / "todo.txt").write_text("keep me")
    assert main(["gc", str(output_dir)]) == 0
    assert "removed 1 directory: ckpt_9" in capsys.readouterr().out
    assert sorted(os.listdir(output_dir)) == ["checkpoint", "ckpt_2", "ckpt_4", "notes"]



@pytest.mark.parametrize("by", ["gc", "save"])
@pytest.mark.parametrize("list_file", ["lost", "intact"])
def test_a_sealed_index_that_does_not_validate_is_never_pruned(output_dir, capsys, by, list_file):
    """ckpt_2's index sealed intact but refused by this reader (a partition scheme it does not know,
    as a newer or faulty writer may write): with the `checkpoint` file lost, the rebuilt list
    leaves it out as damaged; with the file intact it is unlisted. Neither gc nor a save's
    rotation deletes it (it is not a pruned checkpoint, whose seal is enough)."""
    raw = read_index_json(output_dir / "ckpt_2")
    raw["partition"]["scheme"] = "mix128"
    write_index_json(output_dir / "ckpt_2", raw)
    if list_file == "lost":
        os.remove(output_dir / "checkpoint")
    else:
        (output_dir / "checkpoint").write_text("ckpt_4\n")
    if by == "gc":
        main(["gc", str(output_dir)])
    else:
        job = make_job(str(output_dir), max_keep=1)
        with pytest.warns(RuntimeWarning) if list_file == "lost" else contextlib.nullcontext():
            job.saver.save("ckpt_6")
        job.saver.close()
    assert (output_dir / "ckpt_2" / "index").exists()
    assert recsave.format.ckptlist.damaged(LocalStorage(), str(output_dir), "ckpt_2") is not None

def test_gc_leaves_a_folder_of_torch_save_files_named_like_recsaves(output_dir, capsys):
    """`model.pt` alone is anyone's torch.save (`recsave convert --to torch` writes one): only a
    directory holding a name only recsave writes (a shard, an io state, an index, a temporary
    name) is a checkpoint's leftover."""
    (output_dir / "final_model").mkdir()
    torch.save({"w": torch.ones(2)}, output_dir / "final_model" / "model.pt")
    assert main(["gc", str(output_dir)]) == 0
    assert "final_model" not in capsys.readouterr().out
    assert sorted(os.listdir(output_dir / "final_model")) == ["model.pt"]


@pytest.mark.parametrize("tool", ["compact", "export-serving", "convert"])
def test_a_tool_never_replaces_a_users_folder_of_model_pt_in_its_target(output_dir, tmp_path, tool, capsys):
    """A tool writing into a directory it was pointed at took a folder named like its checkpoint
    that held a user's model.pt alone for its own leftover and replaced it. Only a Saver's own
    output dir treats a lone model.pt as one (a deletion cut short, the test below)."""
    target = tmp_path / "models"
    ckpt_id = "converted" if tool == "convert" else "ckpt_4"
    (target / ckpt_id).mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, target / ckpt_id / "model.pt")
    args = {"compact": ["compact", str(output_dir / "ckpt_4"), str(target)],
            "export-serving": ["export-serving", str(output_dir / "ckpt_4"), str(target)],
            "convert": ["convert", str(output_dir), str(target), "--to", "recsave"]}[tool]
    assert main(args) == 2
    assert "recsave: error:" in capsys.readouterr().err
    assert sorted(os.listdir(target / ckpt_id)) == ["model.pt"]
    assert set(torch.load(target / ckpt_id / "model.pt", weights_only=True)) == {"w"}


def test_a_leftover_of_model_pt_alone_is_kept_by_gc_and_replaced_by_its_save(output_dir, capsys):
    """A deletion killed part way may leave model.pt and extra.pt alone in a checkpoint's directory:
    gc cannot tell it from a user's folder and keeps it; a save of that id replaces it."""
    job = make_job(str(output_dir))
    (output_dir / "ckpt_6").mkdir()
    torch.save({}, output_dir / "ckpt_6" / "model.pt")
    torch.save({}, output_dir / "ckpt_6" / "extra.pt")
    assert main(["gc", str(output_dir)]) == 0
    assert sorted(os.listdir(output_dir / "ckpt_6")) == ["extra.pt", "model.pt"]
    job.saver.save("ckpt_6")
    assert (output_dir / "ckpt_6" / "index").exists()
    job.saver.close()


def test_gc_refuses_a_directory_that_is_no_output_dir(tmp_path, capsys):
    project = tmp_path / "project"
    (project / "best").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, project / "best" / "model.pt")
    (project / "run7").mkdir()
    (project / "run7" / "io_state_0.pt").write_bytes(b"x")
    with pytest.raises(recsave.CheckpointNotFoundError, match="not a recsave output dir; nothing removed"):
        catalog.clean_output_dir(str(project))
    assert main(["gc", str(project)]) == 2
    assert "not a recsave output dir" in capsys.readouterr().err
    assert sorted(os.listdir(project)) == ["best", "run7"]
    assert os.listdir(project / "best") == ["model.pt"]


def test_gc_refuses_while_a_saver_holds_the_output_dir(output_dir, capsys):
    """A save in progress looks like a leftover: gc leaves the dir alone while the lock is held."""
    (output_dir / "ckpt_9").mkdir()
    (output_dir / "ckpt_9" / "sparse-0-0.safetensors.tmp-1-0").write_bytes(b"being written")
    with recsave.knobs.override(writer_lock=True):
        lock = WriterLock(LocalStorage(), str(output_dir))
        lock.acquire()
        try:
            assert main(["gc", str(output_dir)]) == 2
            err = capsys.readouterr().err
            assert "being written by another Saver" in err and str(output_dir) in err
            assert (output_dir / "ckpt_9").is_dir()
        finally:
            lock.release()
        assert main(["gc", str(output_dir)]) == 0
        assert not (output_dir / "ckpt_9").exists()
        assert not (output_dir / LOCK_FILE).exists()  # gc released the lock it took


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("recsave: error: ") and err.count("\n") == 1


class _Tty:
    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_progress_bar_draws_only_on_a_terminal():
    import io

    from recsave.tools.progress import Progress

    tty = _Tty()
    p = Progress("verify", 200, unit=" B", stream=tty)
    p.advance(100)
    p.advance(100)
    p.close()
    assert "100.0%" in tty.text and tty.text.endswith("\n")
    pipe = io.StringIO()
    q = Progress("verify", 10, stream=pipe)
    q.advance(10)
    q.close()
    assert pipe.getvalue() == ""


# ------------------------------------------------------------------ --json, exit codes, temp files
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "recsave.tools.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def flip_last_shard_byte(ckpt):
    """Flips a bit near the end of the first shard's embedding rows (data every reader reads)."""
    shard = next(p for p in sorted(ckpt.iterdir()) if p.name.endswith(".safetensors"))
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    _, end = next(v["data_offsets"] for k, v in header.items() if k.endswith("@embedding"))
    data[8 + n + end - 3] ^= 0x40
    shard.write_bytes(bytes(data))
    return shard


def test_ls_json(output_dir, capsys):
    assert main(["ls", "--json", str(output_dir)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc) == ["checkpoints", "left_out", "output_dir"] and doc["output_dir"] == str(output_dir)
    assert doc["left_out"] == []
    assert [c["id"] for c in doc["checkpoints"]] == ["ckpt_2", "ckpt_4"]
    assert [c["step"] for c in doc["checkpoints"]] == [2, 4]
    for c in doc["checkpoints"]:
        assert sorted(c) == ["age_s", "bytes", "created_at", "damaged", "id", "kept", "metrics", "path", "problem",
                             "step"]
        assert c["problem"] is None and c["damaged"] is False
        assert c["path"] == str(output_dir / c["id"]) and c["bytes"] > 0
        assert c["kept"] == ["latest"] and c["metrics"] is None



@pytest.mark.parametrize("how", ["gone", "damaged", "version_0", "kind_at_version_1", "newer"])
def test_ls_reports_a_listed_checkpoint_it_cannot_read_on_its_line(output_dir, capsys, how):
    """ckpt_2 listed but its directory removed, its index garbled or of a version no recsave
    writes (0), or written by a newer recsave (5): ls still lists ckpt_4, names the problem on
    ckpt_2's line, and exits 1 for damage (0 for a newer checkpoint, which is intact); verify of the
    newer one raises FormatVersionError (2), of version 0 reports damage (1)."""
    if how == "gone":
        shutil.rmtree(output_dir / "ckpt_2")
    elif how == "damaged":
        (output_dir / "ckpt_2" / "index").write_bytes(b"{garbage")
    else:
        raw = read_index_json(output_dir / "ckpt_2")
        if how == "kind_at_version_1":  # a kind this recsave does not know, at the version of "full": damage
            raw = {"format_version": 1, "kind": "sharded", **{k: v for k, v in raw.items() if k != "format_version"}}
        else:
            raw["format_version"] = 5 if how == "newer" else 0
        write_index_json(output_dir / "ckpt_2", raw)
    code = 0 if how == "newer" else 1
    assert main(["ls", str(output_dir)]) == code
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("ckpt_2 ") and ("recsave repair" in lines[1]) == (how != "newer")
    assert lines[2].startswith("ckpt_4 ") and "latest" in lines[2]
    assert main(["ls", "--json", str(output_dir)]) == code
    first, second = json.loads(capsys.readouterr().out)["checkpoints"]
    assert first["id"] == "ckpt_2" and first["step"] is None and first["damaged"] == (how != "newer")
    assert ("upgrade recsave" in first["problem"]) == (how == "newer")
    assert ("no version any recsave writes" in first["problem"]) == (how == "version_0")
    assert ("every kind but 'full' has a higher version" in first["problem"]) == (how == "kind_at_version_1")
    assert second["id"] == "ckpt_4" and second["step"] == 4 and second["problem"] is None
    if how == "newer":
        assert main(["verify", str(output_dir / "ckpt_2")]) == 2
        with pytest.raises(recsave.FormatVersionError):
            catalog.verify(str(output_dir / "ckpt_2"))
    if how == "kind_at_version_1":
        assert main(["verify", str(output_dir / "ckpt_2")]) == 1
    if how == "version_0":
        assert main(["verify", str(output_dir / "ckpt_2")]) == 1
        (problem,) = catalog.verify(str(output_dir / "ckpt_2"))
        assert "format_version 0" in problem

@pytest.mark.parametrize("argv,says", [
    (["ls", "--json"], "the following arguments are required: OUTPUT_DIR"),
    (["verify", "--json", "--bogus", "x"], "unrecognized arguments: --bogus"),
    (["ls", "--json", "a", "b"], "unrecognized arguments: b"),
    (["ls", "--js"], "the following arguments are required: OUTPUT_DIR")])
def test_usage_errors_with_json_print_an_error_document(argv, says, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["error"]["type"] == "UsageError" and doc["error"]["exit_code"] == 2
    assert doc["error"]["message"].endswith(says) and "recsave" not in doc["error"]["message"]
    assert err.startswith("usage: recsave") and f"recsave: error: {doc['error']['message']}" in err
    assert main(argv[:1] + argv[2:]) == 2  # without --json: usage and the message on stderr only
    out, err = capsys.readouterr()
    assert out == "" and "usage:" in err and says in err


def test_usage_errors_of_commands_without_json_print_no_document_and_build_parser_exits(capsys):
    assert main(["export", "--json"]) == 2  # export has no --json: no document on stdout
    out, err = capsys.readouterr()
    assert out == "" and "usage: recsave export" in err
    with pytest.raises(SystemExit) as exc:  # the public parser behaves as argparse does
        build_parser().parse_args(["ls"])
    assert exc.value.code == 2


def test_ls_json_of_an_empty_output_dir(tmp_path, capsys):
    assert main(["ls", "--json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"output_dir": str(tmp_path), "checkpoints": [], "left_out": []}


def test_inspect_json(output_dir, capsys):
    assert main(["inspect", "--json", str(output_dir)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc) == ["base", "bytes", "chain", "created_at", "dense", "extras", "format_version", "io_states",
                           "kind", "missing", "parent", "partition", "path", "recsave_version", "sealed", "shards",
                           "step", "tables", "world_size"]
    assert doc["sealed"] is True and doc["missing"] == []
    assert (doc["kind"], doc["parent"], doc["base"], doc["chain"]) == ("full", None, "ckpt_4", ["ckpt_4"])
    assert doc["path"] == str(output_dir / "ckpt_4") and doc["step"] == 4 and doc["world_size"] == 1
    assert sorted(doc["tables"]) == ["item", "user"]
    assert sorted(doc["tables"]["user"]) == ["bytes", "dim", "dtype", "rows", "slots", "tombstones"]
    assert doc["tables"]["user"]["slots"] == ["adagrad_acc"] and doc["tables"]["user"]["dim"] == 8
    assert doc["io_states"] == ["reader"] and "mlp.0.weight" in doc["dense"]


def test_verify_json_intact_and_damaged(output_dir, capsys):
    ckpt = output_dir / "ckpt_4"
    assert main(["verify", "--json", str(ckpt)]) == 0
    assert json.loads(capsys.readouterr().out) == {"path": str(ckpt), "ok": True, "problems": []}
    shard = flip_last_shard_byte(ckpt)
    assert main(["verify", "--json", str(ckpt)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc) == ["ok", "path", "problems"] and doc["ok"] is False
    assert len(doc["problems"]) == 1 and shard.name in doc["problems"][0] and "CRC32C" in doc["problems"][0]


def test_human_output_is_unchanged_without_json(output_dir, capsys):
    assert main(["verify", str(output_dir / "ckpt_4")]) == 0
    out = capsys.readouterr().out
    assert out == f"{output_dir / 'ckpt_4'}: all checksums match\n"


@pytest.mark.parametrize("cmd", ["ls", "inspect", "verify", "gc"])
def test_missing_path_exits_2_and_creates_nothing(tmp_path, capsys, cmd):
    missing = tmp_path / "missing"
    assert main([cmd, str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("recsave: error: ") and str(missing) in captured.err
    assert captured.err.count("\n") == 1
    assert not missing.exists()
    assert main([cmd, "--json", str(missing)]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"error": {"type": "CheckpointNotFoundError", "message": doc["error"]["message"],
                             "exit_code": 2}} and str(missing) in doc["error"]["message"]


@pytest.mark.parametrize("cmd", ["ls", "gc", "repair"])
def test_a_file_given_as_output_dir_exits_2_and_is_left_alone(tmp_path, capsys, cmd):
    not_a_dir = tmp_path / "notes.txt"
    not_a_dir.write_bytes(b"hello\n")
    assert main([cmd, str(not_a_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"recsave: error: {not_a_dir} is not a directory; give a Saver's output_dir\n"
    assert not_a_dir.read_bytes() == b"hello\n" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_ls_and_inspect_bytes_count_every_file_of_the_checkpoint(output_dir, capsys):
    ckpt = output_dir / "ckpt_4"
    on_disk = sum(p.stat().st_size for p in ckpt.iterdir())
    assert main(["ls", "--json", str(output_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"][-1]["bytes"] == on_disk
    assert main(["inspect", "--json", str(ckpt)]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == on_disk


def test_exit_codes_from_a_subprocess(output_dir, tmp_path):
    """0 ok, 1 damage found, 2 usage error / not found: the same for every command."""
    missing = str(tmp_path / "missing")
    for cmd in ("ls", "inspect", "verify", "gc"):
        res = run_cli(cmd, missing)
        assert res.returncode == 2, (cmd, res.stdout, res.stderr)
        assert res.stdout == "" and res.stderr.startswith("recsave: error: ") and "Traceback" not in res.stderr
    assert run_cli("ls", str(output_dir)).returncode == 0
    assert run_cli("bogus").returncode == 2
    assert run_cli("verify", "--json", "--bogus", str(output_dir)).returncode == 2
    ckpt = output_dir / "ckpt_4"
    res = run_cli("verify", "--json", str(ckpt))
    assert res.returncode == 0 and json.loads(res.stdout)["ok"] is True and res.stderr == ""
    flip_last_shard_byte(ckpt)
    res = run_cli("verify", "--json", str(ckpt))
    assert res.returncode == 1 and json.loads(res.stdout)["ok"] is False
    (ckpt / "index").write_bytes(b"{not json")
    for cmd in ("inspect", "verify"):  # a damaged index is damage found too
        res = run_cli(cmd, str(ckpt))
        assert res.returncode == 1, (cmd, res.stdout, res.stderr)
    assert run_cli("export", str(ckpt), str(tmp_path / "out")).returncode == 1
    assert not (tmp_path / "out").exists()


# command -> its arguments after the checkpoint (tmp_path / "dst" is where a command writes)
READERS = {
    "inspect": [], "verify": [], "export": ["dst"], "export-serving": ["dst"], "compact": ["dst"],
    "convert": ["dst.pt", "--to", "torch"],
}


@pytest.mark.parametrize("cmd", sorted(READERS))
def test_a_file_the_index_lists_gone_is_damage_for_every_command(output_dir, tmp_path, capsys, cmd):
    """A shard of ckpt_4 deleted: inspect exited 0, export-serving and compact 2 (as for no such
    checkpoint), export and convert 3 (an I/O error of the file they write), verify 1. It is
    damage of a checkpoint that exists: exit 1 everywhere, IncompleteCheckpointError where a
    command stops on it, and nothing left where a command writes."""
    ckpt = output_dir / "ckpt_4"
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    shard.unlink()
    argv = [cmd, str(ckpt), *(str(tmp_path / a) if a.startswith("dst") else a for a in READERS[cmd])]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    if cmd == "inspect":
        assert f"MISSING  {shard}: listed in the index; the checkpoint is incomplete" in out and err == ""
    elif cmd == "verify":
        assert f"BAD  {shard}: file listed in the index is missing" in out
    else:
        assert err == f"recsave: error: {shard}: file listed in the index is missing; the checkpoint is " \
                      f"incomplete — restore from another checkpoint\n"
    assert not any(p.name.startswith("dst") for p in tmp_path.iterdir())
    if cmd in ("inspect", "compact"):  # the two that stop on it, with --json too
        assert main([argv[0], "--json", *argv[1:]]) == 1
        doc = json.loads(capsys.readouterr().out)
        if cmd == "inspect":
            assert doc["missing"] == [str(shard)] and doc["path"] == str(ckpt)
        else:
            assert doc["error"]["type"] == "IncompleteCheckpointError" and doc["error"]["exit_code"] == 1


def test_a_missing_listed_file_keeps_its_old_except_clauses_and_is_damage():
    """IncompleteCheckpointError: caught as before by `except CheckpointNotFoundError` and
    `except FileNotFoundError`, and as damage by `except CorruptCheckpointError`."""
    assert issubclass(recsave.IncompleteCheckpointError, recsave.CheckpointNotFoundError)
    assert issubclass(recsave.IncompleteCheckpointError, FileNotFoundError)
    assert issubclass(recsave.IncompleteCheckpointError, recsave.CorruptCheckpointError)
    assert not issubclass(recsave.CheckpointNotFoundError, recsave.CorruptCheckpointError)


def test_a_checkpoint_that_is_not_there_is_still_not_found(output_dir, tmp_path, capsys):
    """Exit 2 stays "no such checkpoint": an id that is not there at all."""
    for argv in (["inspect", str(output_dir / "ckpt_9")], ["compact", str(output_dir / "ckpt_9"), str(tmp_path / "d")]):
        assert main([argv[0], "--json", *argv[1:]]) == 2
        assert json.loads(capsys.readouterr().out)["error"]["type"] == "CheckpointNotFoundError"


def test_verify_of_a_checkpoint_with_its_index_deleted_is_damage(output_dir, capsys):
    ckpt = output_dir / "ckpt_4"
    (ckpt / "index").unlink()
    assert main(["verify", str(ckpt)]) == 1
    assert "BAD" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", ["verify", "inspect"])
def test_an_index_over_max_index_bytes_is_not_damage_found(output_dir, capsys, cmd):
    """An intact checkpoint whose index is over this process's knob max_index_bytes (written by a job
    that raised it): verify listed it as a problem and exited 1, inspect exited 1, as for damage; a
    script deleting what verify finds damaged would delete it. Unknown here, as ls and repair say."""
    ckpt = output_dir / "ckpt_4"
    with recsave.knobs.override(max_index_bytes=(ckpt / "index").stat().st_size - 1):
        with pytest.raises(recsave.OverLimitError):
            catalog.verify(str(ckpt))
        assert main([cmd, "--json", str(ckpt)]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["type"] == "OverLimitError" and "BAD" not in out
    assert "max_index_bytes" in err and "the index may be intact" in err
    assert main(["verify", str(ckpt)]) == 0


def test_failed_export_removes_the_output_dir_it_created(output_dir, tmp_path, capsys):
    flip_last_shard_byte(output_dir / "ckpt_4")
    out = tmp_path / "new" / "export"
    assert main(["export", str(output_dir), str(out)]) == 1
    assert "CRC32C" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    (kept / "empty").mkdir()
    assert main(["export", str(output_dir), str(kept)]) == 1
    assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*")) == ["empty", "notes.txt"]
    assert (kept / "notes.txt").read_text() == "mine"


def test_gc_removes_stray_temp_files_and_nothing_else(output_dir, capsys):
    before = {p: p.read_bytes() for p in output_dir.rglob("*") if p.is_file()}
    strays = ["checkpoint.tmp-123", ".recsave-writer.lock.tmp-77", "ckpt_4/index.tmp-55",
              "ckpt_4/sparse-0-0.safetensors.tmp-55-3", "ckpt_2/io_state_0.pt.tmp-9", "ckpt_2/model.pt.tmp-9"]
    for s in strays:
        (output_dir / s).write_bytes(b"partial")
    foreign = ["notes.tmp-1", "mine/index.tmp-5"]  # not recsave's names, or not in a checkpoint dir
    (output_dir / "mine").mkdir()
    (output_dir / "mine" / "keep.txt").write_text("x")
    for s in foreign:
        (output_dir / s).write_bytes(b"someone else's")
    assert main(["gc", "--json", str(output_dir)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"output_dir": str(output_dir), "removed_checkpoints": [], "removed_temp_files": sorted(strays),
                   "aborted_uploads": [], "kept_broken": {}}
    for s in strays:
        assert not (output_dir / s).exists()
    for s in foreign:
        assert (output_dir / s).read_bytes() == b"someone else's"
    after = {p: p.read_bytes() for p in output_dir.rglob("*") if p.is_file()}
    assert {p: b for p, b in after.items() if p in before} == before  # committed files untouched
    assert main(["verify", str(output_dir / "ckpt_4")]) == 0
    capsys.readouterr()
    assert main(["gc", str(output_dir)]) == 0
    assert capsys.readouterr().out == "removed 0 directories\n"


def test_gc_json_lists_removed_checkpoint_dirs(output_dir, capsys):
    (output_dir / "ckpt_9").mkdir()
    (output_dir / "ckpt_9" / "sparse-0-0.safetensors.tmp-1-0").write_bytes(b"partial")
    assert main(["gc", "--json", str(output_dir)]) == 0
    assert json.loads(capsys.readouterr().out) == {"output_dir": str(output_dir), "removed_checkpoints": ["ckpt_9"],
                                                    "removed_temp_files": [], "aborted_uploads": [],
                                                    "kept_broken": {}}


def test_gc_leaves_temp_files_alone_while_a_saver_holds_the_lock(output_dir, capsys):
    stray = output_dir / "ckpt_4" / "sparse-0-0.safetensors.tmp-1-0"
    stray.write_bytes(b"being written")
    with recsave.knobs.override(writer_lock=True):
        lock = WriterLock(LocalStorage(), str(output_dir))
        lock.acquire()
        try:
            assert main(["gc", "--json", str(output_dir)]) == 2
            assert json.loads(capsys.readouterr().out)["error"]["type"] == "WriterLockedError"
            assert stray.read_bytes() == b"being written"
        finally:
            lock.release()


def test_cli_progress_bar_only_when_stderr_is_a_terminal(output_dir, capsys, monkeypatch):
    ckpt = str(output_dir / "ckpt_4")
    assert main(["verify", ckpt]) == 0
    assert capsys.readouterr().err == ""  # pytest's captured stderr is not a terminal
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["verify", ckpt]) == 0
    assert "verify [" in tty.text and "100.0%" in tty.text and tty.text.endswith("\n")
    res = run_cli("verify", ckpt)  # a pipe: no bar
    assert res.returncode == 0 and res.stderr == ""


def test_inspect_says_when_an_index_is_not_sealed(output_dir, capsys):
    ckpt = output_dir / "ckpt_4"
    write_index_json(str(ckpt), read_index_json(str(ckpt)), sealed=False)  # as recsave wrote before seals
    assert main(["inspect", "--json", str(ckpt)]) == 0
    assert json.loads(capsys.readouterr().out)["sealed"] is False
    assert main(["inspect", str(ckpt)]) == 0
    assert "index not sealed" in capsys.readouterr().out
    assert main(["verify", str(ckpt)]) == 0  # an unsealed index is still a valid one


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
@pytest.mark.parametrize("content", [b"hi\n", b"PK\x03\x04garbage"])
def test_a_file_that_is_no_source_is_a_usage_error_without_traceback(tmp_path, capsys, cmd, content):
    """A text file or a broken zip given as a checkpoint: exit 2 with one line naming it and what
    is accepted (torch's unpickler raises KeyError on such files: once a traceback and exit 1,
    and `verify` reported it as damage)."""
    path = tmp_path / "afile.txt"
    path.write_bytes(content)
    assert main([cmd, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("recsave: error:") and "not a loadable source" in err and "Traceback" not in err


def test_verify_checks_each_shards_own_header(tmp_path, capsys):
    """A shard whose safetensors header is damaged while every data checksum still matches: a load
    refuses it, so verify must too (it checked only the data's CRC32Cs)."""
    out = str(tmp_path / "run")
    job = make_job(out)
    job.train(2)
    path = job.saver.save("ckpt_2")
    shard = os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0])
    with open(shard, "r+b") as f:
        head = f.read(200)
        at = head.index(b'"dtype"')
        f.seek(at + 1)
        f.write(b"D")  # "Dtype": an unknown key, same length, data untouched
    assert main(["verify", path]) == 1
    assert "unknown keys" in capsys.readouterr().out
    with pytest.raises(recsave.CorruptCheckpointError):
        make_job(str(tmp_path / "other")).saver.load(path, direct_path=True)


@pytest.mark.parametrize("created_at,age", [("2024-05-01T12:00:00Z", True), ("2024-05-01T12:00:00.5Z", True),
                                            ("yesterday", False)])
def test_ls_takes_any_utc_created_at_and_says_so_when_it_is_not_one(output_dir, capsys, created_at, age):
    from helpers import read_index_json, write_index_json

    index = read_index_json(str(output_dir / "ckpt_4"))
    index["created_at"] = created_at
    write_index_json(str(output_dir / "ckpt_4"), index)
    assert main(["ls", "--json", str(output_dir)]) == 0
    entry = json.loads(capsys.readouterr().out)["checkpoints"][-1]
    assert entry["created_at"] == created_at and (entry["age_s"] > 0 if age else entry["age_s"] is None)
    assert main(["ls", str(output_dir)]) == 0
    assert created_at in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["torch_save", "dcp", "parquet"])
@pytest.mark.parametrize("tool", ["export_serving", "to_parquet", "compact", "describe", "verify"])
def test_tools_taking_checkpoints_name_the_kind_of_another_source(output_dir, tmp_path, kind, tool):
    import torch.distributed.checkpoint as dcp

    from recsave.tools.export import to_parquet

    if kind == "torch_save":
        src, words = str(tmp_path / "m.pt"), "a torch.save file"
        torch.save({"w": torch.ones(3, 2)}, src)
    elif kind == "dcp":
        src, words = str(tmp_path / "dcp"), "a torch.distributed.checkpoint directory"
        dcp.save({"w": torch.ones(3, 2)}, checkpoint_id=src, no_dist=True)
    else:
        src, words = str(tmp_path / "pq"), "a Parquet export"
        to_parquet(str(output_dir), src)
    call = {"export_serving": lambda: recsave.export_serving(src, str(tmp_path / "out"), "int8"),
            "to_parquet": lambda: to_parquet(src, str(tmp_path / "out")),
            "compact": lambda: recsave.compact(src, str(tmp_path / "out")),
            "describe": lambda: catalog.describe(src),
            "verify": lambda: catalog.verify(src)}[tool]
    with pytest.raises(UsageError, match=rf"is {words}, not a recsave checkpoint; {tool} takes a checkpoint"):
        call()
    assert not (tmp_path / "out").exists()



def test_ls_of_a_checkpoint_directory_says_so(output_dir, capsys):
    """`recsave ls run/ckpt_4` (a checkpoint, not its output dir) said "no committed checkpoint"
    and exited 0; it names the mistake now (exit 2)."""
    assert main(["ls", str(output_dir / "ckpt_4")]) == 2
    err = capsys.readouterr().err
    assert "is a checkpoint directory, not an output dir" in err and str(output_dir) in err


def test_an_unexpected_error_exits_4_with_its_traceback_not_1(output_dir, monkeypatch, capsys):
    """An exception recsave does not translate (a bug, another library's error) ended the command
    with Python's status 1, which reads as "damage found" to a script checking `verify`."""
    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(catalog, "describe", broken)
    assert main(["inspect", str(output_dir / "ckpt_4"), "--json"]) == 4
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": {"type": "RuntimeError", "exit_code": 4, "message":
                                         "unexpected RuntimeError: boom (a recsave bug or an error it does not "
                                         "know; the traceback is above: please report it)"}}
    assert err.startswith("Traceback (most recent call last):") and 'raise RuntimeError("boom")' in err
    assert err.splitlines()[-1].startswith("recsave: error: unexpected RuntimeError: boom")


def test_a_warning_is_one_line_on_stderr(output_dir):
    """gc of an output dir whose list was lost: the rebuild's warning reads as recsave's errors do,
    not as Python's `file:line: RuntimeWarning` with a source line; a caller recording warnings
    around main() still gets it."""
    os.remove(output_dir / "checkpoint")
    run = subprocess.run([sys.executable, "-m", "recsave.cli", "ls", str(output_dir)], capture_output=True,
                         text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(recsave.__file__))))
    assert run.returncode == 0, run.stderr
    err = run.stderr.splitlines()
    assert len(err) == 1 and err[0].startswith("recsave: warning: ") and "is missing; rebuilt the list" in err[0]
    with pytest.warns(RuntimeWarning, match="is missing; rebuilt the list"):
        assert main(["gc", str(output_dir)]) == 0
    # With warnings made errors (python -W error) the warning is the command's error: one line, exit 2.
    os.remove(output_dir / "checkpoint")
    run = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "recsave.cli", "ls", str(output_dir)],
                         capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(recsave.__file__))))
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("recsave: error: RuntimeWarning: ") and "is missing" in run.stderr
