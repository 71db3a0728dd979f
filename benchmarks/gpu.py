"""CUDA tables end to end: the device id map, sync save and load, async_pinned staging, change
tracking and delta saves, and the host memory each needs, against the plain torch operations on
the same bytes measured in the same run.

    python benchmarks/gpu.py                 # ~4 GB of CUDA tables, 3 rounds (a few minutes on an H100/H200)
    python benchmarks/gpu.py --quick         # ~64 MB, 1 round: smoke test
    python benchmarks/gpu.py --device cpu --quick   # the same code paths on the CPU (no pinned rows):
                                                    # checks the script, measures nothing about a GPU

Sections (all in this process; fsync off, so the figures are the save path, not the disk):

* id map: ``TensorIdMap`` on the device (the map of every CUDA table) against the C++ ``IdMap`` on
  the host, in ids/s: inserting `--ids` distinct ids in batches of `--map-batch`, looking all of them
  up in random order, and training batches (`--batch` x 26 ids, 90 % present) through
  ``lookup_or_insert``.
* save / load: ``Saver.save`` of the CUDA tables and ``Saver.load`` into fresh CUDA tables (id map
  rebuilt on the device), against a raw write / read of the same bytes from host memory (the
  file-system limit), the same with the device-to-host / host-to-device copy of those bytes
  (pageable ``.cpu()`` / a pinned buffer then ``copy_``), ``torch.save`` / ``torch.load`` of the same
  tensors, and the Saver on CPU tables holding the same rows.
* async: the training stall of ``async_save(pinned=True)`` (async_pinned; steady state, buffers
  reused) and of ``async_save()`` (pageable) against a plain pinned ``copy_`` of the bytes staged.
  Budget: staging >= 0.7x that bandwidth.
* delta: 1 % of every table's rows rewritten on the device, then ``save(incremental=True)``
  against a full save; the async_pinned stall of such a delta; restoring base + delta.
* peak RSS: each operation's host high-water mark over its starting RSS (loads: minus what the
  loaded tables hold on the host, none for CUDA tables).

Results: a table on stdout and JSON (default benchmarks/results/gpu.json; `--json`).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

C.ensure_repo_on_path()

import torch  # noqa: E402

from recsave import HashTable, Saver, knobs  # noqa: E402
from recsave.tables import cudakernels  # noqa: E402
from recsave.tables.idmap import CpuIdMap, TensorIdMap  # noqa: E402
from recsave.tables.optim import SparseAdagrad  # noqa: E402

FIELDS = 26


# ------------------------------------------------------------------------------------------------
# Helpers

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


class Peak:
    """Host peak RSS over the RSS at entry, in bytes (``with Peak() as p: ...; p.bytes``)."""

    def __enter__(self) -> "Peak":
        gc.collect()
        self.start = C.current_rss_bytes()
        self.ok = C.reset_peak_rss()
        self.bytes = float("nan")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.ok:
            self.bytes = C.peak_rss_bytes() - self.start


class Model(torch.nn.Module):
    def __init__(self, tables: int, dim: int, device: torch.device):
        super().__init__()
        self.tables = torch.nn.ModuleList(HashTable(dim, name=f"t{i}", device=device, seed=i)
                                          for i in range(tables))
        self.head = torch.nn.Linear(tables * dim, 1).to(device)


def fresh_model(args: argparse.Namespace, device: torch.device) -> Model:
    model = Model(args.tables, args.dim, device)
    SparseAdagrad(model, lr=0.01)  # adds the slot the checkpoint holds
    return model


def build(args: argparse.Namespace, device: torch.device) -> Model:
    """Tables of `--size-gb` in all (ids, embedding, one Adagrad slot, row metadata), on `device`."""
    model = fresh_model(args, device)
    rows = rows_per_table(args)
    gen = torch.Generator(device=device).manual_seed(0)
    for t in model.tables:
        ids = torch.randint(-(1 << 62), 1 << 62, (rows,), device=device, generator=gen)
        ids = torch.unique(ids)  # distinct (and sorted: shuffled below so rows do not follow ids)
        ids = ids[torch.randperm(ids.numel(), device=device, generator=gen)]
        values = torch.randn(ids.numel(), args.dim, device=device, generator=gen)
        t.load_rows(ids, values, {"adagrad_acc": torch.rand(ids.numel(), args.dim, device=device, generator=gen)})
    sync(device)
    return model


def row_bytes(dim: int) -> int:
    return 8 + 2 * dim * 4 + 16  # id, embedding, slot, last_step + count


def rows_per_table(args: argparse.Namespace) -> int:
    return int(args.size_gb * 1e9 / args.tables / row_bytes(args.dim))


def columns_of(model: Model) -> List[torch.Tensor]:
    """The tensors a checkpoint of the tables holds (ids, embedding, slot, metadata per table), on
    the tables' device, in row order."""
    out: List[torch.Tensor] = []
    for t in model.tables:
        ids, rows = t.id_rows()
        n = len(t)
        assert torch.equal(rows, torch.arange(n)), "benchmark tables have rows 0..n-1"
        out.append(ids.to(t.device))
        out += [t.weight[:n], t.slot("adagrad_acc")[:n]]
        out += [m[:n] for m in t.meta_columns().values()]
    return out


def nbytes(tensors: List[torch.Tensor]) -> int:
    return sum(x.numel() * x.element_size() for x in tensors)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def same_rows(a: Model, b: Model, sample: int = 20000) -> bool:
    """Every table holds the same ids, and the same embedding / slot / metadata for a sample."""
    for ta, tb in zip(a.tables, b.tables):
        ia, ib = ta.ids(), tb.ids()
        if ia.numel() != ib.numel() or not torch.equal(torch.sort(ia).values, torch.sort(ib).values):
            return False
        pick = ia[torch.randperm(ia.numel())[:sample]]
        _, va, sa = ta.export(pick)
        _, vb, sb = tb.export(pick)
        ra, rb = ta.lookup(pick.to(ta.device), insert=False), tb.lookup(pick.to(tb.device), insert=False)
        if not (torch.equal(va, vb) and torch.equal(sa["adagrad_acc"], sb["adagrad_acc"])):
            return False
        ma, mb = ta.row_meta(ra.cpu()), tb.row_meta(rb.cpu())
        if any(not torch.equal(ma[k], mb[k]) for k in ma):
            return False
    return True


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# Id map

def measure_idmap(args: argparse.Namespace, device: torch.device) -> List[Dict[str, Any]]:
    n = args.ids
    gen = torch.Generator().manual_seed(1)
    ids_cpu = torch.unique(torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen))
    ids_cpu = ids_cpu[torch.randperm(ids_cpu.numel(), generator=gen)]
    n = ids_cpu.numel()
    shuffled_cpu = ids_cpu[torch.randperm(n, generator=gen)]
    absent_cpu = torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen)
    batch = args.batch * FIELDS
    batches_cpu = []
    for _ in range(20):
        pick = ids_cpu[torch.randint(0, n, (batch,), generator=gen)]
        new = torch.rand(batch, generator=gen) < 0.1
        pick[new] = torch.randint(-(1 << 62), 1 << 62, (int(new.sum()),), generator=gen)
        batches_cpu.append(pick)
    out = []
    kinds = ["device TensorIdMap, torch ops", "host C++ IdMap"]
    if device.type == "cuda" and cudakernels.available():
        kinds.insert(0, "device TensorIdMap, CUDA kernels")
    for kind in kinds:
        with knobs.override(cuda_kernels=kind.endswith("kernels")):
            out += _measure_one_map(kind, device, ids_cpu, shuffled_cpu, absent_cpu, batches_cpu, args)
    return out


def _measure_one_map(kind: str, device: torch.device, ids_cpu: torch.Tensor, shuffled_cpu: torch.Tensor,
                     absent_cpu: torch.Tensor, batches_cpu: List[torch.Tensor],
                     args: argparse.Namespace) -> List[Dict[str, Any]]:
    n, step, batch = ids_cpu.numel(), args.map_batch, batches_cpu[0].numel()
    out = []
    dev = device if kind.startswith("device") else torch.device("cpu")
    ids, shuffled, absent = ids_cpu.to(dev), shuffled_cpu.to(dev), absent_cpu.to(dev)
    batches = [b.to(dev) for b in batches_cpu]

    def new_map() -> Any:
        return TensorIdMap(dev) if kind.startswith("device") else CpuIdMap()

    def insert_all() -> Any:
        m = new_map()
        for a in range(0, n, step):
            m.lookup_or_insert(ids[a:a + step])
        return m

    results: Dict[str, List[float]] = {"insert": [], "lookup": [], "absent": [], "train": []}
    m = None
    for _ in range(args.map_repeats):
        m = None
        free(dev)
        box: List[Any] = []
        results["insert"].append(timed(lambda: box.append(insert_all()), dev))
        m = box[0]
        assert len(m) == n
        results["lookup"].append(timed(lambda: [m.lookup(shuffled[a:a + step]) for a in range(0, n, step)], dev))
        results["absent"].append(timed(lambda: [m.lookup(absent[a:a + step]) for a in range(0, n, step)], dev))
        results["train"].append(timed(lambda: [m.lookup_or_insert(b) for b in batches], dev) / len(batches))
    got = m.lookup(shuffled[: 1000]).cpu() if m is not None else None
    if got is not None and int((got < 0).sum()):
        raise AssertionError(f"{kind}: inserted ids not found")
    for op, k in (("insert", n), ("lookup", n), ("absent", n), ("train", batch)):
        out.append({"map": kind, "op": op, "ids": k, "seconds": results[op],
                    "ids_per_s": k / C.median(results[op])})
    del m, box
    free(dev)
    return out


# ------------------------------------------------------------------------------------------------
# Training step

class Tower(torch.nn.Module):
    """Embeddings of [batch, 26] ids summed over fields, then a linear logit (hashtable.py's model)."""

    def __init__(self, dim: int, device: torch.device):
        super().__init__()
        self.emb = HashTable(dim, name="emb", device=device)
        self.head = torch.nn.Linear(dim, 1).to(device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).sum(1)).squeeze(1)


def measure_train(args: argparse.Namespace, device: torch.device) -> List[Dict[str, Any]]:
    """Median time of a training step (forward, backward, SparseAdagrad + Adagrad) of one table
    on the device with and without the kernels, and on the CPU."""
    gen = torch.Generator().manual_seed(2)
    vocab = args.ids
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64) ** -1.05
    batches = [torch.multinomial(ranks, args.batch * FIELDS, replacement=True, generator=gen).view(args.batch, FIELDS)
               * 2654435761 for _ in range(10)]
    out = []
    kinds = [(f"{device.type} table, torch-ops map", device, False), ("cpu table, C++ map", torch.device("cpu"), True)]
    if device.type == "cuda" and cudakernels.available():
        kinds.insert(0, ("cuda table, kernel map", device, True))
    for label, dev, kernels in kinds:
        with knobs.override(cuda_kernels=kernels):
            torch.manual_seed(0)
            model = Tower(args.dim, dev)
            opts = [SparseAdagrad(model, lr=0.05), torch.optim.Adagrad(model.head.parameters(), lr=0.05)]
            data = [b.to(dev) for b in batches]
            times = []
            for i in range(args.train_steps + 3):
                def one() -> None:
                    model(data[i % len(data)]).sigmoid().mean().backward()
                    for o in opts:
                        o.step()
                        o.zero_grad()
                s = timed(one, dev)
                if i >= 3:
                    times.append(s)
            out.append({"table": label, "seconds": times, "median_s": C.median(times), "rows": len(model.emb),
                        "ids_per_step": args.batch * FIELDS})
            del model, opts, data
            free(dev)
    return out


# ------------------------------------------------------------------------------------------------
# Save / load

def measure_save_load(args: argparse.Namespace, device: torch.device, work: str) -> Dict[str, Any]:
    model = build(args, device)
    cols = columns_of(model)
    state = nbytes(cols)
    C.log(f"state: {args.tables} tables x {len(model.tables[0])} rows, dim {args.dim}, "
          f"{state / 1e9:.2f} GB on {device}")
    host = [c.cpu() for c in cols]  # the raw rows' source and the CPU tables' rows
    cpu_model = fresh_model(args, torch.device("cpu"))
    for t_dev, t_cpu in zip(model.tables, cpu_model.tables):
        ids, values, slots = t_dev.export()
        meta = t_dev.row_meta(torch.arange(len(t_dev)))
        t_cpu.load_rows(ids, values, slots, meta=meta)
    samples: Dict[str, List[float]] = {}
    rss: Dict[str, float] = {}
    files: Dict[str, int] = {}
    pinned = torch.empty(max(c.numel() * c.element_size() for c in cols), dtype=torch.uint8,
                         pin_memory=device.type == "cuda")

    def record(name: str, seconds: float, peak: Peak) -> None:
        samples.setdefault(name, []).append(seconds)
        rss[name] = max(rss.get(name, float("-inf")), peak.bytes)

    raw_path = os.path.join(work, "raw.bin")
    for rnd in range(args.rounds):
        C.clear_dir(work)
        # raw write / read from host memory: the file system's limit
        with Peak() as p:
            s = timed(lambda: _raw_write(raw_path, host), device)
        record("save: raw write (host bytes)", s, p)
        with Peak() as p:
            s = timed(lambda: _raw_read(raw_path, host), device)
        record("load: raw read (into host buffers)", s, p)
        os.remove(raw_path)
        # the same with the copies between device and host
        with Peak() as p:
            s = timed(lambda: _raw_write(raw_path, [c.cpu() for c in cols]), device)
        record("save: D2H (.cpu()) + raw write", s, p)
        with Peak() as p:
            s = timed(lambda: _raw_read_to_device(raw_path, cols, pinned), device)
        record("load: raw read into pinned + H2D copy_", s, p)
        os.remove(raw_path)
        # torch.save / torch.load of the same tensors
        tpath = os.path.join(work, "state.pt")
        with Peak() as p:
            s = timed(lambda: torch.save({str(i): c for i, c in enumerate(cols)}, tpath), device)
        record("save: torch.save (device tensors)", s, p)
        with Peak() as p:
            s = timed(lambda: torch.load(tpath, map_location=device, weights_only=True), device)
        record("load: torch.load(map_location=device)", s, p)
        os.remove(tpath)
        # the Saver, CUDA tables
        out = os.path.join(work, "ckpt")
        with Peak() as p:
            s = timed(lambda: Saver(model, output_dir=out, max_keep=None).save(f"ckpt_{rnd}"), device)
        record("save: Saver.save", s, p)
        files["saver"] = dir_bytes(os.path.join(out, f"ckpt_{rnd}"))
        target: List[Model] = [fresh_model(args, device)]
        with Peak() as p:
            s = timed(lambda: Saver(target[0], output_dir=out).load(), device)
        record("load: Saver.load into fresh tables", s, p)
        if rnd == 0 and not same_rows(model, target[0]):
            raise AssertionError("Saver.load of the CUDA tables differs from what was saved")
        del target[0]
        free(device)
        # the Saver, CPU tables with the same rows (the host path on the same machine)
        cout = os.path.join(work, "cpu")
        with Peak() as p:
            s = timed(lambda: Saver(cpu_model, output_dir=cout, max_keep=None).save(f"ckpt_{rnd}"), device)
        record("save: Saver.save, CPU tables", s, p)
        ctarget: List[Model] = [fresh_model(args, torch.device("cpu"))]
        with Peak() as p:
            s = timed(lambda: Saver(ctarget[0], output_dir=cout).load(), device)
        p.bytes -= state  # the loaded CPU tables hold the state on the host
        record("load: Saver.load, CPU tables", s, p)
        del ctarget[0]
        free(device)
    del cpu_model, host
    free(device)
    return {"state_bytes": state, "files": files, "samples": samples, "rss_over_start": rss, "model": model}


def _raw_write(path: str, tensors: List[torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for t in tensors:
            t.numpy().tofile(f)


def _raw_read(path: str, into: List[torch.Tensor]) -> None:
    with open(path, "rb", buffering=0) as f:
        for t in into:
            f.readinto(memoryview(t.numpy()).cast("B"))


def _raw_read_to_device(path: str, into: List[torch.Tensor], pinned: torch.Tensor) -> None:
    """Reads each tensor's bytes into one pinned buffer and copies them to the device tensor (the
    copy of one overlaps nothing: the simplest correct way)."""
    with open(path, "rb", buffering=0) as f:
        for t in into:
            k = t.numel() * t.element_size()
            buf = pinned[:k]
            f.readinto(memoryview(buf.numpy()))
            dst = torch.empty_like(t)
            dst.view(-1).view(torch.uint8).copy_(buf, non_blocking=True)
            sync(t.device)


# ------------------------------------------------------------------------------------------------
# Where a CUDA save's host memory goes

def measure_save_rss(args: argparse.Namespace, model: Model, device: torch.device, work: str) -> Dict[str, Any]:
    """Peak host RSS over the start of each of `--rounds` Saver.save calls in a row (the first
    allocates the pinned gather buffers, later ones reuse torch's cached pinned memory), per
    write_block_bytes, with torch's pinned-memory allocator statistics where it has them."""
    out: Dict[str, Any] = {}
    for block in (64 << 20, 32 << 20):
        rounds = []
        with knobs.override(write_block_bytes=block):
            for rnd in range(args.rounds):
                C.clear_dir(work)
                with Peak() as p:
                    s = timed(lambda: Saver(model, output_dir=work, max_keep=None).save(f"ckpt_{rnd}"), device)
                stats = _host_alloc_stats(device)
                C.log(f"save_rss block {block >> 20} MiB round {rnd}: {p.bytes / 1e6:.0f} MB over start; {stats}")
                rounds.append({"seconds": s, "rss_over_start": p.bytes, "rss_start": p.start, **stats})
        out[str(block)] = rounds
        free(device)
    return out


def _host_alloc_stats(device: torch.device) -> Dict[str, Any]:
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if device.type != "cuda" or fn is None:
        return {}
    try:
        st = fn()
    except Exception:  # older torch: no statistics
        return {}
    return {k: v for k, v in st.items() if "bytes" in k and ("current" in k or "peak" in k)}


# ------------------------------------------------------------------------------------------------
# Async staging

def measure_async(args: argparse.Namespace, model: Model, device: torch.device, work: str) -> Dict[str, Any]:
    staged = []  # what capture() copies: each column up to row_capacity, the metadata likewise
    for t in model.tables:
        cap = t.weight.shape[0]
        staged += [t.weight, t.slot("adagrad_acc")] + [m[:cap] for m in t.meta_columns().values()]
    staged_bytes = nbytes(staged)
    pin = device.type == "cuda"
    hosts = [torch.empty(x.shape, dtype=x.dtype, pin_memory=pin) for x in staged]

    def pinned_copy() -> None:
        for h, x in zip(hosts, staged):
            h.copy_(x, non_blocking=pin)

    out: Dict[str, Any] = {"staged_bytes": staged_bytes, "samples": {}, "rss_over_start": {}}
    for _ in range(args.rounds + 1):
        s = timed(pinned_copy, device)
        out["samples"].setdefault("pinned copy_ of the staged bytes", []).append(s)
    out["samples"]["pinned copy_ of the staged bytes"].pop(0)  # first: page-locking touches
    del hosts
    for label, pinned in (("async_save(pinned=True) stall", True), ("async_save() stall (pageable)", False)):
        saver = Saver(model, output_dir=os.path.join(work, "async"), max_keep=1)
        _, write = saver.async_save("ckpt_warm", pinned=pinned)  # allocates the stage buffers
        write.result()
        for rnd in range(args.rounds):
            with Peak() as p:
                s = timed(lambda: saver.async_save(f"ckpt_{rnd}", pinned=pinned), device)
                t0 = time.perf_counter()
                saver.wait()
                out["samples"].setdefault(label.replace("stall", "write after the stall"), []).append(
                    time.perf_counter() - t0)
            out["samples"].setdefault(label, []).append(s)
            out["rss_over_start"][label] = max(out["rss_over_start"].get(label, float("-inf")), p.bytes)
        saver.close()
        C.clear_dir(work)
        free(device)
    return out


# ------------------------------------------------------------------------------------------------
# Change tracking and deltas

def measure_delta(args: argparse.Namespace, model: Model, device: torch.device, work: str) -> Dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(3)
    out: Dict[str, Any] = {"samples": {}, "bytes": {}}
    changed_rows = 0
    for rnd in range(args.rounds):
        C.clear_dir(work)
        saver = Saver(model, output_dir=os.path.join(work, "d"), max_keep=None)
        s = timed(lambda: saver.save("ckpt_0"), device)
        out["samples"].setdefault("full save", []).append(s)
        out["bytes"]["full"] = saver.last_save.bytes
        changed_rows = 0
        for t in model.tables:  # rewrite 1 % of the rows on the device
            n = len(t)
            k = max(1, n // 100)
            rows = torch.randperm(n, device=device, generator=gen)[:k]
            ids = t.ids().to(device)[rows]
            t.load_rows(ids, torch.randn(k, args.dim, device=device, generator=gen), clear=False)
            changed_rows += k
        sync(device)
        s = timed(lambda: [t.pending_changes() for t in model.tables], device)
        out["samples"].setdefault("pending_changes() of every table", []).append(s)
        s = timed(lambda: saver.save("ckpt_1", incremental=True), device)
        assert saver.last_save.kind == "delta", saver.last_save
        out["samples"].setdefault("delta save (1 % of rows)", []).append(s)
        out["bytes"]["delta"] = saver.last_save.bytes
        for t in model.tables:  # 1 % more, saved async_pinned
            n = len(t)
            k = max(1, n // 100)
            rows = torch.randperm(n, device=device, generator=gen)[:k]
            t.load_rows(t.ids().to(device)[rows], torch.randn(k, args.dim, device=device, generator=gen),
                        clear=False)
        s = timed(lambda: saver.async_save("ckpt_2", pinned=True, incremental=True), device)
        saver.wait()
        assert saver.last_save.kind == "delta", saver.last_save
        out["samples"].setdefault("delta async_save(pinned=True) stall", []).append(s)
        target: List[Model] = [fresh_model(args, device)]
        s = timed(lambda: Saver(target[0], output_dir=os.path.join(work, "d")).load(ckpt_id="ckpt_0"), device)
        out["samples"].setdefault("restore full", []).append(s)
        s = timed(lambda: Saver(target[0], output_dir=os.path.join(work, "d")).load(), device)
        out["samples"].setdefault("restore base + 2 deltas", []).append(s)
        if rnd == 0 and not same_rows(model, target[0]):
            raise AssertionError("the delta chain restored on the device differs from the live tables")
        saver.close()
        del target[0]
        free(device)
    out["changed_rows"] = changed_rows
    return out


# ------------------------------------------------------------------------------------------------
# Report

def report(res: Dict[str, Any]) -> str:
    lines = [f"device: {res['device_name']}; torch {res['machine']['torch']}; "
             f"{res['machine']['cpus']} CPUs; fs {res['machine']['fs']}; recsave at {res['commit']}; "
             f"CUDA kernels: {res['cuda_kernels']} ({res['cuda_kernels_why_not'] or 'built'})"]
    if "idmap" in res:
        rows = [[r["map"], r["op"], r["ids"], C.fmt_num(r["ids_per_s"] / 1e6, 1), len(r["seconds"])]
                for r in res["idmap"]]
        lines += ["", "id map (M ids/s, median):",
                  C.text_table(["map", "op", "ids per call", "M ids/s", "runs"], rows)]
    if "train" in res:
        rows = [[r["table"], C.fmt_num(r["median_s"] * 1e3, 2), C.fmt_num(r["ids_per_step"] / r["median_s"] / 1e6, 1),
                 r["rows"]] for r in res["train"]]
        lines += ["", f"training step ({res['train'][0]['ids_per_step']} ids, SparseAdagrad; median of "
                      f"{len(res['train'][0]['seconds'])}):",
                  C.text_table(["table", "ms / step", "M ids/s", "rows held"], rows)]
    if "save_load" in res:
        sl = res["save_load"]
        state = sl["state_bytes"]
        med = {k: C.median(v) for k, v in sl["samples"].items()}
        rows = []
        for k, v in sl["samples"].items():
            rows.append([k, C.fmt_num(state / C.median(v) / 1e9, 2), C.fmt_num(min(v), 3) + "-" + C.fmt_num(max(v), 3),
                         C.fmt_num(sl["rss_over_start"][k] / 1e6, 0)])
        lines += ["", f"save / load of {state / 1e9:.2f} GB (GB/s of the state, median of {len(v)}; "
                      "peak host RSS over the start, MB):",
                  C.text_table(["operation", "GB/s", "s min-max", "RSS MB"], rows)]
        ratios = [
            ("Saver.save / raw write (host bytes)", med["save: raw write (host bytes)"] / med["save: Saver.save"]),
            ("Saver.save / D2H + raw write", med["save: D2H (.cpu()) + raw write"] / med["save: Saver.save"]),
            ("Saver.save / torch.save", med["save: torch.save (device tensors)"] / med["save: Saver.save"]),
            ("Saver.save CUDA / CPU tables", med["save: Saver.save, CPU tables"] / med["save: Saver.save"]),
            ("Saver.load / raw read (host)", med["load: raw read (into host buffers)"]
             / med["load: Saver.load into fresh tables"]),
            ("Saver.load / raw read + H2D", med["load: raw read into pinned + H2D copy_"]
             / med["load: Saver.load into fresh tables"]),
            ("Saver.load / torch.load", med["load: torch.load(map_location=device)"]
             / med["load: Saver.load into fresh tables"]),
            ("Saver.load CUDA / CPU tables", med["load: Saver.load, CPU tables"]
             / med["load: Saver.load into fresh tables"]),
        ]
        lines += ["", "ratios (throughput of the first over the second):",
                  C.text_table(["ratio", "x"], [[k, f"{v:.2f}x"] for k, v in ratios])]
        res["ratios"] = dict(ratios)
    if "save_rss" in res:
        rows = [[int(block) >> 20, i, C.fmt_num(r["seconds"], 3), C.fmt_num(r["rss_over_start"] / 1e6, 0),
                 C.fmt_num(r["rss_start"] / 1e6, 0),
                 C.fmt_num(r.get("allocated_bytes.current",
                                 r.get("allocated_bytes.all.current", float("nan"))) / 1e6, 0)]
                for block, rs in res["save_rss"].items() for i, r in enumerate(rs)]
        lines += ["", "Saver.save of the CUDA tables, round by round (host RSS MB; pinned = torch's host allocator):",
                  C.text_table(["block MiB", "round", "s", "RSS over start", "RSS at start", "pinned now"], rows)]
    if "async" in res:
        a = res["async"]
        b = a["staged_bytes"]
        rows = [[k, C.fmt_num(b / C.median(v) / 1e9, 2), C.fmt_num(C.median(v), 3),
                 C.fmt_num(a["rss_over_start"].get(k, float("nan")) / 1e6, 0)] for k, v in a["samples"].items()]
        copy = C.median(a["samples"]["pinned copy_ of the staged bytes"])
        stall = C.median(a["samples"]["async_save(pinned=True) stall"])
        met = sum(copy / s >= 0.7 for s in a["samples"]["async_save(pinned=True) stall"])
        n = len(a["samples"]["async_save(pinned=True) stall"])
        res["async_ratio"] = copy / stall
        lines += ["", f"async staging of {b / 1e9:.2f} GB (GB/s of the staged bytes; RSS MB over the start):",
                  C.text_table(["operation", "GB/s", "median s", "RSS MB"], rows),
                  f"async_pinned staging / pinned copy_: {copy / stall:.2f}x (budget >= 0.7x: "
                  f"{'MET' if copy / stall >= 0.7 else 'MISSED'}, {met} of {n} rounds)"]
    if "delta" in res:
        d = res["delta"]
        med = {k: C.median(v) for k, v in d["samples"].items()}
        rows = [[k, C.fmt_num(v, 3)] for k, v in med.items()]
        lines += ["", f"deltas: {d['changed_rows']} changed rows (1 %); bytes delta / full "
                      f"{d['bytes']['delta'] / d['bytes']['full']:.3f}x:",
                  C.text_table(["operation", "median s"], rows),
                  f"delta / full save time: {med['delta save (1 % of rows)'] / med['full save']:.3f}x; "
                  f"restore base + 2 deltas / full: {med['restore base + 2 deltas'] / med['restore full']:.2f}x"]
    if res.get("errors"):
        lines += ["", "ERRORS:"] + [f"  {k}: {v.splitlines()[-1]}" for k, v in res["errors"].items()]
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size-gb", type=float, default=4.0, help="table state (ids, embedding, slot, metadata)")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ids", type=int, default=8_000_000, help="ids in the id-map rows")
    p.add_argument("--map-batch", type=int, default=1 << 20, help="ids per insert / lookup call")
    p.add_argument("--map-repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=4096, help="examples per training batch (x 26 ids)")
    p.add_argument("--train-steps", type=int, default=20, help="timed training steps per table kind")
    p.add_argument("--only", default="idmap,train,save_load,async,delta")
    p.add_argument("--dir", default=None, help="parent of the temporary output dir")
    p.add_argument("--quick", action="store_true", help="64 MB, 200k ids, 1 round")
    p.add_argument("--json", default=None)
    p.add_argument("--commit", default=None, help="recsave commit to report (default: git)")
    args = p.parse_args(argv)
    if args.quick:
        args.size_gb, args.ids, args.rounds, args.map_repeats, args.batch = 0.064, 200_000, 1, 1, 512
        args.train_steps = 3
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        C.log("gpu.py: no CUDA device here; pass --device cpu to check the script on the CPU")
        return 2
    only = set(args.only.split(","))
    res: Dict[str, Any] = {"args": vars(args), "errors": {},
                           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "commit": args.commit or C.git_revision(),
                           "cuda_kernels": cudakernels.available() if device.type == "cuda" else None,
                           "cuda_kernels_why_not": cudakernels.unavailable_reason() if device.type == "cuda" else None}
    with C.bench_tempdir(args.dir) as work, knobs.override(fsync=False):
        res["machine"] = C.machine_info(work)
        C.check_free_space(work, 3 * args.size_gb * 1e9)
        state: Dict[str, Any] = {"model": None}

        def model() -> Model:  # the CUDA tables the later sections share (save_load's, else built)
            if state["model"] is None:
                free(device)
                state["model"] = build(args, device)
            return state["model"]

        def save_load() -> Dict[str, Any]:
            out = measure_save_load(args, device, work)
            state["model"] = out.pop("model")
            return out

        sections: List[Tuple[str, Callable[[], Any]]] = [
            ("idmap", lambda: measure_idmap(args, device)),
            ("train", lambda: measure_train(args, device)),
            ("save_load", save_load),
            ("save_rss", lambda: measure_save_rss(args, model(), device, work)),
            ("async", lambda: measure_async(args, model(), device, work)),
            ("delta", lambda: measure_delta(args, model(), device, work)),
        ]
        for name, fn in sections:
            if name not in only:
                continue
            C.clear_dir(work)
            try:
                res[name] = fn()
            except Exception:  # report it and go on with the other sections
                res["errors"][name] = traceback.format_exc()
                C.log(res["errors"][name])
        if device.type == "cuda":
            res["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    text = report(res)
    print(text, flush=True)
    path = args.json or os.path.join(C.RESULTS_DIR, "gpu-quick.json" if args.quick else "gpu.json")
    C.write_json(path, res)
    C.log(f"JSON: {path}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
