"""Reusable pieces of the saver / load-config / resume / remote tests: a small CTR model, a deterministic
click stream, a training loop, a reader with io state, and bit-exact comparisons.

Importable from tests (pytest puts tests/ on sys.path) and from the child scripts the resume tests
launch (they add this directory to sys.path themselves).
"""
from __future__ import annotations

import copy
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import recsave
from recsave import CheckpointManager, HashTable, Saver
from recsave.format import seal
from recsave.tables.optim import SparseAdagrad

# One intra-op thread: float reductions then do not depend on the machine's core count or load, so
# the parent test process and the child processes it launches compute bit-identical results (and tiny
# ops do not pay for thread hand-offs on a busy 2-core machine).
torch.set_num_threads(1)

DIM = 8
N_USERS = 400
N_ITEMS = 250
BATCH = 32
# Feature hashes are unbounded int64 values: spread the small id ranges over the whole int64 space.
_USER_MUL = 0x9E3779B97F4A7C15 - (1 << 64)   # negative int64: ids of both signs
_ITEM_MUL = 0x00000001000001B3


class CTR(torch.nn.Module):
    """Two hash tables (`user`, `item`), a batch norm (buffers incl. an int64 counter) and an MLP.

    Variants for load-config tests: `item_dim` (a table of another width), `hidden` (dense shapes),
    `head` (the MLP's attribute name, i.e. its parameter prefix), `extra_table` (a third table)."""

    def __init__(self, dim: int = DIM, seed: int = 0, *, item_dim: Optional[int] = None, hidden: int = 16,
                 head: str = "mlp", extra_table: Optional[str] = None):
        super().__init__()
        item_dim = dim if item_dim is None else item_dim
        self.head_name = head
        self.user = HashTable(dim, name="user", seed=seed + 11, init_std=0.05)
        self.item = HashTable(item_dim, name="item", seed=seed + 23, init_std=0.05)
        self.extra = HashTable(dim, name=extra_table, seed=seed + 37) if extra_table else None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.bn = torch.nn.BatchNorm1d(dim + item_dim)
            setattr(self, head, torch.nn.Sequential(torch.nn.Linear(dim + item_dim, hidden), torch.nn.ReLU(),
                                                    torch.nn.Linear(hidden, 1)))

    def forward(self, uid: torch.Tensor, iid: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.user(uid), self.item(iid)], -1)
        out = getattr(self, self.head_name)(self.bn(x)).squeeze(-1)
        if self.extra is not None:
            out = out + self.extra(uid ^ iid).sum(-1)
        return out


def user_ids(raw: torch.Tensor) -> torch.Tensor:
    return raw.to(torch.int64) * _USER_MUL  # int64 wrap-around: a fixed bijection


def item_ids(raw: torch.Tensor) -> torch.Tensor:
    return raw.to(torch.int64) * _ITEM_MUL + 7


def make_batch(step: int, batch: int = BATCH):
    """(uid, iid, label) of training step `step`: a pure function of the step."""
    g = torch.Generator().manual_seed(10_000 + step)
    uid = user_ids(torch.randint(0, N_USERS, (batch,), generator=g))
    iid = item_ids(torch.randint(0, N_ITEMS, (batch,), generator=g))
    label = torch.randint(0, 2, (batch,), generator=g).to(torch.float32)
    return uid, iid, label


class Reader:
    """A click-stream reader whose position is its io state."""

    def __init__(self, offset: int = 0):
        self.offset = offset
        self.loaded: List[Any] = []

    def next_batch(self):
        b = make_batch(self.offset)
        self.offset += 1
        return b

    def dump_io_state(self) -> Dict[str, int]:
        return {"offset": self.offset}

    def load_io_state(self, state: Dict[str, int]) -> None:
        self.loaded.append(state)
        self.offset = int(state["offset"])


def train_step(model: torch.nn.Module, opts: Sequence[Any], batch) -> None:
    uid, iid, label = batch
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(uid, iid), label)
    loss.backward()
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()


def train(model: torch.nn.Module, opts: Sequence[Any], steps: int, start: int = 0, *,
          reader: Optional[Reader] = None, manager: Optional[CheckpointManager] = None) -> None:
    """`steps` training steps on batches start, start+1, ... (or the reader's next batches); calls
    manager.step() after each step when given."""
    model.train()
    for i in range(steps):
        batch = reader.next_batch() if reader is not None else make_batch(start + i)
        train_step(model, opts, batch)
        if manager is not None:
            manager.step()


@dataclass
class Job:
    model: CTR
    sparse_opt: SparseAdagrad
    dense_opt: torch.optim.Optimizer
    reader: Reader
    saver: Saver
    manager: Optional[CheckpointManager] = None

    @property
    def opts(self):
        return [self.dense_opt, self.sparse_opt]

    def train(self, steps: int) -> None:
        train(self.model, self.opts, steps, reader=self.reader, manager=self.manager)


def make_job(output_dir: str, *, max_keep: Optional[int] = 3, save_interval: Optional[int] = None,
             seed: int = 0, register: bool = True, async_mode: str = "disabled",
             manager_kw: Optional[Dict[str, Any]] = None, **model_kw: Any) -> Job:
    """A model with its sparse Adagrad, a dense Adam registered as `dense_opt`, a Reader registered as
    io state `reader`, and (when save_interval is not None) a CheckpointManager (with `manager_kw`,
    e.g. full_every)."""
    model = CTR(seed=seed, **model_kw)
    sparse_opt = SparseAdagrad(model, lr=0.05, initial_accumulator_value=0.1)
    dense_opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    reader = Reader()
    saver = Saver(model, sparse_optim=sparse_opt, output_dir=output_dir, max_keep=max_keep, concurrency=2)
    if register:
        saver.register_for_checkpointing("dense_opt", dense_opt)
        saver.register_io_state("reader", reader)
    manager = (CheckpointManager(saver, save_interval, async_mode=async_mode, **(manager_kw or {}))
               if save_interval is not None else None)
    return Job(model, sparse_opt, dense_opt, reader, saver, manager)


# --------------------------------------------------------------------------------- comparisons
def tables_of(model: torch.nn.Module) -> Dict[str, HashTable]:
    sparse, _ = recsave.split_sparse_dense_state_dict(model.state_dict(keep_vars=True))
    return sparse


def dense_of(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    _, dense = recsave.split_sparse_dense_state_dict(model.state_dict())
    return dense


def table_state(table: HashTable) -> Dict[str, torch.Tensor]:
    """`@id` (sorted), `@embedding` and `@<slot>` rows in that id order: copies."""
    ids = torch.sort(table.ids()).values
    _, values, slots = table.export(ids)
    out = {"@id": ids.clone(), "@embedding": values.clone()}
    out.update({f"@{s}": v.clone() for s, v in slots.items()})
    return out


def model_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """A canonical, detached copy of everything the model holds: `<table>@id|embedding|<slot>` and
    every dense parameter / buffer."""
    out: Dict[str, torch.Tensor] = {}
    for name, table in tables_of(model).items():
        out.update({name + k: v for k, v in table_state(table).items()})
    for name, t in dense_of(model).items():
        out[name] = t.detach().clone()
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                       b.detach().contiguous().reshape(-1).view(torch.uint8))


def assert_states_equal(s1: Dict[str, torch.Tensor], s2: Dict[str, torch.Tensor], what: str = "state") -> None:
    assert sorted(s1) == sorted(s2), f"{what}: names differ: {sorted(set(s1) ^ set(s2))}"
    bad = [n for n in s1 if not same_bits(s1[n], s2[n])]
    assert not bad, f"{what}: not bit-identical: {bad}"


def assert_models_equal(m1: torch.nn.Module, m2: torch.nn.Module) -> None:
    """Every table's id set, rows per id, every slot per id, every dense param / buffer: bit for bit."""
    assert_states_equal(model_state(m1), model_state(m2), "model")


def assert_obj_equal(a: Any, b: Any, where: str = "") -> None:
    """Deep equality of (optimizer) state dicts: tensors bit for bit, everything else with ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {type(a)} vs {type(b)}"
        assert same_bits(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), f"{where}: keys differ"
        for k in a:
            assert_obj_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_obj_equal(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def row_meta_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Each table's row metadata (`<table>@<meta>`, rows in sorted id order) and its step
    (`<table>@step`): what a delta carries besides the rows (docs/FORMAT.md section 10)."""
    out: Dict[str, torch.Tensor] = {}
    for name, table in tables_of(model).items():
        ids = torch.sort(table.ids()).values
        for m, v in table.row_meta(table.lookup(ids, insert=False)).items():
            out[f"{name}@{m}"] = v.clone()
        out[f"{name}@step"] = torch.tensor(table.step)
    return out


def job_state(job: Job, *, row_meta: bool = False) -> Dict[str, Any]:
    """Everything a checkpoint of `job` restores: model, both optimizers, reader position; with
    `row_meta`, also row metadata and table steps (`meta`, see row_meta_state)."""
    out = {"model": model_state(job.model), "dense_opt": copy.deepcopy(job.dense_opt.state_dict()),
           "sparse_opt": copy.deepcopy(job.sparse_opt.state_dict()), "reader": job.reader.offset}
    if row_meta:
        out["meta"] = row_meta_state(job.model)
    return out


def assert_jobs_equal(s1: Dict[str, Any], s2: Dict[str, Any]) -> None:
    """Bit-exact equality of two job_state()s; row metadata too when either has it."""
    assert_states_equal(s1["model"], s2["model"], "model")
    if "meta" in s1 or "meta" in s2:
        assert "meta" in s1 and "meta" in s2, "only one state has row metadata (job_state(row_meta=True))"
        assert_states_equal(s1["meta"], s2["meta"], "row metadata")
    assert_obj_equal(s1["dense_opt"], s2["dense_opt"], "dense_opt")
    assert_obj_equal(s1["sparse_opt"], s2["sparse_opt"], "sparse_opt")
    assert s1["reader"] == s2["reader"]


def listing(path) -> List[str]:
    """Names in an output dir, without the writer lock file (held while a Saver lives)."""
    from recsave.storage.lock import LOCK_FILE

    return sorted(n for n in os.listdir(path) if n != LOCK_FILE)


def ckpt_files(path: str) -> List[str]:
    return sorted(os.listdir(path))


def checkpoint_bytes(ckpt_dir: str) -> Dict[str, bytes]:
    """Every file's bytes; the index's creation time and the seal over it blanked, the only parts
    two saves of the same state may differ in."""
    files = {n: open(os.path.join(ckpt_dir, n), "rb").read() for n in sorted(os.listdir(ckpt_dir))}
    files["index"] = re.sub(rb'"created_at":"[^"]*"', b'"created_at":""', files["index"])
    files["index"] = re.sub(rb',"index_crc32c":[0-9]+}$', b"}", files["index"])
    return files


def ids_in(table: HashTable) -> set:
    return set(table.ids().tolist())


def read_index_json(ckpt_dir) -> Dict[str, Any]:
    """The index of ckpt_dir as a JSON object, its seal (`index_crc32c`) left out: a test edits it
    and writes it back with write_index_json."""
    with open(os.path.join(str(ckpt_dir), "index"), "rb") as f:
        raw = json.loads(f.read())
    raw.pop(seal.KEY, None)
    return raw


def write_index_json(ckpt_dir, raw: Dict[str, Any], *, sealed: bool = True, indent: Optional[int] = None) -> None:
    """Writes an edited index, sealed as recsave seals one (docs/FORMAT.md section 3) so that a
    test's edit reaches the rule it tests instead of failing the index's checksum, or with
    `sealed=False` as a recsave from before seals wrote it."""
    body = {k: v for k, v in raw.items() if k != seal.KEY}
    text = json.dumps(body, indent=indent, separators=None if indent else (",", ":")).encode()
    with open(os.path.join(str(ckpt_dir), "index"), "wb") as f:
        f.write(seal.seal(text) if sealed else text)


# ------------------------------------------------------------------------- writer lease overlap
def save_outliving_the_lease(out: str, monkeypatch: Any, lease_s: float = 0.4) -> Tuple[Job, Optional[BaseException]]:
    """Saves ckpt_1 into `out` (after ckpt_0) with writer_lease_s=`lease_s` and its first table's
    shards held up for three leases; meanwhile a second Saver tries to save ckpt_1 into `out`.
    Returns the first job and what the second's save raised (None: it saved)."""
    from recsave import knobs
    from recsave.save import pipeline

    with knobs.override(writer_lease_s=lease_s):  # from the first save: it starts the renewals
        job = make_job(out, max_keep=3, seed=1)
        job.train(1)
        job.saver.save("ckpt_0")
        job.train(1)
        other = make_job(out, max_keep=3, seed=2)
        other.train(2)
        real, raised = pipeline.write_shards, []

        def held_up(*args: Any, **kwargs: Any) -> Any:
            if not raised:
                time.sleep(3 * lease_s)
                try:
                    other.saver.save("ckpt_1")
                    raised.append(None)
                except Exception as exc:
                    raised.append(exc)
            return real(*args, **kwargs)

        monkeypatch.setattr(pipeline, "write_shards", held_up)
        try:
            job.saver.save("ckpt_1")
        finally:
            monkeypatch.setattr(pipeline, "write_shards", real)
            other.saver.close()
    return job, raised[0]
