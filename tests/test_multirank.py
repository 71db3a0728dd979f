"""Multi-rank save and N -> M resharding load with real gloo processes on the CPU."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from mr_worker import build, expected_rows, global_ids, listing

from recsave import Saver, partition
from recsave.format import read_index

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.multirank


def run_ranks(scenario, world, work_dir, env_extra=None, timeout=120):
    init_file = os.path.join(work_dir, f"init-{scenario}-{world}-{time.monotonic_ns()}")
    env = dict(os.environ, **(env_extra or {}))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "mr_worker.py"), scenario, str(r), str(world),
                               init_file, str(work_dir)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        outs.append(out)
    return [p.returncode for p in procs], outs


@pytest.mark.parametrize("save_world,scheme,how", [(2, "local", "save"), (4, "file", "save"),
                                                  (2, "local", "async_save"), (2, "local", "async_save_changed")])
def test_save_with_n_ranks_load_with_m(tmp_path, save_world, scheme, how, monkeypatch):
    monkeypatch.setenv("OUT_SCHEME", scheme)
    codes, outs = run_ranks(how, save_world, tmp_path)
    assert codes == [0] * save_world, outs
    if how == "async_save_changed":  # each rank copied only the rows it rewrote since its first save
        for r in range(save_world):
            staged, rewritten = json.loads((tmp_path / f"staged_{save_world}_{r}.json").read_text())
            assert 0 < staged == rewritten
    index = read_index(str(tmp_path / "out" / "ckpt_1"))
    assert index.world_size == save_world
    assert index.tensor("user@id").shape == (len(global_ids()),)

    ids_all = global_ids()
    for load_world in (1, 2, 3, 4):
        env = {} if load_world == save_world else {"NO_IO": "1"}
        codes, outs = run_ranks("load", load_world, tmp_path, env)
        assert codes == [0] * load_world, outs
        for salt, name in ((0.0, "user"), (100.0, "item")):
            seen = []
            for r in range(load_world):
                got = torch.load(tmp_path / f"{name}_{load_world}_{r}.pt", weights_only=True)
                owned = ids_all[partition.owner_of(ids_all, load_world) == r]
                # Exactly this rank's ids, with bit-exact rows and slots.
                assert sorted(got["ids"].tolist()) == sorted(owned.tolist())
                assert torch.equal(got["values"], expected_rows(got["ids"], salt))
                assert torch.equal(got["acc"], expected_rows(got["ids"], salt + 0.5))
                seen += got["ids"].tolist()
            assert len(seen) == len(set(seen)) == len(ids_all)  # no id on two ranks, none lost
        dense = [torch.load(tmp_path / f"dense_{load_world}_{r}.pt", weights_only=True) for r in range(load_world)]
        for d in dense[1:]:
            assert all(torch.equal(d[k], dense[0][k]) for k in d)
        reports = [json.loads((tmp_path / f"report_{load_world}_{r}.json").read_text()) for r in range(load_world)]
        if load_world == save_world:  # io states come back per rank
            assert [rep["position"] for rep in reports] == [1000 + r for r in range(load_world)]
        _check_index_read_once(reports, str(tmp_path / "out" / "ckpt_1"), chain_length=1)
        sparse_bytes = sum(t.nbytes for t in index.tensors.values())
        for rep in reports:  # each rank reads about its share of the sparse bytes
            assert rep["bytes_read"] <= sparse_bytes / load_world * 1.05 + 4 * (64 << 10) * 4


def test_a_tablelike_table_saved_by_2_ranks_loads_on_3(tmp_path):
    codes, outs = run_ranks("tt_save", 2, tmp_path)
    assert codes == [0, 0], outs
    assert read_index(str(tmp_path / "tt_out" / "ckpt_1")).meta.tables["tt"].rows == len(global_ids())
    codes, outs = run_ranks("tt_load", 3, tmp_path)
    assert codes == [0, 0, 0], outs
    ids_all = global_ids()
    seen = []
    for r in range(3):
        got = torch.load(tmp_path / f"tt_3_{r}.pt", weights_only=True)
        owned = ids_all[partition.owner_of(ids_all, 3) == r]
        assert sorted(got["ids"].tolist()) == sorted(owned.tolist())
        assert torch.equal(got["values"], expected_rows(got["ids"], 0.0))
        assert torch.equal(got["acc"], expected_rows(got["ids"], 0.5))
        assert got["partition"] == [r, 3, partition.DEFAULT_NUM_BUCKETS]
        seen += got["ids"].tolist()
    assert len(seen) == len(set(seen)) == len(ids_all)


def test_ranks_bank_load_their_ids_from_torch_save_and_dcp_sources(tmp_path):
    import torch.distributed.checkpoint as dcp

    ids = global_ids()
    state = {"user.weight": expected_rows(ids, 0.0), "user.ids": ids, "dense.weight": torch.rand(2, 6),
             "dense.bias": torch.rand(2)}
    torch.save(state, tmp_path / "state.pt")
    dcp.save(state, checkpoint_id=str(tmp_path / "state_dcp"), no_dist=True)
    codes, outs = run_ranks("torch_bank", 2, tmp_path)
    assert codes == [0, 0], outs
    for kind in ("torch", "dcp"):
        seen = []
        for r in range(2):
            got = torch.load(tmp_path / f"bank_{kind}_2_{r}.pt", weights_only=True)
            owned = ids[partition.owner_of(ids, 2) == r]
            assert sorted(got["ids"].tolist()) == sorted(owned.tolist())
            assert torch.equal(got["values"], expected_rows(got["ids"], 0.0))
            assert torch.equal(got["dense"], state["dense.weight"])
            seen += got["ids"].tolist()
        assert len(seen) == len(set(seen)) == len(ids)
    for r in range(2):  # DCP keeps one rank's copy of plain tensors: a sharded table's is refused
        refusal, replicated = json.loads((tmp_path / f"to_dcp_2_{r}.json").read_text())
        assert refusal.startswith("to_dcp_state_dict: a process group of 2 ranks runs") and "replicated=True" in refusal
        assert "user.table.ids" in replicated and "dense.weight" in replicated


def test_io_state_of_n_workers_refused_on_m_without_reshard(tmp_path):
    codes, outs = run_ranks("save", 2, tmp_path)
    assert codes == [0, 0], outs
    codes, outs = run_ranks("load", 3, tmp_path)
    assert all(c != 0 for c in codes)
    assert "saved by 2 worker(s) but 3 are loading" in outs[0]
    # A later bank entry that loads the io state instead makes the first entry's moot: no refusal.
    model, saver, reader = build(str(tmp_path / "alone"))
    reader.position = 77
    saver.save("ckpt_1")
    reader.position = 0
    report = saver.load_model_bank([{"path": str(tmp_path / "out")},
                                    {"path": str(tmp_path / "alone" / "out"), "load": ["reader"]}])
    assert report.loaded["reader"].checkpoint.endswith("alone/out/ckpt_1") and reader.position == 77
    assert report.loaded["user"].checkpoint.endswith(f"{tmp_path.name}/out/ckpt_1")


def test_killed_rank_leaves_previous_checkpoint_and_survivors_raise(tmp_path):
    started = time.monotonic()
    codes, outs = run_ranks("save_killed", 4, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "30"}, timeout=150)
    assert codes[1] == -9
    for r in (0, 2, 3):
        assert codes[r] == 3, outs[r]
        assert "RankFailedError" in (tmp_path / f"error_{r}.txt").read_text()
    assert time.monotonic() - started < 120
    out = tmp_path / "out"
    assert (out / "checkpoint").read_text().split() == ["ckpt_1"]
    assert not (out / "ckpt_2" / "index").exists()
    codes, outs = run_ranks("load", 4, tmp_path)
    assert codes == [0] * 4, outs


def test_a_rank_stops_writing_once_another_writer_took_rank0s_lock(tmp_path):
    """Only rank 0 holds the writer lock; rank 1 checks it (as granted in the save's first exchange)
    before each table once half a lease passed, so it begins no table in a directory that a second
    job's writer took over, nor removes that writer's lock or files."""
    codes, outs = run_ranks("save_taken_over", 2, tmp_path)
    assert codes == [3, 3], outs
    text = (tmp_path / "error_1.txt").read_text()
    assert text.startswith("WriterLockedError: ") and "held by pid 4242 on host 'second-job'" in text, text
    assert "this rank stops writing" in text
    out = tmp_path / "out"
    ckpt = out / "ckpt_2"
    assert (ckpt / "sparse-1-0.safetensors").exists()  # its first table, written before the takeover
    assert not [f for f in os.listdir(ckpt) if f.startswith("sparse-1-1")]  # its second: never begun
    assert json.loads((out / ".recsave-writer.lock").read_text())["token"] == "theirs"
    assert (out / "checkpoint").read_text().split() == ["ckpt_1"]


@pytest.mark.parametrize("taken_over", [False, True])
def test_a_rank_keeps_its_files_when_rank_0_died_and_the_lock_is_anothers(tmp_path, taken_over):
    """Without rank 0's verdict a rank reads the lock itself: a rank 0 gone silent outlives its
    lease before the group's timeout ends, and the writer that took the lock over may be writing
    the same names, so the rank removes nothing then; with the lock still rank 0's it removes its
    files as before. The latest committed checkpoint loads either way."""
    scenario = "save_rank0_killed_taken_over" if taken_over else "save_rank0_killed"
    codes, outs = run_ranks(scenario, 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "30"}, timeout=150)
    assert codes[0] == -9, outs
    assert codes[1] == 3, outs
    assert "RankFailedError" in (tmp_path / "error_1.txt").read_text()
    ckpt = tmp_path / "out" / "ckpt_2"  # gone when rank 1 made it and left it empty
    left = os.listdir(ckpt) if ckpt.exists() else []
    rank1 = sorted(f for f in left if f.endswith("_1.pt") or f.startswith("sparse-1-"))
    assert rank1 == (["io_state_1.pt", "sparse-1-0.safetensors", "sparse-1-1.safetensors"] if taken_over else [])
    assert (tmp_path / "out" / "checkpoint").read_text().split() == ["ckpt_1"]
    if taken_over:
        (tmp_path / "out" / ".recsave-writer.lock").unlink()  # the second job is gone
    codes, outs = run_ranks("load", 2, tmp_path)
    assert codes == [0, 0], outs


def test_error_on_one_rank_makes_every_rank_raise_at_once(tmp_path):
    started = time.monotonic()
    codes, outs = run_ranks("save_error", 3, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300"})
    assert codes == [3, 3, 3], outs
    assert "No space left on device" in (tmp_path / "error_2.txt").read_text()
    for r in (0, 1):
        text = (tmp_path / f"error_{r}.txt").read_text()
        assert "RankFailedError" in text and "rank 2" in text
    assert time.monotonic() - started < 100  # not the 300 s collective timeout
    assert (tmp_path / "out" / "checkpoint").read_text().split() == ["ckpt_1"]
    assert not (tmp_path / "out" / "ckpt_2").exists()


@pytest.mark.parametrize("scenario", ["save_bad_io_state", "async_bad_io_state"])
def test_a_snapshot_failing_on_one_rank_makes_every_rank_raise_at_once(tmp_path, scenario):
    """Rank 1's snapshot refuses its io state before any shard is written; rank 0 must learn of it
    at the write's first exchange, not wait out the collective timeout."""
    started = time.monotonic()
    codes, outs = run_ranks(scenario, 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300"})
    assert codes == [3, 3], outs
    own = (tmp_path / "error_1.txt").read_text()
    assert own.startswith("UsageError: ") and "datetime" in own, own
    text = (tmp_path / "error_0.txt").read_text()
    assert text.startswith("RankFailedError: preparing ") and "failed on rank 1: UsageError: " in text, text
    assert time.monotonic() - started < 100  # not the 300 s collective timeout
    assert (tmp_path / "out" / "checkpoint").read_text().split() == ["ckpt_1"]
    assert not (tmp_path / "out" / "ckpt_2").exists()


def test_a_slot_only_one_rank_has_is_refused_and_nothing_committed(tmp_path):
    codes, outs = run_ranks("save_uneven", 2, tmp_path)
    assert codes == [3, 3], outs
    assert "hold tables or slots that rank 0 does not" in (tmp_path / "error_0.txt").read_text()
    assert "user@only_here" in (tmp_path / "error_0.txt").read_text()
    assert "rank 0" in (tmp_path / "error_1.txt").read_text()
    assert (tmp_path / "out" / "checkpoint").read_text().split() == ["ckpt_1"]


def test_a_slot_only_rank0_has_is_refused_and_nothing_committed(tmp_path):
    """Committed, the slot would hold rank 0's rows only, fewer than the table's ids: no load could
    take the checkpoint, and verify would pass it."""
    codes, outs = run_ranks("save_uneven_rank0", 2, tmp_path)
    assert codes == [3, 3], outs
    text = (tmp_path / "error_0.txt").read_text()
    assert "rank(s) [1] lack tables or slots that rank 0 holds (['user@only_rank0'])" in text
    assert "nothing was committed" in text and "rank 0" in (tmp_path / "error_1.txt").read_text()
    assert (tmp_path / "out" / "checkpoint").read_text().split() == ["ckpt_1"]
    assert not (tmp_path / "out" / "ckpt_2").exists()


def test_ranks_naming_different_checkpoints_are_refused_before_writing(tmp_path):
    """Each rank would write into its own directory and rank 0 commit an index naming files that
    are elsewhere (then pruned): a listed checkpoint no load could read."""
    codes, outs = run_ranks("save_other_ids", 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300"})
    assert codes == [3, 3], outs
    for r in (0, 1):
        text = (tmp_path / f"error_{r}.txt").read_text()
        assert text.startswith("UsageError: preparing ") and "the ranks disagree on the checkpoint id: rank 0 " \
            "has 'ckpt_2', rank 1 'ckpt_3'" in text, text
    out = tmp_path / "out"
    assert (out / "checkpoint").read_text().split() == ["ckpt_1"]
    assert not (out / "ckpt_3").exists()
    assert not (out / "ckpt_2").exists() or not any((out / "ckpt_2").iterdir())  # rank 0's prepared dir at most


@pytest.mark.parametrize("damaged_rank", [0, 1])
def test_a_fallback_load_skips_a_checkpoint_damaged_in_one_ranks_share_on_every_rank(tmp_path, damaged_rank):
    """The rank that reads the damage raises CorruptCheckpointError, the others RankFailedError:
    every rank must still take the same decision (fall back), not one fall back while another
    raises and leaves it waiting in a collective."""
    codes, outs = run_ranks("save_two", 2, tmp_path)
    assert codes == [0, 0], outs
    ckpt = tmp_path / "out" / "ckpt_2"
    index = json.loads((ckpt / "index").read_text())
    chunk = next(c for c in index["tensors"]["user@embedding"]["chunks"]
                 if c["file"].startswith(f"sparse-{damaged_rank}-"))
    with open(ckpt / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"] + chunk["length"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    codes, outs = run_ranks("load_fallback", 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300"})
    assert codes == [0, 0], outs
    ids_all = global_ids()
    for r in range(2):
        report = json.loads((tmp_path / f"report_2_{r}.json").read_text())
        assert report["position"] == 1 and report["checkpoints"] == [str(tmp_path / "out" / "ckpt_1")]
        assert any("ckpt_2 cannot be loaded" in w and "falling back" in w for w in report["warnings"])
        for salt, name in ((0.0, "user"), (100.0, "item")):
            got = torch.load(tmp_path / f"{name}_2_{r}.pt", weights_only=True)
            owned = ids_all[partition.owner_of(ids_all, 2) == r]
            assert sorted(got["ids"].tolist()) == sorted(owned.tolist())
            assert torch.equal(got["values"], expected_rows(got["ids"], salt)), (r, name)


@pytest.mark.parametrize("differ", ["checkpoints", "names"])
def test_ranks_loading_different_checkpoints_are_refused_and_change_nothing(tmp_path, differ):
    """Ranks loading other checkpoints, or other names of one (rank 0 excluding the sharded table
    user: half of it would be restored), are refused on every rank before any model changes."""
    codes, outs = run_ranks("save_two", 2, tmp_path)
    assert codes == [0, 0], outs
    codes, outs = run_ranks("load_other_ids", 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300",
                                                            "OTHER_NAMES": "1" if differ == "names" else "0"})
    assert codes == [0, 0], outs
    for r in range(2):
        text = (tmp_path / f"error_{r}.txt").read_text()
        assert text.startswith("UsageError: reading ") and "the ranks disagree on the checkpoints and names " \
            "loaded: rank 0 has ([('ckpt_" in text, text
        if differ == "checkpoints":
            assert "rank 0 has [('ckpt_1', 1)]" in text.replace("([", "[") and "rank 1 ([('ckpt_2', 2)]" in text
        else:
            assert "'item@adagrad_acc', 'reader', 'sparse_optim']), rank 1 ([('ckpt_2', 2)], ['dense.bias'" in text
        got = torch.load(tmp_path / f"user_2_{r}.pt", weights_only=True)
        assert torch.equal(got["values"], expected_rows(got["ids"], 50.0))  # the live rows, untouched


def test_a_fallback_past_an_index_damaged_in_one_ranks_own_copy_is_taken_by_every_rank(tmp_path):
    """Per-rank output dirs (each a copy of the checkpoints): rank 1's copy of the latest index is
    damaged, so rank 1 fails while planning, where no exchange follows at once; every rank must
    still fall back alike, not rank 1 alone while rank 0 goes on."""
    codes, outs = run_ranks("save_two", 2, tmp_path)
    assert codes == [0, 0], outs
    for r in (0, 1):
        shutil.copytree(tmp_path / "out", tmp_path / f"out_{r}")
    (tmp_path / "out_1" / "ckpt_2" / "index").write_bytes(b'{"magic": "recsave.index", garbled')
    codes, outs = run_ranks("load_fallback", 2, tmp_path, {"PER_RANK_OUT": "1", "RECSAVE_COLLECTIVE_TIMEOUT_S": "300"})
    assert codes == [0, 0], outs
    for r in range(2):
        report = json.loads((tmp_path / f"report_2_{r}.json").read_text())
        assert report["position"] == 1 and report["checkpoints"] == [str(tmp_path / f"out_{r}" / "ckpt_1")], report
        got = torch.load(tmp_path / f"user_2_{r}.pt", weights_only=True)
        assert torch.equal(got["values"], expected_rows(got["ids"], 0.0))


def test_a_bank_load_failing_on_one_rank_while_planning_fails_every_rank_alike(tmp_path):
    codes, outs = run_ranks("save_two", 2, tmp_path)
    assert codes == [0, 0], outs
    for r in (0, 1):
        shutil.copytree(tmp_path / "out", tmp_path / f"out_{r}")
    (tmp_path / "out_1" / "ckpt_2" / "index").write_bytes(b'{"magic": "recsave.index", garbled')
    codes, outs = run_ranks("bank_damaged_then_load", 2, tmp_path,
                            {"PER_RANK_OUT": "1", "RECSAVE_COLLECTIVE_TIMEOUT_S": "300"})
    assert codes == [0, 0], outs
    assert json.loads((tmp_path / "report_2_0.json").read_text()) == ["RankFailedError", 1]
    assert json.loads((tmp_path / "report_2_1.json").read_text()) == ["CorruptCheckpointError", 1]


@pytest.mark.parametrize("bad_rank,refused", [(0, "entry"), (1, "entry"), (1, "model")])
def test_a_bank_load_refused_on_one_rank_fails_every_rank_without_waiting(tmp_path, bad_rank, refused):
    """One rank alone gives a malformed entry, or has a model a Saver refuses: it fails before any
    index is read, while the others go on to the index broadcast. Every rank must raise at once
    (that rank its own error, the other RankFailedError naming it), not after the collective
    timeout (300 s here, against the 120 s run_ranks waits), and the group stays usable: the next
    load of every rank lines up (a rank a collective behind would pair this load with that one)."""
    codes, outs = run_ranks("save_two", 2, tmp_path)
    assert codes == [0, 0], outs
    codes, outs = run_ranks("bank_refused_then_load", 2, tmp_path,
                            {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300", "BAD_RANK": str(bad_rank), "REFUSED": refused})
    assert codes == [0, 0], outs
    own = "ConfigError" if refused == "entry" else "UsageError"
    for r in (0, 1):
        assert json.loads((tmp_path / f"report_2_{r}.json").read_text()) == [
            own if r == bad_rank else "RankFailedError", 1]


@pytest.mark.parametrize("bad_rank", [0, 1])
@pytest.mark.parametrize("how", ["fallback", "restore"])
def test_a_restore_whose_list_fails_on_one_rank_fails_every_rank_without_waiting(tmp_path, bad_rank, how):
    """Saver.load(fallback=True) and CheckpointManager.restore list each rank's output dir before
    any collective: a rank that cannot read its list must not leave the others in the load's
    collectives until the timeout (300 s here, against the 120 s run_ranks waits)."""
    codes, outs = run_ranks("save_two", 2, tmp_path)
    assert codes == [0, 0], outs
    codes, outs = run_ranks("list_fails_then_load", 2, tmp_path,
                            {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300", "BAD_RANK": str(bad_rank), "HOW": how})
    assert codes == [0, 0], outs
    for r in (0, 1):
        assert json.loads((tmp_path / f"report_2_{r}.json").read_text()) == [
            "StorageError" if r == bad_rank else "RankFailedError", 1]


def test_a_load_damaged_on_one_rank_changes_no_rank(tmp_path):
    """Rank 1's bytes are damaged; rank 0's are fine, yet rank 0 must not change either: every rank
    reads and verifies before any rank applies (load/transaction.py)."""
    codes, outs = run_ranks("save", 2, tmp_path)
    assert codes == [0, 0], outs
    ckpt = tmp_path / "out" / "ckpt_1"
    index = json.loads((ckpt / "index").read_text())
    chunk = next(c for c in index["tensors"]["user@embedding"]["chunks"] if c["file"].startswith("sparse-1-"))
    with open(ckpt / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"] + chunk["length"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    codes, outs = run_ranks("load_damaged", 2, tmp_path)
    assert codes == [0, 0], outs
    assert "CorruptCheckpointError" in (tmp_path / "error_1.txt").read_text()
    assert "RankFailedError" in (tmp_path / "error_0.txt").read_text()
    ids_all = global_ids()
    for r in range(2):
        assert json.loads((tmp_path / f"report_2_{r}.json").read_text())["position"] == 5
        for salt, name in ((50.0, "user"), (150.0, "item")):
            got = torch.load(tmp_path / f"{name}_2_{r}.pt", weights_only=True)
            owned = ids_all[partition.owner_of(ids_all, 2) == r]
            assert sorted(got["ids"].tolist()) == sorted(owned.tolist())
            assert torch.equal(got["values"], expected_rows(got["ids"], salt)), (r, name)
            assert torch.equal(got["acc"], expected_rows(got["ids"], salt + 0.5)), (r, name)


@pytest.mark.parametrize("layout", ["shared", "per_rank"])
def test_a_failed_save_leaves_every_ranks_output_dir_as_before(tmp_path, layout):
    """Rank 1 holds ids of rank 0 in its second table (UsageError after its first table's files are
    written): every rank removes what it created, on a shared output dir and on per-rank ones."""
    codes, outs = run_ranks("save_foreign", 2, tmp_path, {"PER_RANK_OUT": "1"} if layout == "per_rank" else {})
    assert codes == [3, 3], outs
    assert "holds ids owned by other ranks" in (tmp_path / "error_1.txt").read_text()
    assert "RankFailedError" in (tmp_path / "error_0.txt").read_text()

    def stable(names):  # the writer lock's heartbeat may be caught in its temporary file
        return [n for n in names if ".recsave-writer.lock.tmp" not in n]
    for r in range(2):
        out = tmp_path / ("out" if layout == "shared" else f"out_{r}")
        before = json.loads((tmp_path / f"listing_{0 if layout == 'shared' else r}.json").read_text())
        assert not (out / "ckpt_2").exists(), listing(out)
        assert stable(listing(out)) == stable(before)


@pytest.mark.parametrize("layout", ["shared", "per_rank"])
def test_rotation_prunes_every_ranks_output_dir(tmp_path, layout):
    """max_keep=1, four saves: each output dir holds the kept checkpoint's files alone. With an
    output dir per rank, rank 1 removes its own shards and io states of the checkpoints rank 0's
    rotation pruned (nothing else would); on a shared dir rank 0's rotation does it all, and rank 1
    removes nothing itself."""
    env = {"MAX_KEEP": "1", **({"PER_RANK_OUT": "1"} if layout == "per_rank" else {})}
    codes, outs = run_ranks("save_rotating", 2, tmp_path, env)
    assert codes == [0, 0], outs
    reports = [json.loads((tmp_path / f"report_{r}.json").read_text()) for r in range(2)]
    for rep in reports:
        assert rep["warnings"] == [], rep
    rank0_dir = tmp_path / ("out" if layout == "shared" else "out_0")
    files = sorted(read_index(str(rank0_dir / "ckpt_4")).files)
    assert any(f.startswith("sparse-1-") for f in files) and "io_state_1.pt" in files

    def of_rank(name):  # the rank whose files a checkpoint file is, None: rank 0's dense files
        if name.startswith("sparse-"):
            return int(name.split("-")[1])
        if name.startswith("io_state_") and name != "io_state_count":
            return int(name[len("io_state_"):-len(".pt")])
        return None
    if layout == "shared":
        assert reports[0]["listing"] == sorted(["checkpoint", "ckpt_4/", "ckpt_4/index"]
                                               + [f"ckpt_4/{f}" for f in files])
        assert reports[1]["removals"] == 0  # a shared dir: rank 1 never removes anything itself
    else:
        assert reports[0]["listing"] == sorted(["checkpoint", "ckpt_4/", "ckpt_4/index"]
                                               + [f"ckpt_4/{f}" for f in files if of_rank(f) in (0, None)])
        assert reports[1]["listing"] == sorted(["ckpt_4/"] + [f"ckpt_4/{f}" for f in files if of_rank(f) == 1])
        assert reports[1]["removals"] == 3


def test_a_shard_id_other_than_the_group_rank_is_refused(tmp_path):
    """Both ranks pass shard_id=1: without the check nobody commits, yet both saves return."""
    codes, outs = run_ranks("save_as_rank1", 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "5"})
    assert codes == [3, 3], outs
    assert "UsageError: cannot save as rank 1 of 2: this process is rank 0" in (tmp_path / "error_0.txt").read_text()
    assert "RankFailedError" in (tmp_path / "error_1.txt").read_text()
    assert not (tmp_path / "out" / "ckpt_1").exists()
    assert not (tmp_path / "out" / "checkpoint").exists()


@pytest.mark.parametrize("unpartitioned", ["0", "1"])
def test_a_ranks_share_saved_with_shard_num_1_is_refused(tmp_path, unpartitioned):
    """shard_num=1 on every rank of 2: one rank's share would be committed as the whole
    checkpoint (and rotation would prune the full one). Each rank refuses its share (partitioned,
    or told by its ids alone), at once, and nothing is written."""
    started = time.monotonic()
    codes, outs = run_ranks("save_as_one_process", 2, tmp_path,
                            {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300", "UNPARTITIONED": unpartitioned})
    assert codes == [3, 3], outs
    assert time.monotonic() - started < 100
    for r in (0, 1):
        text = (tmp_path / f"error_{r}.txt").read_text()
        assert "UsageError: table 'user' is this rank's share of a model sharded over the 2 ranks" in text, text
        assert (f"its ids are all rank {r}'s" if unpartitioned == "1" else f"partitioned as rank {r} of 2") in text
    assert (tmp_path / "out" / "checkpoint").read_text().split() == ["ckpt_1"]
    assert not (tmp_path / "out" / "ckpt_2").exists()


def test_an_async_snapshot_failing_on_one_rank_keeps_the_managers_in_step(tmp_path):
    """Rank 1's snapshot fails in an async autosave: its async_save returns a failed write as rank
    0's does (not an error at the call), so both managers hold the same pending id; the next
    save() raises on both at once (rank 1 its error, rank 0 RankFailedError), and the one after
    saves on both."""
    started = time.monotonic()
    codes, outs = run_ranks("manager_async_snapshot_fails", 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300"})
    assert codes == [0, 0], outs
    assert time.monotonic() - started < 120
    reports = [json.loads((tmp_path / f"report_2_{r}.json").read_text()) for r in range(2)]
    assert reports == [["saved:ckpt_2", "RankFailedError", "saved:ckpt_2"],
                       ["saved:ckpt_2", "UsageError", "saved:ckpt_2"]], outs
    assert (tmp_path / "out" / "checkpoint").read_text().split() == ["ckpt_2"]


@pytest.mark.parametrize("load", ["group", "alone"])
def test_a_manager_save_after_a_saver_load_refuses_on_every_rank_at_once(tmp_path, load):
    """After an autosave of ckpt_2, a load through the Saver (by the group, or by rank 0 alone):
    CheckpointManager.save at step 2 must not return ckpt_2 on any rank; the ranks agree, the
    refusal reaches every rank at once (rank 0: CheckpointExistsError, rank 1: RankFailedError),
    twice over, and no rank waits for the collective timeout."""
    started = time.monotonic()
    codes, outs = run_ranks("manager_save_after_saver_load", 2, tmp_path,
                            {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300", "LOAD": load})
    assert codes == [0, 0], outs
    assert time.monotonic() - started < 120
    reports = [json.loads((tmp_path / f"report_2_{r}.json").read_text()) for r in range(2)]
    assert reports == [["CheckpointExistsError"] * 2, ["RankFailedError"] * 2], outs


@pytest.mark.parametrize("per_rank_out", ["", "1"])
def test_a_managers_save_right_after_its_autosave_returns_it_on_every_rank(tmp_path, per_rank_out):
    """No load between: save() at step 2 returns the autosave's ckpt_2 on every rank without a
    collective save. With an output dir per rank, only rank 0's holds the `checkpoint` list: the
    other ranks, reading theirs, saved again while rank 0 did not, and both waited for the
    collective timeout."""
    started = time.monotonic()
    codes, outs = run_ranks("manager_save_after_saver_load", 2, tmp_path,
                            {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300", "LOAD": "none", "PER_RANK_OUT": per_rank_out})
    assert codes == [0, 0], outs
    assert time.monotonic() - started < 120
    reports = [json.loads((tmp_path / f"report_2_{r}.json").read_text()) for r in range(2)]
    assert reports == [["saved:ckpt_2"] * 2] * 2, outs


def test_a_replicated_model_is_saved_by_one_rank_alone(tmp_path):
    """Every rank holds every id: rank 0 saves it with shard_num=1 while rank 1 takes no part
    (no collective), and the checkpoint holds every row."""
    codes, outs = run_ranks("save_replicated_alone", 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "60"})
    assert codes == [0, 0], outs
    from mr_worker import Model

    model = Model()
    Saver(model, output_dir=str(tmp_path / "out")).load()
    ids = global_ids()
    assert len(model.user) == ids.numel()
    assert torch.equal(model.user.export(ids)[1], expected_rows(ids, 0.0))
    # Loaded back inside the group: with shard_num=1 each rank alone restores the whole tables
    # (every id, exact rows, no collective); without it each rank takes its share.
    every = sorted(ids.tolist())
    shares = []
    for r in range(2):
        loaded = json.loads((tmp_path / f"loaded_{r}.json").read_text())
        assert loaded["alone"] == [ids.numel(), ids.numel(), True, every]
        assert loaded["bank_alone"][0] == ids.numel() and loaded["bank_alone"][2:] == [True, every]
        assert loaded["bank_alone"][1] == 0  # the bank entry loads "user" only
        mine = sorted(ids[partition.owner_of(ids, 2) == r].tolist())
        assert loaded["group"][0] == len(mine) and loaded["group"][2:] == [True, mine]
        # Loading alone after that: whole tables again, no longer the rank's shard.
        assert loaded["group_then_alone"] == [ids.numel(), ids.numel(), None, True]
        shares += mine
    assert sorted(shares) == every


@pytest.mark.parametrize("bad", ["metric", "flag", "names"])
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_save_arguments_refused_on_one_rank_fail_every_rank_at_once(tmp_path, how, bad):
    started = time.monotonic()
    codes, outs = run_ranks("save_bad_metric_on_one_rank", 2, tmp_path,
                            {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300", "ASYNC": "1" if how == "async_save" else "0",
                             "BAD": bad})
    assert codes == [3, 3], outs
    flag = "pinned" if how == "async_save" else "incremental"
    expected = {"metric": f"UsageError: {how}: metric 'loss' must be a finite",
                "flag": f"ArgumentTypeError: {how}: {flag} must be",
                "names": "UsageError: save: names that would overwrite or shadow each other"}[bad]
    assert expected in (tmp_path / "error_1.txt").read_text(), (tmp_path / "error_1.txt").read_text()
    text = (tmp_path / "error_0.txt").read_text()
    assert "RankFailedError" in text and "rank 1" in text
    assert time.monotonic() - started < 100  # not the 300 s collective timeout
    assert not (tmp_path / "out" / "ckpt_1").exists()


def test_a_refusal_while_the_previous_async_write_runs_keeps_the_ranks_in_step(tmp_path):
    """Rank 1 refuses its second async_save while rank 0's first write is still running: it must
    first wait for its own first write, as rank 0 does, else its collectives overlap that
    write's. Both raise at once; ckpt_1 commits and the next save of every rank lines up."""
    started = time.monotonic()
    codes, outs = run_ranks("async_then_bad_metric", 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300"})
    assert codes == [0, 0], outs
    assert time.monotonic() - started < 100
    assert json.loads((tmp_path / "report_2_0.json").read_text()) == ["RankFailedError", "ckpt_3"]
    assert json.loads((tmp_path / "report_2_1.json").read_text()) == ["UsageError", "ckpt_3"]
    assert (tmp_path / "out" / "checkpoint").read_text().split() == ["ckpt_1", "ckpt_3"]


def test_a_collective_bank_load_waits_for_the_pending_async_write(tmp_path):
    """plan_model_bank(collective=True) and load_model_bank exchange on recsave's group, which the
    background write of an async save uses too: run alongside it, the ranks' collectives paired
    across the two and both failed at the collective timeout (the checkpoint lost). The planning
    waits for the pending write first, as loads do."""
    started = time.monotonic()
    codes, outs = run_ranks("bank_during_async_write", 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "30"})
    assert codes == [0, 0], outs
    assert time.monotonic() - started < 60
    for r in range(2):
        assert json.loads((tmp_path / f"report_2_{r}.json").read_text()) == ["ok", "ok", "ok", "ckpt_2"]


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_managers_metric_refused_on_one_rank_keeps_the_ranks_in_step(tmp_path, mode):
    """CheckpointManager.step checks the metrics before its own exchange: a refusal on one rank
    goes on to the save's exchanges. Every rank learns of it at the same step (at once when saving
    synchronously; from the failed write at the next save in the async mode), and the later steps
    line up (ckpt_6)."""
    started = time.monotonic()
    codes, outs = run_ranks("manager_bad_metric", 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300",
                                                                "ASYNC": "1" if mode == "async" else "0"})
    assert codes == [0, 0], outs
    assert time.monotonic() - started < 100
    for rank, error in ((0, "RankFailedError"), (1, "UsageError")):
        expected = ["none", error, "none", "saved:ckpt_4", "none", "saved:ckpt_6"] if mode == "disabled" else \
            ["none", "saved:ckpt_2", "none", error, "none", "saved:ckpt_6"]
        assert json.loads((tmp_path / f"report_2_{rank}.json").read_text()) == expected


def test_a_preemption_save_drops_metrics_refused_on_one_rank(tmp_path):
    """The preemption save is the job's last: a metric refused on one rank costs the metrics (a
    warning), not the save. Every rank saves ckpt_2 and raises Preempted."""
    codes, outs = run_ranks("preempt_bad_metric", 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300"})
    assert codes == [0, 0], outs
    for rank in (0, 1):
        assert json.loads((tmp_path / f"report_2_{rank}.json").read_text()) == ["Preempted:ckpt_2"]
    assert "the preemption save drops its metrics" in outs[1]
    assert read_index(str(tmp_path / "out" / "ckpt_2")).metrics == {"loss": 0.5}  # rank 0's, as always


@pytest.mark.parametrize("bad", ["out_of_range", "other_rank"])
def test_a_load_shard_id_refused_on_one_rank_fails_every_rank_at_once(tmp_path, bad):
    """A shard_id out of range, or naming another rank of the group (both ranks would load rank
    0's share and none rank 1's): every rank raises at once and the group stays usable."""
    codes, outs = run_ranks("save_two", 2, tmp_path)
    assert codes == [0, 0], outs
    started = time.monotonic()
    codes, outs = run_ranks("load_bad_shard_id", 2, tmp_path, {"RECSAVE_COLLECTIVE_TIMEOUT_S": "300",
                                                               "BAD_SHARD": bad})
    assert codes == [0, 0], outs
    assert time.monotonic() - started < 100
    for r in (0, 1):
        assert json.loads((tmp_path / f"report_2_{r}.json").read_text()) == [
            "UsageError" if r == 1 else "RankFailedError", 1]


def _expected_after(k):
    """The global table state after delta_step 1..k of tests/mr_worker.py: {id: salt offset}."""
    from mr_worker import delta_ids

    state = {i: 0.0 for i in global_ids().tolist()}
    for step in range(1, k + 1):
        changed, deleted = delta_ids(step)
        for i in changed.tolist():
            state[i] = 10.0 * step
        for i in deleted.tolist():
            state.pop(i, None)
    return state


def _check_loaded(tmp_path, world, state):
    for base, name in ((0.0, "user"), (100.0, "item")):
        seen = []
        for r in range(world):
            got = torch.load(tmp_path / f"{name}_{world}_{r}.pt", weights_only=True)
            ids = got["ids"]
            assert torch.equal(partition.owner_of(ids, world), torch.full_like(ids, r))
            salts = torch.tensor([base + state[i] for i in ids.tolist()])
            rows = torch.stack([mr_rows(i, s) for i, s in zip(ids, salts)]) if ids.numel() else got["values"]
            accs = torch.stack([mr_rows(i, s + 0.5) for i, s in zip(ids, salts)]) if ids.numel() else got["acc"]
            assert torch.equal(got["values"], rows) and torch.equal(got["acc"], accs)
            seen += ids.tolist()
        assert sorted(seen) == sorted(state)


def test_manager_restore_takes_a_load_conf_when_the_world_size_changed(tmp_path):
    """Io states saved by 2 workers cannot load on 3 (the Reader cannot reshard them): the
    manager's restore excludes them through its load_conf, as Saver.load does, instead of
    leaving the job no way to restart on 3 ranks."""
    codes, outs = run_ranks("save", 2, tmp_path)
    assert codes == [0, 0], outs
    codes, outs = run_ranks("load", 3, tmp_path, {"MANAGER": "1"})
    assert all(c != 0 for c in codes) and "saved by 2 worker(s) but 3 are loading" in outs[0], outs
    codes, outs = run_ranks("load", 3, tmp_path, {"MANAGER": "1", "NO_IO": "1"})
    assert codes == [0, 0, 0], outs
    _check_loaded(tmp_path, 3, {i: 0.0 for i in global_ids().tolist()})
    reports = [json.loads((tmp_path / f"report_3_{r}.json").read_text()) for r in range(3)]
    assert [(rep["step"], rep["position"]) for rep in reports] == [(1, 0)] * 3  # ckpt_1's step; io states left


def _check_index_read_once(reports, ckpt_dir, chain_length):
    """Rank 0 read every index of the chain, the checkpoint list and the dense files once; the
    others took its bytes and its resolution of the latest checkpoint (load/shared_reads.py),
    reading none of them."""
    want_dir = ckpt_dir.replace("file://", "")
    for r, rep in enumerate(reports):
        assert [c.replace("file://", "") for c in rep["checkpoints"]] == [want_dir], rep
        reads = rep["whole_reads"]
        assert reads.get("index", 0) == (chain_length if r == 0 else 0), (r, reads)
        assert reads.get("model.pt", 0) == reads.get("extra.pt", 0) == (1 if r == 0 else 0), (r, reads)
        if r:
            assert reads.get("checkpoint", 0) == 0, (r, reads)


def mr_rows(i, salt):
    return expected_rows(i.reshape(1), float(salt))[0]


def test_delta_chain_across_world_sizes(tmp_path):
    """A chain saved by 2 ranks restores on 1 and 3; 3 ranks restore it and add a delta (a chain
    whose base was written by 2 ranks and its last delta by 3), which 2 ranks restore."""
    codes, outs = run_ranks("delta_save", 2, tmp_path)
    assert codes == [0, 0], outs
    for r in range(2):
        assert json.loads((tmp_path / f"kinds_2_{r}.json").read_text()) == ["full", "delta", "delta"]
    index = read_index(str(tmp_path / "out" / "ckpt_3"))
    assert (index.kind, index.base, index.parent.id, index.world_size) == ("delta", "ckpt_1", "ckpt_2", 2)
    for world in (1, 3):
        for ckpt_id, k in (("ckpt_2", 1), ("ckpt_3", 2)):
            codes, outs = run_ranks("load", world, tmp_path, {"NO_IO": "1", "CKPT_ID": ckpt_id})
            assert codes == [0] * world, outs
            _check_loaded(tmp_path, world, _expected_after(k))
            reports = [json.loads((tmp_path / f"report_{world}_{r}.json").read_text()) for r in range(world)]
            _check_index_read_once(reports, str(tmp_path / "out" / ckpt_id), chain_length=k + 1)
    codes, outs = run_ranks("delta_continue", 3, tmp_path, {"NO_IO": "1"})
    assert codes == [0, 0, 0], outs
    assert all(json.loads((tmp_path / f"kinds_3_{r}.json").read_text()) == ["delta"] for r in range(3))
    index = read_index(str(tmp_path / "out" / "ckpt_4"))
    assert (index.kind, index.base, index.parent.id, index.world_size) == ("delta", "ckpt_1", "ckpt_3", 3)
    assert read_index(str(tmp_path / "out" / "ckpt_1")).world_size == 2
    for world in (2, 1):
        codes, outs = run_ranks("load", world, tmp_path, {"NO_IO": "1", "CKPT_ID": "ckpt_4"})
        assert codes == [0] * world, outs
        _check_loaded(tmp_path, world, _expected_after(3))


def test_a_load_of_a_missing_checkpoint_raises_on_every_rank_without_waiting(tmp_path):
    """Rank 0 fails to open the checkpoint: it still sends the broadcast the others wait for, and
    every rank raises the same error at once instead of timing out."""
    codes, outs = run_ranks("save", 2, tmp_path)
    assert codes == [0, 0], outs
    start = time.monotonic()
    codes, outs = run_ranks("load", 2, tmp_path, {"CKPT_ID": "ckpt_9", "RECSAVE_COLLECTIVE_TIMEOUT_S": "60"})
    assert time.monotonic() - start < 50, outs
    assert codes[0] != 0 and codes[1] != 0, outs
    for out in outs:
        assert "CheckpointNotFoundError" in out and "ckpt_9" in out, out


def test_delta_of_a_table_cleared_on_one_rank(tmp_path):
    """A table cleared on one rank only: every rank writes its rows whole and marks the table
    cleared, so the merge (drop all, then upsert) gives back exactly what the ranks held."""
    codes, outs = run_ranks("delta_cleared", 2, tmp_path)
    assert codes == [0, 0], outs
    assert all(json.loads((tmp_path / f"kinds_2_{r}.json").read_text()) == ["delta"] for r in range(2))
    index = read_index(str(tmp_path / "out" / "ckpt_2"))
    assert index.meta.tables["user"].cleared and not index.meta.tables["item"].cleared
    codes, outs = run_ranks("load", 1, tmp_path, {"NO_IO": "1", "CKPT_ID": "ckpt_2"})
    assert codes == [0], outs
    ids = global_ids()
    kept = ids[partition.owner_of(ids, 2) == 0][:50]
    user = torch.load(tmp_path / "user_1_0.pt", weights_only=True)
    want = {i: 5.0 for i in kept.tolist()}
    want.update({i: 0.0 for i in ids[partition.owner_of(ids, 2) == 1].tolist()})
    assert sorted(user["ids"].tolist()) == sorted(want)
    for i, row, acc in zip(user["ids"], user["values"], user["acc"]):
        assert torch.equal(row, mr_rows(i, want[int(i)])) and torch.equal(acc, mr_rows(i, want[int(i)] + 0.5))
    item = torch.load(tmp_path / "item_1_0.pt", weights_only=True)
    assert sorted(item["ids"].tolist()) == sorted(ids.tolist())


def test_a_rewound_restore_saved_at_once_is_relisted_by_every_rank(tmp_path):
    """restore(global_step=2) past ckpt_4, then save() at step 2 on both ranks with rank 1 late:
    ckpt_2 holds the state, rank 0 lists it last (Saver.make_latest, a collective), and rank 1,
    which then finds ckpt_2 already listed last, still joins instead of leaving rank 0 waiting."""
    codes, outs = run_ranks("rewind_save", 2, tmp_path)
    assert codes == [0, 0], outs
    paths = [json.loads((tmp_path / f"rewind_{r}.json").read_text())["path"] for r in range(2)]
    assert all(p.endswith("ckpt_2") for p in paths)
    assert (tmp_path / "out" / "checkpoint").read_text().split() == ["ckpt_4", "ckpt_2"]



def test_ranks_with_different_table_steps_record_the_largest_and_warn(tmp_path):
    """A sparse optimizer steps a table only on ranks that looked it up: rank 1's `user` at step 6,
    rank 0's at 3. The index recorded rank 0's step, silently, and rank 1 restored rows whose
    last_step lay past their table's step. The largest is recorded (every rank restores it) and
    rank 0, which commits, warns naming the table and each rank's step."""
    codes, outs = run_ranks("save_steps_differ", 2, tmp_path)
    assert codes == [0, 0], outs
    tables = read_index(str(tmp_path / "out" / "ckpt_1")).meta.tables
    assert (tables["user"].step, tables["item"].step) == (6, 4)
    warned = json.loads((tmp_path / "warnings_0.json").read_text())
    assert warned == [
        "ckpt_1: the ranks hold different table steps ('user': rank 0 at 3, rank 1 at 6); the checkpoint "
        "records the largest, which every rank restores, and the sparse optimizer's step counts of rank 0. "
        "A sparse optimizer steps a table only on the ranks that looked it up: look every table up on every "
        "rank each batch (an empty lookup counts) to keep them equal"]
    assert json.loads((tmp_path / "warnings_1.json").read_text()) == []
    for r in range(2):
        assert json.loads((tmp_path / f"steps_{r}.json").read_text()) == [6, 4]


@pytest.mark.parametrize("b_does", ["async_save", "save", "load"])
def test_two_savers_of_one_process_group_commit_their_own_state(tmp_path, b_does):
    """Saver A's background write runs its collectives while Saver B saves or loads: each
    checkpoint holds its own model's rows, bit-exact, whatever order the ranks reach the
    collectives in (B's model holds A's ckpt_0 once B loaded it)."""
    codes, outs = run_ranks("two_savers", 2, tmp_path, {"TWO_SAVERS_B": b_does})
    assert codes == [0, 0], outs
    ids = global_ids()
    for out, offset in (("out", 0.0), ("out_b", 0.0 if b_does == "load" else 50.0)):
        model, saver, _ = build(tmp_path)
        saver.load(str(tmp_path / out / "ckpt_1"), load_conf={"exclude": ["io_state"]})
        for salt, table in ((offset, model.user), (offset + 100.0, model.item)):
            got_ids, values, slots = table.export()
            assert sorted(got_ids.tolist()) == sorted(ids.tolist())
            assert torch.equal(values, expected_rows(got_ids, salt))
            assert torch.equal(slots["adagrad_acc"], expected_rows(got_ids, salt + 0.5))
