"""The `recsave` command line: ls, inspect, verify, gc (export is in test_export.py)."""
import os

import pytest

import recsave
from recsave.tools.cli import main
from recsave.storage.lock import LOCK_FILE, WriterLock
from recsave.storage import LocalStorage

from helpers import make_job


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
    assert "ckpt_4: step 4, 1 rank(s), format 1" in out
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
