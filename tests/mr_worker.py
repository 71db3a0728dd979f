"""One rank of a multi-rank test job (spawned by tests/test_multirank.py as a plain process).

    python tests/mr_worker.py SCENARIO RANK WORLD INIT_FILE WORK_DIR

Scenarios: ``save`` (build this rank's shard of a known table set and save it), ``load`` (load the
latest checkpoint with WORLD ranks and dump what this rank holds), ``save_killed`` / ``save_error``
(rank 1 SIGKILLs itself / rank 2 raises in the middle of a second save; the others must raise),
``load_damaged`` (load into a model holding other rows; dump what each rank holds after); ``load``
also reports the whole-file reads (indexes, the checkpoint list) this rank made.
``delta_save`` (a full then two deltas, incremental=True), ``delta_continue`` (restore the latest
with WORLD ranks, change rows, save the delta ckpt_4); CKPT_ID makes ``load`` load that id.
``save_taken_over`` (a second writer takes the lock while rank 1 writes ckpt_2: rank 1 must stop),
``save_rank0_killed`` / ``save_rank0_killed_taken_over`` (rank 0 SIGKILLs itself once rank 1
wrote its files of ckpt_2, the second after a second job's writer took the lock over),
``save_as_one_process`` (every rank saves ckpt_2 with shard_num=1: refused on every rank; its
tables are partitioned, or with UNPARTITIONED=1 only their ids tell), ``save_replicated_alone``
(every rank holds every id, rank 0 alone saves with shard_num=1; then every rank loads it alone
with shard_num=1, rank 1 before rank 0, and with the group), ``async_then_bad_metric``
(rank 1 refuses its second async_save while rank 0's first write still runs),
``bank_during_async_write`` (a collective plan_model_bank, then load_model_bank, while every rank's
async write of ckpt_2 runs, rank 0's held up before its first exchange),
``manager_bad_metric`` (rank 1 passes a NaN metric to CheckpointManager.step on a saving step),
``manager_async_snapshot_fails`` (an async manager whose autosave's snapshot fails on rank 1, then
save() twice), ``manager_save_after_saver_load`` (an autosave, a load through the Saver by every rank or, with
LOAD=alone, by rank 0 alone with shard_num=1, then CheckpointManager.save twice),
``preempt_bad_metric`` (the same on the step where rank 0's preemption signal makes every rank save),
``save_bad_metric_on_one_rank`` (BAD=metric / flag / names: rank 1's metric, flag or model refused),
``load_bad_shard_id`` (BAD_SHARD out_of_range / other_rank, rank 1
only), ``save_foreign`` (rank 1's second save holds ids of rank 0: UsageError; every rank writes the listing
of its output dir before that save to listing_RANK.json), ``save_as_rank1`` (every rank passes
shard_id=1), ``save_steps_differ`` (the ranks' table steps of `user` differ; rank r writes the
RuntimeWarnings of its save to warnings_RANK.json and the steps restored to steps_RANK.json),
``save_rotating`` (ckpt_1 .. ckpt_4, then close(); rank r writes the listing of its output dir,
whether it removed its own copies of pruned checkpoints and its RuntimeWarnings to report_RANK.json),
``tt_save`` / ``tt_load`` (the same with a TableLike table, tests/tablelike_table.py,
instead of the HashTables), ``torch_bank`` (bank-load a torch.save file and a DCP directory of
plain tensors written by the test; dump what this rank holds, and what to_dcp_state_dict says
of the sharded model with and without replicated=True). OUT_SCHEME=file makes the output dir a
file:// URL (the fsspec path), OUT_URL any URL (an S3 bucket); PER_RANK_OUT=1 gives each rank its
own output dir out_RANK (per-rank local disks).
"""
import contextlib
import datetime
import json
import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist
from gloo_exit import exit_now

import recsave
from recsave import HashTable, Saver, partition
from recsave.tables.optim import SparseAdagrad

GLOBAL_IDS = 3000
DIM = 6



def attempt_then_load(attempt, saver, reader, work_dir, world, rank):
    """Runs `attempt` (a load that may fail on one rank), then a plain load of ckpt_1, which shows
    the group is still usable (the ranks' next collectives line up); writes [the attempt's outcome
    ("loaded" or its error class), the reader position ckpt_1 restored] as the rank's report."""
    outcome = []
    try:
        attempt()
        outcome.append("loaded")
    except recsave.RecsaveError as exc:
        outcome.append(type(exc).__name__)
    saver.load(ckpt_id="ckpt_1")
    outcome.append(reader.position)
    with open(os.path.join(work_dir, f"report_{world}_{rank}.json"), "w") as f:
        json.dump(outcome, f)


@contextlib.contextmanager
def list_reads_failing(failing):
    """Within: (where `failing`) every read of a `checkpoint` list raises StorageError, as an
    unreadable file on this rank's storage would."""
    from recsave.format import ckptlist
    real = ckptlist.committed

    def unreadable(storage, path, **kwargs):
        raise recsave.StorageError(f"{path}/checkpoint: reading failed: Input/output error (injected)")

    if failing:
        ckptlist.committed = unreadable
    try:
        yield
    finally:
        ckptlist.committed = real


class NonTensorExtraState(torch.nn.Module):
    """A module whose extra state a Saver refuses (not tensors): the model of one rank is refused."""

    def get_extra_state(self):
        return {"not": "a tensor"}

    def set_extra_state(self, state):
        pass

def global_ids() -> torch.Tensor:
    ids = torch.arange(GLOBAL_IDS, dtype=torch.int64) * 1_000_003 - 777
    return torch.cat([ids, torch.tensor([0, -1, 2**63 - 1, -2**63], dtype=torch.int64)])


def expected_rows(ids: torch.Tensor, salt: float) -> torch.Tensor:
    """Embedding / slot values as a function of the id, so any rank can check any row."""
    base = (ids % 100_003).to(torch.float32).unsqueeze(1)
    return base * 0.001 + torch.arange(DIM, dtype=torch.float32) + salt


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.user = HashTable(DIM, name="user", seed=1)
        self.item = HashTable(DIM, name="item", seed=2)
        self.dense = torch.nn.Linear(DIM, 2)


class Reader:
    def __init__(self, position=0):
        self.position = position

    def dump_io_state(self):
        return {"position": self.position}

    def load_io_state(self, state):
        self.position = state["position"]


def build(work_dir):
    torch.manual_seed(0)
    model = Model()
    opt = SparseAdagrad(model, lr=0.1)
    out = os.path.join(work_dir, "out")
    if os.environ.get("PER_RANK_OUT"):
        out = os.path.join(work_dir, f"out_{dist.get_rank()}")
    if os.environ.get("OUT_SCHEME") == "file":  # the fsspec path, shared by the ranks
        out = "file://" + out
    out = os.environ.get("OUT_URL", out)  # e.g. a bucket on the test's S3 server
    saver = Saver(model, sparse_optim=opt, output_dir=out, max_keep=int(os.environ.get("MAX_KEEP", "2")))
    reader = Reader()
    saver.register_io_state("reader", reader)
    return model, saver, reader


def fill(model, rank, world, offset=0.0):
    ids = global_ids()
    mine = ids[partition.owner_of(ids, world) == rank]
    for salt, table in ((offset, model.user), (offset + 100.0, model.item)):
        table.set_partition(rank, world)
        table.load_rows(mine, expected_rows(mine, salt), {"adagrad_acc": expected_rows(mine, salt + 0.5)})


def delta_step(model, rank, world, k):
    """Change k of the delta scenarios: ids of a window get new rows, ids of another are deleted
    (each rank does its owned share); tests/test_multirank.py replays the same on the global table."""
    changed, deleted = delta_ids(k)
    for salt, table in ((0.0, model.user), (100.0, model.item)):
        mine = changed[partition.owner_of(changed, world) == rank]
        table.load_rows(mine, expected_rows(mine, salt + 10.0 * k),
                        {"adagrad_acc": expected_rows(mine, salt + 10.0 * k + 0.5)}, clear=False)
        table.delete(deleted[partition.owner_of(deleted, world) == rank])


def delta_ids(k):
    ids = global_ids()
    start = (k * 401) % 2000
    return ids[start:start + 40], ids[2200 + 15 * k:2200 + 15 * k + 15]


def count_whole_file_reads():
    """Counts Storage.read_bytes calls (whole small files: indexes, the checkpoint list) by file name."""
    import collections

    from recsave.storage import LocalStorage
    from recsave.storage.base import Storage

    counts = collections.Counter()
    for cls in (LocalStorage, Storage):
        def counted(self, path, limit, _real=cls.read_bytes):
            counts[path.rstrip("/").rsplit("/", 1)[-1]] += 1
            return _real(self, path, limit)
        cls.read_bytes = counted
    return counts


def listing(root):
    """Every path under root, directories marked with a trailing slash."""
    out = []
    for base, dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(base, d), root) + "/" for d in dirs]
        out += [os.path.relpath(os.path.join(base, f), root) for f in files]
    return sorted(out)


def tablelike(scenario, rank, world, work_dir):
    """A model whose table is a TableLike test table: saved by `world` ranks, or loaded by them."""
    from tablelike_table import TensorTable

    model = torch.nn.Module()
    model.tt = TensorTable(DIM, name="tt")
    model.dense = torch.nn.Linear(DIM, 2)
    saver = Saver(model, output_dir=os.path.join(work_dir, "tt_out"))
    if scenario == "tt_save":
        ids = global_ids()
        mine = ids[partition.owner_of(ids, world) == rank]
        model.tt.set_partition(rank, world)
        model.tt.load_rows(mine, expected_rows(mine, 0.0), {"acc": expected_rows(mine, 0.5)})
        saver.save("ckpt_1")
    else:
        report = saver.load()
        torch.save({"ids": model.tt.ids, "values": model.tt.weight, "acc": model.tt.slot_acc,
                    "partition": list(model.tt.partition or ()), "rows_read": report.rows_read},
                   os.path.join(work_dir, f"tt_{world}_{rank}.pt"))


def take_over_the_lock(work_dir):
    """Replaces the writer lock of out/ as a second job's writer taking it over would."""
    lock = os.path.join(work_dir, "out", ".recsave-writer.lock")
    with open(lock + ".new", "w") as f:
        json.dump({"host": "second-job", "pid": 4242, "token": "theirs", "acquired_at": time.time(),
                   "renewed_at": time.time()}, f)
    os.replace(lock + ".new", lock)


def save_or_exit(saver, ckpt_id, rank, work_dir, **kwargs):
    """saver.save, or on a RecsaveError: its text in error_<rank>.txt and exit code 3."""
    try:
        saver.save(ckpt_id, **kwargs)
    except recsave.RecsaveError as exc:
        with open(os.path.join(work_dir, f"error_{rank}.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        os._exit(3)


def main():
    scenario, init_file, work_dir = sys.argv[1], sys.argv[4], sys.argv[5]
    rank, world = int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    if scenario in ("tt_save", "tt_load"):
        tablelike(scenario, rank, world, work_dir)
        dist.destroy_process_group()
        return
    if scenario == "torch_bank":
        for kind in ("torch", "dcp"):
            model, saver, _ = build(work_dir)
            path = os.path.join(work_dir, "state.pt" if kind == "torch" else "state_dcp")
            saver.load_model_bank([{"path": path, "load": ["user", "dense.*"]}])
            ids, values, _ = model.user.export()
            torch.save({"ids": ids, "values": values, "dense": model.dense.weight.detach()},
                       os.path.join(work_dir, f"bank_{kind}_{world}_{rank}.pt"))
        # DCP would keep one rank's copy of a sharded table's plain tensors: refused, unless replicated.
        try:
            recsave.to_dcp_state_dict(model)
            refusal = "none"
        except recsave.UsageError as exc:
            refusal = str(exc)
        replicated = sorted(recsave.to_dcp_state_dict(model, replicated=True))
        with open(os.path.join(work_dir, f"to_dcp_{world}_{rank}.json"), "w") as f:
            json.dump([refusal, replicated], f)
        dist.destroy_process_group()
        return
    model, saver, reader = build(work_dir)
    if scenario in ("save", "save_killed", "save_error"):
        fill(model, rank, world)
        reader.position = 1000 + rank
        saver.save("ckpt_1")
        if scenario != "save":
            def die(*args, **kwargs):
                if rank == 1 and scenario == "save_killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                if rank == 2 and scenario == "save_error":
                    raise OSError(28, "No space left on device (injected)")
                return real(*args, **kwargs)
            real = recsave.save.pipeline.write_shards
            recsave.save.pipeline.write_shards = die
            try:
                saver.save("ckpt_2")
            except (recsave.RecsaveError, OSError) as exc:
                with open(os.path.join(work_dir, f"error_{rank}.txt"), "w") as f:
                    f.write(f"{type(exc).__name__}: {exc}")
                # Skip interpreter teardown: with a peer gone, gloo's background threads can abort the
                # process while static destructors run, which would hide the exit code under test.
                os._exit(3)
    elif scenario == "save_foreign":
        fill(model, rank, world)
        saver.save("ckpt_1")
        out_dir = saver.output_dir.replace("file://", "")
        with open(os.path.join(work_dir, f"listing_{rank}.json"), "w") as f:
            json.dump(listing(out_dir), f)
        if rank == 1:  # ids of rank 0 in the second table written ("user" sorts after "item")
            ids = global_ids()
            theirs = ids[partition.owner_of(ids, world) == 0][:10]
            model.user.set_partition(0, 1)  # an unsharded table takes any id; the save shards it again
            model.user.load_rows(theirs, expected_rows(theirs, 3.0), clear=False)
        save_or_exit(saver, "ckpt_2", rank, work_dir)
    elif scenario == "save_uneven":  # rank 1 alone has a slot: its rows would be written, never loaded
        fill(model, rank, world)
        saver.save("ckpt_1")
        if rank == 1:
            model.user.add_slot("only_here", 0.5)
        save_or_exit(saver, "ckpt_2", rank, work_dir)
    elif scenario == "save_uneven_rank0":  # rank 0 alone has a slot: committed, it would be short of rows
        fill(model, rank, world)
        saver.save("ckpt_1")
        if rank == 0:
            model.user.add_slot("only_rank0", 0.5)
        save_or_exit(saver, "ckpt_2", rank, work_dir)
    elif scenario == "save_other_ids":  # the ranks' global steps differ: each names another checkpoint
        fill(model, rank, world)
        saver.save("ckpt_1")
        save_or_exit(saver, f"ckpt_{2 + rank}", rank, work_dir)
    elif scenario == "save_taken_over":  # another writer takes rank 0's lock while rank 1 writes ckpt_2
        fill(model, rank, world)
        saver.save("ckpt_1")
        saver.close()  # the next save takes the lock again, its renewals on the short lease below
        if rank == 0:  # no renewal from rank 0's thread can race the takeover below
            recsave.storage.lock.WriterLock.beat = lambda self, stop, interval: True
        if rank == 1:
            real_write_table = recsave.save.pipeline.CheckpointWriter._write_table

            def write_then_lose_the_lock(writer, *args, **kwargs):
                part = real_write_table(writer, *args, **kwargs)
                take_over_the_lock(work_dir)
                time.sleep(1.1)  # past half of the 2 s lease: the next table's check reads the lock
                return part
            recsave.save.pipeline.CheckpointWriter._write_table = write_then_lose_the_lock
        # fsync off: each file is in place once written (durable ones are renamed together at the end)
        with recsave.knobs.override(writer_lease_s=2.0, fsync=False):
            save_or_exit(saver, "ckpt_2", rank, work_dir)
    elif scenario in ("save_rank0_killed", "save_rank0_killed_taken_over"):  # once rank 1 wrote ckpt_2
        fill(model, rank, world)
        saver.save("ckpt_1")
        if rank == 0:
            def die_once_rank1_wrote(*args, **kwargs):
                done = os.path.join(work_dir, "out", "ckpt_2", "io_state_1.pt")
                deadline = time.monotonic() + 60
                while not os.path.exists(done) and time.monotonic() < deadline:
                    time.sleep(0.01)
                if scenario == "save_rank0_killed_taken_over":
                    take_over_the_lock(work_dir)
                os.kill(os.getpid(), signal.SIGKILL)
            recsave.save.pipeline.write_shards = die_once_rank1_wrote
        save_or_exit(saver, "ckpt_2", rank, work_dir)
    elif scenario == "save_as_rank1":  # every rank claims to be rank 1: rank 0 must refuse
        fill(model, rank, world)
        save_or_exit(saver, "ckpt_1", rank, work_dir, shard_id=1, shard_num=world)
    elif scenario == "save_as_one_process":  # every rank passes shard_num=1 after a full ckpt_1
        fill(model, rank, world)
        saver.save("ckpt_1")
        if os.environ.get("UNPARTITIONED") == "1":  # the ids alone tell the share
            for table in (model.user, model.item):
                table.set_partition(0, 1)
        save_or_exit(saver, "ckpt_2", rank, work_dir, shard_id=0, shard_num=1)
    elif scenario == "async_then_bad_metric":  # ckpt_1's write still running on rank 0 when rank 1 refuses
        from recsave.save import pipeline
        slow_prepare = pipeline.CheckpointWriter._prepare_dir

        def prepare(self, ckpt_dir, ckpt_id):
            if ckpt_id == "ckpt_1" and rank == 0:
                time.sleep(2)
            return slow_prepare(self, ckpt_dir, ckpt_id)
        pipeline.CheckpointWriter._prepare_dir = prepare
        fill(model, rank, world)
        saver.async_save("ckpt_1")
        outcome = []
        try:
            saver.async_save("ckpt_2", metrics={"loss": float("nan") if rank == 1 else 0.5})
            saver.wait()  # collects the write's outcome (raises its error)
            outcome.append("saved")
        except recsave.RecsaveError as exc:
            outcome.append(type(exc).__name__)
        saver.save("ckpt_3")  # the group still lines up
        outcome.append(saver.checkpoints()[-1].rsplit("/", 1)[-1])
        with open(os.path.join(work_dir, f"report_{world}_{rank}.json"), "w") as f:
            json.dump(outcome, f)
    elif scenario == "bank_during_async_write":  # a collective bank load while ckpt_2's write runs
        from recsave.save import pipeline
        slow_prepare = pipeline.CheckpointWriter._prepare_dir

        def prepare(self, ckpt_dir, ckpt_id):
            if ckpt_id == "ckpt_2" and rank == 0:  # rank 1's write is in its first exchange by then
                time.sleep(2)
            return slow_prepare(self, ckpt_dir, ckpt_id)
        pipeline.CheckpointWriter._prepare_dir = prepare
        fill(model, rank, world)
        saver.save("ckpt_1")
        saver.async_save("ckpt_2")
        outcome = []
        for attempt in (lambda: saver.plan_model_bank([{"path": os.path.join(saver.output_dir, "ckpt_1")}],
                                                      collective=True),
                        lambda: saver.load_model_bank([{"path": os.path.join(saver.output_dir, "ckpt_1"),
                                                        "load": ["dense"]}]),
                        saver.wait):
            try:
                attempt()
                outcome.append("ok")
            except recsave.RecsaveError as exc:
                outcome.append(type(exc).__name__)
        outcome.append(saver.checkpoints()[-1].rsplit("/", 1)[-1])
        with open(os.path.join(work_dir, f"report_{world}_{rank}.json"), "w") as f:
            json.dump(outcome, f)
    elif scenario == "manager_bad_metric":  # rank 1 alone passes a NaN metric on saving step 2 (ASYNC=1: async mode)
        mgr = recsave.CheckpointManager(saver, 2, async_mode="async" if os.environ.get("ASYNC") == "1" else "disabled")
        fill(model, rank, world)
        outcome = []
        for step in range(1, 7):  # every rank catches what it gets and goes on training
            try:
                path = mgr.step(metrics={"loss": float("nan") if rank == 1 else 0.5} if step == 2 else None)
                outcome.append("none" if path is None else "saved:" + path.rsplit("/", 1)[-1])
            except recsave.RecsaveError as exc:
                outcome.append(type(exc).__name__)
        mgr.close()
        with open(os.path.join(work_dir, f"report_{world}_{rank}.json"), "w") as f:
            json.dump(outcome, f)
    elif scenario == "manager_save_after_saver_load":  # autosave, then a Saver load (LOAD=alone: rank 0 only; none)
        mgr = recsave.CheckpointManager(saver, 2, save_on_preemption=False)
        fill(model, rank, world)
        mgr.step()
        mgr.step()  # autosave ckpt_2
        if os.environ.get("LOAD") == "group" or (rank == 0 and os.environ.get("LOAD") != "none"):
            kwargs = {"shard_num": 1} if os.environ.get("LOAD") == "alone" else {}
            saver.load(load_conf={"load": ["dense"]}, **kwargs)
        outcome = []
        for _ in range(2):  # the second save must not take the first's refusal for a save
            try:
                outcome.append("saved:" + mgr.save().rsplit("/", 1)[-1])
            except recsave.RecsaveError as exc:
                outcome.append(type(exc).__name__)
        mgr.close()
        with open(os.path.join(work_dir, f"report_{world}_{rank}.json"), "w") as f:
            json.dump(outcome, f)
    elif scenario == "manager_async_snapshot_fails":  # rank 1's io state refused at step 2's async autosave
        mgr = recsave.CheckpointManager(saver, 2, async_mode="async", save_on_preemption=False)
        fill(model, rank, world)
        mgr.step()
        good = reader.dump_io_state
        if rank == 1:
            reader.dump_io_state = lambda: {"position": datetime.datetime(2026, 1, 1)}  # not weights_only-safe
        outcome = []
        for call in (mgr.step, mgr.save, mgr.save):  # rank 1's state is fixed after the autosave
            try:
                path = call()
                outcome.append("none" if path is None else "saved:" + path.rsplit("/", 1)[-1])
            except recsave.RecsaveError as exc:
                outcome.append(type(exc).__name__)
            reader.dump_io_state = good
        mgr.close()
        with open(os.path.join(work_dir, f"report_{world}_{rank}.json"), "w") as f:
            json.dump(outcome, f)
    elif scenario == "preempt_bad_metric":  # rank 0 preempted, rank 1 passes a NaN metric on that step
        mgr = recsave.CheckpointManager(saver, 100)
        fill(model, rank, world)
        mgr.step()
        if rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        outcome = []
        try:
            mgr.step(metrics={"loss": float("nan") if rank == 1 else 0.5})
            outcome.append("none")
        except recsave.Preempted as exc:
            outcome.append("Preempted:" + exc.path.rsplit("/", 1)[-1])
        except recsave.RecsaveError as exc:
            outcome.append(type(exc).__name__)
        mgr.close()
        with open(os.path.join(work_dir, f"report_{world}_{rank}.json"), "w") as f:
            json.dump(outcome, f)
    elif scenario == "save_replicated_alone":  # every rank holds every id; rank 0 alone saves
        ids = global_ids()
        for salt, table in ((0.0, model.user), (100.0, model.item)):
            table.load_rows(ids, expected_rows(ids, salt), {"adagrad_acc": expected_rows(ids, salt + 0.5)})
        if rank == 0:
            saver.save("ckpt_1", shard_id=0, shard_num=1)
        dist.barrier()
        saver.close()
        # Every rank loads it back: alone (shard_num=1, whole tables, no collective; rank 1 first,
        # so a collective would hang) and with the group (its share of every table).
        if rank == 1:
            dist.barrier()
        rows = {}
        for how, kwargs in (("alone", {"shard_num": 1}), ("bank_alone", {"shard_num": 1}), ("group", {})):
            fresh = Model()
            reader = Saver(fresh, output_dir=saver.output_dir)
            if how == "bank_alone":
                reader.load_model_bank([{"path": saver.output_dir, "load": ["user"]}], **kwargs)
            else:
                reader.load(**kwargs)
            if how == "bank_alone" and rank == 0:
                dist.barrier()
            ids = fresh.user.export()[0]
            values = fresh.user.export(ids)[1]
            rows[how] = [len(fresh.user), len(fresh.item),
                         bool(torch.equal(values, expected_rows(ids, 0.0))), sorted(ids.tolist())]
            if how == "group":  # the group load made each table this rank's shard; alone again: whole
                reader.load(shard_num=1)
                ids = fresh.user.export()[0]
                rows["group_then_alone"] = [len(fresh.user), len(fresh.item), fresh.user.partition,
                                            bool(torch.equal(fresh.user.export(ids)[1], expected_rows(ids, 0.0)))]
            reader.close()
        with open(os.path.join(work_dir, f"loaded_{rank}.json"), "w") as f:
            json.dump(rows, f)
    elif scenario == "save_bad_metric_on_one_rank":  # rank 1 alone passes a NaN metric (ASYNC=1: async_save)
        fill(model, rank, world)
        metrics = {"loss": float("nan") if rank == 1 else 0.5}
        if os.environ.get("BAD") == "flag":  # a wrong type of a flag instead (checked before the rank's arguments)
            metrics, flag = {"loss": 0.5}, ("yes" if rank == 1 else False)
        else:
            flag = False
        if os.environ.get("BAD") == "names":  # rank 1's model alone refused (a table named like an extra)
            metrics = {"loss": 0.5}
            saver.register_for_checkpointing("extra_tab", torch.nn.Linear(1, 1))
            if rank == 1:
                model.extra_tab = HashTable(DIM, name="extra_tab")
        if os.environ.get("ASYNC") == "1":
            try:
                saver.async_save("ckpt_1", metrics=metrics, pinned=flag)[1].result(timeout=120)
            except recsave.RecsaveError as exc:
                with open(os.path.join(work_dir, f"error_{rank}.txt"), "w") as f:
                    f.write(f"{type(exc).__name__}: {exc}")
                os._exit(3)
        else:
            save_or_exit(saver, "ckpt_1", rank, work_dir, metrics=metrics, incremental=flag)
    elif scenario == "load_bad_shard_id":  # after save_two: rank 1 alone passes a bad shard_id, then a plain load
        shard = {"out_of_range": 5, "other_rank": 0}[os.environ["BAD_SHARD"]]
        attempt_then_load(lambda: saver.load(shard_id=shard if rank == 1 else None), saver, reader, work_dir,
                          world, rank)
    elif scenario == "async_save":
        fill(model, rank, world)
        reader.position = 1000 + rank
        _, write = saver.async_save("ckpt_1")
        # Training goes on while the write runs: the tables change and the default group is busy
        # with the job's own collectives; neither may reach the checkpoint or disturb its writes.
        ids = global_ids()
        mine = ids[partition.owner_of(ids, world) == rank]
        for _ in range(3):
            model.user.load_rows(mine, expected_rows(mine, 7.0), clear=False)
            dist.all_reduce(torch.ones(1000))
        reader.position = -1
        write.result(timeout=60)
        saver.close()
    elif scenario == "async_save_changed":  # knob stage_changed_rows: the second save copies a few rows
        fill(model, rank, world)
        reader.position = 1000 + rank
        ids = global_ids()
        some = ids[partition.owner_of(ids, world) == rank][::7]
        with recsave.knobs.override(stage_changed_rows=True):
            model.user.load_rows(some, expected_rows(some, 7.0), {"adagrad_acc": expected_rows(some, 7.5)},
                                 clear=False)
            _, write = saver.async_save("ckpt_0")  # its host copy holds the wrong rows
            write.result(timeout=60)
            model.user.load_rows(some, expected_rows(some, 0.0), {"adagrad_acc": expected_rows(some, 0.5)},
                                 clear=False)
            _, write = saver.async_save("ckpt_1")
            write.result(timeout=60)
        with open(os.path.join(work_dir, f"staged_{world}_{rank}.json"), "w") as f:
            json.dump([saver.last_save.staged_rows, int(some.numel())], f)
        saver.close()
    elif scenario == "delta_save":  # a full, then two deltas
        fill(model, rank, world)
        kinds = []
        for k in range(3):
            if k:
                delta_step(model, rank, world, k)
            saver.save(f"ckpt_{k + 1}", incremental=True)
            kinds.append(saver.last_save_kind)
        with open(os.path.join(work_dir, f"kinds_{world}_{rank}.json"), "w") as f:
            json.dump(kinds, f)
    elif scenario == "delta_cleared":  # rank 0 clears `user` and refills a few rows; rank 1 does not
        fill(model, rank, world)
        saver.save("ckpt_1", incremental=True)
        if rank == 0:
            ids = global_ids()
            mine = ids[partition.owner_of(ids, world) == 0][:50]
            model.user.clear()
            model.user.load_rows(mine, expected_rows(mine, 5.0), {"adagrad_acc": expected_rows(mine, 5.5)})
        saver.save("ckpt_2", incremental=True)
        with open(os.path.join(work_dir, f"kinds_{world}_{rank}.json"), "w") as f:
            json.dump([saver.last_save_kind], f)
    elif scenario == "rewind_save":  # restore an older step, then save it at once: rank 1 arrives late
        fill(model, rank, world)
        mgr = recsave.CheckpointManager(saver, 0, save_on_preemption=False)
        for step in (2, 4):
            mgr.global_step = step
            mgr.save()
        assert mgr.restore(global_step=2) == 2
        if rank == 1:
            time.sleep(1.5)  # rank 0 has listed ckpt_2 last by then: rank 1 must still join
        with open(os.path.join(work_dir, f"rewind_{rank}.json"), "w") as f:
            json.dump({"path": mgr.save()}, f)
        mgr.close()
    elif scenario == "delta_continue":  # restore the latest with this world size, change, save a delta
        saver.load(load_conf={"exclude": ["io_state"]} if os.environ.get("NO_IO") else None)
        delta_step(model, rank, world, 3)
        saver.save("ckpt_4", incremental=True)
        with open(os.path.join(work_dir, f"kinds_{world}_{rank}.json"), "w") as f:
            json.dump([saver.last_save_kind], f)
    elif scenario in ("save_bad_io_state", "async_bad_io_state"):  # rank 1's snapshot refuses its io state
        fill(model, rank, world)
        saver.save("ckpt_1")
        if rank == 1:
            reader.dump_io_state = lambda: {"position": datetime.datetime(2026, 1, 1)}  # not weights_only-safe
        try:
            if scenario == "save_bad_io_state":
                saver.save("ckpt_2")
            else:
                saver.async_save("ckpt_2")
                saver.wait()
        except recsave.RecsaveError as exc:
            with open(os.path.join(work_dir, f"error_{rank}.txt"), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
            os._exit(3)
    elif scenario == "save_steps_differ":  # rank r's `user` at table step 3 + 3r, `item` at 4 on each
        fill(model, rank, world)
        model.user.step, model.item.step = 3 + 3 * rank, 4
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            saver.save("ckpt_1")
        with open(os.path.join(work_dir, f"warnings_{rank}.json"), "w") as f:
            json.dump([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], f)
        fresh, again, _ = build(work_dir)
        again.load()
        with open(os.path.join(work_dir, f"steps_{rank}.json"), "w") as f:
            json.dump([fresh.user.step, fresh.item.step], f)
    elif scenario == "save_rotating":  # ckpt_1 .. ckpt_4 (MAX_KEEP=1 in the test: rotation prunes three)
        from recsave.format import ckptlist
        removals = []  # the times this rank removed its own copies of pruned checkpoints
        real_remove = getattr(ckptlist, "remove_rank_copies", None)  # (a recsave without it prunes rank 0's dir alone)

        def counted(*args, **kwargs):
            removals.append(args[2])
            return real_remove(*args, **kwargs)
        if real_remove is not None:
            ckptlist.remove_rank_copies = counted
        fill(model, rank, world)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(1, 5):
                reader.position = k
                saver.save(f"ckpt_{k}")
            saver.close()
        with open(os.path.join(work_dir, f"report_{rank}.json"), "w") as f:
            json.dump({"listing": listing(saver.output_dir), "removals": len(removals),
                       "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}, f)
    elif scenario == "save_two":  # ckpt_1 with rows of offset 0, ckpt_2 of offset 20
        fill(model, rank, world)
        reader.position = 1
        saver.save("ckpt_1")
        fill(model, rank, world, offset=20.0)
        reader.position = 2
        saver.save("ckpt_2")
    elif scenario == "load_fallback":  # the latest is damaged in one rank's share
        fill(model, rank, world, offset=50.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                report = saver.load(fallback=True)
            except recsave.RecsaveError as exc:
                with open(os.path.join(work_dir, f"error_{rank}.txt"), "w") as f:
                    f.write(f"{type(exc).__name__}: {exc}")
                os._exit(3)
        for name in ("user", "item"):
            ids, values, slots = getattr(model, name).export()
            torch.save({"ids": ids, "values": values, "acc": slots["adagrad_acc"]},
                       os.path.join(work_dir, f"{name}_{world}_{rank}.pt"))
        with open(os.path.join(work_dir, f"report_{world}_{rank}.json"), "w") as f:
            json.dump({"position": reader.position, "checkpoints": report.checkpoints,
                       "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}, f)
    elif scenario == "bank_damaged_then_load":  # rank 1's own copy of ckpt_2's index is damaged
        attempt_then_load(lambda: saver.load_model_bank([{"path": os.path.join(saver.output_dir, "ckpt_2")}]),
                          saver, reader, work_dir, world, rank)
    elif scenario == "list_fails_then_load":  # rank BAD_RANK alone cannot read its `checkpoint` list
        manager = recsave.CheckpointManager(saver, 100)

        def restore():
            with list_reads_failing(rank == int(os.environ["BAD_RANK"])):
                saver.load(fallback=True) if os.environ["HOW"] == "fallback" else manager.restore()
        attempt_then_load(restore, saver, reader, work_dir, world, rank)
    elif scenario == "bank_refused_then_load":  # rank BAD_RANK alone: a malformed entry, or a refused model
        entry = {"path": os.path.join(saver.output_dir, "ckpt_2")}
        bad = rank == int(os.environ["BAD_RANK"])
        if bad and os.environ["REFUSED"] == "entry":
            entry["exclude_typo"] = ["io_state"]
        elif bad:
            model.odd = NonTensorExtraState()

        def bank_load():
            try:
                saver.load_model_bank([entry])
            finally:
                if hasattr(model, "odd"):
                    del model.odd
        attempt_then_load(bank_load, saver, reader, work_dir, world, rank)
    elif scenario == "two_savers":  # two Savers of one process group: A writes in the background
        # while B saves (TWO_SAVERS_B: async_save or save) or loads A's ckpt_0 then saves it (load:
        # the load's index broadcast). Rank 0's write of A starts late, so its
        # collectives come after B's there and before B's on rank 1: paired by arrival, A's index
        # would be committed from B's parts.
        model_b = Model()
        saver_b = Saver(model_b, sparse_optim=SparseAdagrad(model_b, lr=0.1),
                        output_dir=os.path.join(work_dir, "out_b"), max_keep=2)
        fill(model, rank, world)
        fill(model_b, rank, world, offset=50.0)
        b_does = os.environ.get("TWO_SAVERS_B")
        if b_does == "load":
            saver.save("ckpt_0")
        real = recsave.save.pipeline.CheckpointWriter._write_rank_files
        calls = []

        def late_on_rank0(writer, *args, **kwargs):
            calls.append(writer)
            if rank == 0 and len(calls) == 1:
                time.sleep(1.5)
            return real(writer, *args, **kwargs)
        recsave.save.pipeline.CheckpointWriter._write_rank_files = late_on_rank0
        try:
            saver.async_save("ckpt_1")
            if b_does == "save":
                saver_b.save("ckpt_1")
            elif b_does == "load":
                saver_b.load(os.path.join(work_dir, "out", "ckpt_0"))
                saver_b.save("ckpt_1")
            else:
                saver_b.async_save("ckpt_1")
            saver.wait()
            saver_b.wait()
        except recsave.RecsaveError as exc:
            with open(os.path.join(work_dir, f"error_{rank}.txt"), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
            os._exit(3)
    elif scenario == "load_damaged":
        # The live model holds other rows (offset 50); rank 1's part of the checkpoint is damaged.
        fill(model, rank, world, offset=50.0)
        reader.position = 5
        try:
            saver.load()
        except recsave.RecsaveError as exc:
            with open(os.path.join(work_dir, f"error_{rank}.txt"), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
        for name in ("user", "item"):
            ids, values, slots = getattr(model, name).export()
            torch.save({"ids": ids, "values": values, "acc": slots["adagrad_acc"]},
                       os.path.join(work_dir, f"{name}_{world}_{rank}.pt"))
        with open(os.path.join(work_dir, f"report_{world}_{rank}.json"), "w") as f:
            json.dump({"position": reader.position}, f)
    elif scenario == "load_other_ids":  # rank r loads ckpt_<r + 1>: a mix of two checkpoints
        fill(model, rank, world, offset=50.0)  # OTHER_NAMES=1: the same checkpoint, rank 0 excluding user
        other_names = os.environ.get("OTHER_NAMES") == "1"
        try:
            if other_names:
                saver.load(ckpt_id="ckpt_2", load_conf={"exclude": ["user", "user@*"]} if rank == 0 else None)
            else:
                saver.load(ckpt_id=f"ckpt_{rank + 1}")
        except recsave.RecsaveError as exc:
            with open(os.path.join(work_dir, f"error_{rank}.txt"), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
        ids, values, _ = model.user.export()
        torch.save({"ids": ids, "values": values}, os.path.join(work_dir, f"user_{world}_{rank}.pt"))
    elif scenario == "load":
        whole_reads = count_whole_file_reads()
        conf = {"exclude": ["io_state"]} if os.environ.get("NO_IO") else None
        step = None
        if os.environ.get("MANAGER"):  # through CheckpointManager.restore (the latest checkpoint)
            manager = recsave.CheckpointManager(saver, 100)
            step = manager.restore(load_conf=conf)
            report = manager.last_report
        else:
            report = saver.load(load_conf=conf, ckpt_id=os.environ.get("CKPT_ID"))
        out = {"bytes_read": report.bytes_read, "rows_read": report.rows_read, "position": reader.position,
               "whole_reads": dict(whole_reads), "checkpoints": report.checkpoints, "step": step}
        for name in ("user", "item"):
            table = getattr(model, name)
            ids, values, slots = table.export()
            torch.save({"ids": ids, "values": values, "acc": slots["adagrad_acc"]},
                       os.path.join(work_dir, f"{name}_{world}_{rank}.pt"))
        torch.save(model.dense.state_dict(), os.path.join(work_dir, f"dense_{world}_{rank}.pt"))
        with open(os.path.join(work_dir, f"report_{world}_{rank}.json"), "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)
