"""recsave against the alternatives on one embedding-style state: save and load through recsave's
public API (a model of HashTables, Saver.save / Saver.load into a fresh model) and through its
engine, torch.save / torch.load, torch.distributed.checkpoint, safetensors, a raw numpy write / read
of the same bytes (the physical limit) and dd (durable writes).

    python benchmarks/compare.py                 # >= 2 GB state, 3 interleaved rounds
    python benchmarks/compare.py --quick         # tiny state, 1 round: smoke test (< 60 s)
    python benchmarks/compare.py --drop-caches   # root only: cold reads
    python benchmarks/compare.py --sweep         # throughput vs state size (0.25 .. 4 GB) + plot
    python benchmarks/compare.py --profile       # cProfile of one Saver.save / Saver.load (1 GB)

Every operation runs in a fresh process (engine.py's machinery: `_common.run_isolated`, peak RSS
from the OS). Results: benchmarks/results/compare.json (keys "default" and "sweep", each updated by
its own run), compare.md (markdown tables for the README) and compare.png (the sweep).
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import engine as E  # noqa: E402  (state building and the engine-level operations are engine.py's)

C.ensure_repo_on_path()

PRELOAD = ["numpy", "torch", "torch.distributed.checkpoint", "recsave", "recsave.format", "safetensors.torch"]
Layout = List[Tuple[str, str, Tuple[int, ...]]]

# method -> (label, note, family, durable, output name)
SAVE = {
    "raw": ("raw write (ndarray.tofile)", "physical limit, no fsync", "raw", False, "raw.bin"),
    "raw_fsync": ("raw write + fsync", "file + directory fsync", "raw", True, "raw_fsync.bin"),
    "dd": ("dd bs=64M conv=fdatasync", "zeros, durable: the disk's limit", "raw", True, "dd.bin"),
    "torch": ("torch.save", "no fsync", "torch", False, "state.pt"),
    "dcp": ("DCP save, sync_files=False", "torch.distributed.checkpoint, 1 process", "dcp", False, "dcp"),
    "dcp_fsync": ("DCP save (default: sync_files)", "durable", "dcp", True, "dcp_fsync"),
    "safetensors": ("safetensors save_file", "no fsync", "safetensors", False, "state.safetensors"),
    "engine": ("recsave engine write_shards, fsync off", "CRC32C computed", "engine", False, "engine"),
    "engine_fsync": ("recsave engine write_shards, fsync on", "durable", "engine", True, "engine_fsync"),
    "saver": ("recsave Saver.save, fsync off", "HashTable model, whole API", "saver", False, "saver"),
    "saver_fsync": ("recsave Saver.save (default: fsync on)", "durable", "saver", True, "saver_fsync"),
}
# method -> (label, note, save method whose output it reads)
LOAD = {
    "raw": ("raw read (readinto)", "physical limit", "raw"),
    "torch": ("torch.load(weights_only=True)", "", "torch"),
    "dcp": ("DCP load into preallocated tensors", "", "dcp"),
    "safetensors": ("safetensors load_file(backend=pread)", "", "safetensors"),
    "engine_verify": ("recsave engine read_tensors, verify", "", "engine"),
    "engine_noverify": ("recsave engine read_tensors, no verify", "", "engine"),
    "saver": ("recsave Saver.load into a fresh model", "id map rebuilt, CRC verified", "saver"),
    "saver_noverify": ("recsave Saver.load, checksums off", "patched in: not an option", "saver"),
}
KINDS = {"save": SAVE, "load": LOAD}
FAMILIES = ["raw", "torch", "dcp", "safetensors", "engine", "saver"]
SWEEP_DEFAULT = ["save:raw", "save:torch", "save:dcp", "save:safetensors", "save:engine", "save:saver",
                 "load:raw", "load:torch", "load:dcp", "load:safetensors", "load:engine_verify", "load:saver"]
# (label, numerator, denominator, goal): throughput ratios; goals from DESIGN.md "Performance budgets"
RATIOS = [
    ("save: Saver (fsync off) / raw write", ("save", "saver"), ("save", "raw"), 0.85),
    ("save: Saver (fsync off) / torch.save", ("save", "saver"), ("save", "torch"), 4.0),
    ("save: Saver (fsync off) / DCP save (no sync)", ("save", "saver"), ("save", "dcp"), 4.0),
    ("save: Saver (fsync on) / raw write + fsync", ("save", "saver_fsync"), ("save", "raw_fsync"), 0.85),
    ("save: Saver (fsync on) / dd conv=fdatasync", ("save", "saver_fsync"), ("save", "dd"), None),
    ("save: Saver (fsync on) / DCP save (default, sync)", ("save", "saver_fsync"), ("save", "dcp_fsync"), 4.0),
    ("save: engine (fsync off) / raw write", ("save", "engine"), ("save", "raw"), 0.85),
    ("save: engine (fsync off) / torch.save", ("save", "engine"), ("save", "torch"), 4.0),
    ("save: engine (fsync off) / DCP save (no sync)", ("save", "engine"), ("save", "dcp"), 4.0),
    ("save: Saver / engine (fsync off)", ("save", "saver"), ("save", "engine"), None),
    ("load: Saver / raw read", ("load", "saver"), ("load", "raw"), 0.8),
    ("load: Saver / torch.load", ("load", "saver"), ("load", "torch"), 4.0),
    ("load: Saver / DCP load", ("load", "saver"), ("load", "dcp"), 4.0),
    ("load: engine (verify) / raw read", ("load", "engine_verify"), ("load", "raw"), 0.8),
    ("load: engine (verify) / torch.load", ("load", "engine_verify"), ("load", "torch"), 4.0),
    ("load: engine (verify) / DCP load", ("load", "engine_verify"), ("load", "dcp"), 4.0),
    ("load: Saver / engine (verify)", ("load", "saver"), ("load", "engine_verify"), None),
]
# (label, slower, faster, goal %): time(slower) / time(faster) - 1
OVERHEADS = [
    ("load checksums, engine (verify vs no verify)", ("load", "engine_verify"), ("load", "engine_noverify"), 5.0),
    ("load checksums, Saver (verify vs patched off)", ("load", "saver"), ("load", "saver_noverify"), 5.0),
    ("save: Saver fsync on vs off", ("save", "saver_fsync"), ("save", "saver"), None),
    ("save: Saver vs engine (both fsync off)", ("save", "saver"), ("save", "engine"), None),
    ("load: Saver vs engine (both verify)", ("load", "saver"), ("load", "engine_verify"), None),
]
RSS_BUDGET = 256 * C.MB  # peak RSS above the state (DESIGN.md), in the MB (1e6 bytes) the tables print


# ------------------------------------------------------------------------------------------------
# The state: tables of ids, embedding rows and optimizer slots

def slot_names(slots: int) -> List[str]:
    return {0: [], 1: ["adagrad_acc"], 2: ["adam_m", "adam_v"]}.get(slots, [f"slot_{j}" for j in range(slots)])


def state_layout(size_bytes: int, tables: int, dim: int, slots: int, rows: Optional[int] = None) -> Layout:
    """Per table: int64 ids [rows], float32 weight [rows, dim] and `slots` float32 [rows, dim] slots;
    `rows` per table, else sized to about `size_bytes` in all. engine.build_state fills it."""
    rows = rows or max(1, size_bytes // (tables * (8 + 4 * dim * (1 + slots))))
    out: Layout = []
    for i in range(tables):
        out += [(f"table_{i}.ids", "int64", (rows,)), (f"table_{i}.weight", "float32", (rows, dim))]
        out += [(f"table_{i}.{s}", "float32", (rows, dim)) for s in slot_names(slots)]
    return out


def build_model(layout: Layout, seed: int, fill: bool) -> Any:
    """A ModuleDict of recsave.HashTables matching `layout`; with `fill`, holding exactly the ids and
    values engine.build_state(layout, seed) makes (rows filled in place: no second copy)."""
    import torch
    import recsave

    g = torch.Generator().manual_seed(seed)
    model, views = torch.nn.ModuleDict(), {}
    columns = defaultdict(list)
    for name, _dtype, _shape in layout:
        table, col = name.split(".", 1)
        if col != "ids":
            columns[table].append("embedding" if col == "weight" else col)
    for k, (name, _dtype, shape) in enumerate(layout):
        table, col = name.split(".", 1)
        if col == "ids":
            t = model[table] = recsave.HashTable(layout[k + 1][2][1], name=table)
            for slot in columns[table][1:]:
                t.add_slot(slot)
            if fill:
                ids = torch.arange(shape[0]).mul_(len(layout)).add_(k)  # as engine.build_state
                views = t.prepare_load(ids, columns[table])
                if views is None:
                    raise RuntimeError(f"{table}: HashTable.prepare_load refused the ids")
        elif fill:
            views["embedding" if col == "weight" else col].uniform_(-0.05, 0.05, generator=g)
    return model


def model_mismatches(model: Any, layout: Layout, seed: int) -> List[str]:
    """Names of `layout` whose values in the model's tables differ from engine.build_state's."""
    import torch

    expected, bad = E.build_state(layout, seed), []
    for k, (name, _dtype, _shape) in enumerate(layout):
        table, col = name.split(".", 1)
        if col != "ids":
            continue
        t = model[table]
        ids, rows = t.id_rows()
        pos = (ids - k) // len(layout)
        if ids.numel() != expected[name].numel() or not torch.equal(expected[name][pos], ids):
            bad.append(name)
            continue
        for other, _, _ in layout:
            if other.startswith(table + ".") and other != name:
                c = other.split(".", 1)[1]
                storage = t.weight if c == "weight" else t.slot(c)
                if not torch.equal(storage.index_select(0, rows), expected[other].index_select(0, pos)):
                    bad.append(other)
    return bad


# ------------------------------------------------------------------------------------------------
# Operations (inside a fresh worker process; only these are timed)

def _save(method: str, spec: Dict[str, Any], state: Any, model: Any) -> None:
    path = spec["path"]
    if method in ("raw", "raw_fsync", "torch", "safetensors"):
        E._save(method, spec, state)
    elif method in ("engine", "engine_fsync"):
        E._save(method.replace("engine", "recsave"), spec, state)
    elif method == "dd":
        import subprocess
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={spec['dd_count']}",
                        "conv=fdatasync", "status=none"], check=True)
    elif method in ("dcp", "dcp_fsync"):
        import warnings
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=method == "dcp_fsync"))
    elif method in ("saver", "saver_fsync"):
        from recsave import knobs
        with knobs.override(fsync=method == "saver_fsync"):
            spec["saver"].save("ckpt_1")
    else:
        raise ValueError(method)


def _load(method: str, spec: Dict[str, Any], layout: Layout, dest: Any) -> Any:
    if method in ("raw", "torch", "safetensors"):
        return E._load(method, spec, layout)
    if method in ("engine_verify", "engine_noverify"):
        return E._load(method.replace("engine", "recsave"), spec, layout)
    if method == "dcp":
        import warnings
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(dest, checkpoint_id=spec["path"])
        return dest
    if method in ("saver", "saver_noverify"):
        return spec["saver"].load()
    raise ValueError(method)


def _patch_no_verify() -> List[int]:
    """Saver.load always verifies; for the checksum-overhead row, make the reads it does skip the
    CRC (recsave.sources.read_tensors with verify=False). Returns a call counter: [0] = not applied."""
    import recsave.sources as sources

    calls = [0]
    original = getattr(sources, "read_tensors", None)
    if original is None:
        return calls

    def unverified(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        kwargs["verify"] = False
        return original(*args, **kwargs)

    sources.read_tensors = unverified
    return calls


def worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    import resource

    import numpy as np
    import torch

    with np.errstate(all="ignore"):  # engine's warm-up sums uninitialised memory
        E._warm_up()
    kind, method, layout = spec["kind"], spec["method"], spec["layout"]
    nbytes = E.payload_bytes(layout)
    state = model = dest = None
    patched = None
    if kind == "save" and method.startswith("saver"):
        model = build_model(layout, spec["seed"], fill=True)
    elif kind == "save" and method != "dd":
        state = E.build_state(layout, spec["seed"])
    elif kind == "load" and method.startswith("saver"):
        model = build_model(layout, spec["seed"], fill=False)
        patched = _patch_no_verify() if method == "saver_noverify" else None
    elif kind == "load" and method == "dcp":
        dest = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in layout}  # pages not touched yet
    if model is not None:
        import recsave
        spec["saver"] = recsave.Saver(model, output_dir=spec["path"], max_keep=None,
                                      concurrency=spec["concurrency"])
    if kind == "save" and method.startswith("engine"):
        os.makedirs(spec["path"], exist_ok=True)
    prefault_s = C.prefault_memory(int(1.25 * nbytes), spec["scratch"]) if spec["prefault"] else 0.0
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with C.MeasureOp() as m:
        out = _save(method, spec, state, model) if kind == "save" else _load(method, spec, layout, dest)
    res = m.result()
    res.update(nbytes=nbytes, prefault_s=prefault_s, torch_threads=torch.get_num_threads())
    if method == "dd":  # the work is dd's: its CPU. Its peak RSS is not known: the child's ru_maxrss
        # counts the worker's pages before the exec, so the RSS columns show n/a.
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime
        res.update(nbytes=spec["dd_count"] * (64 << 20), cpu_s=cpu, others_cpu_s=max(0.0, res["others_cpu_s"] - cpu),
                   rss_delta=0)
    res["rss_over_state"] = res["rss_delta"] - (nbytes if kind == "load" else 0)
    if patched is not None:
        res["verify_patched_calls"] = patched[0]
    if "saver" in spec:
        spec.pop("saver").close()
    if kind == "save":
        p = spec["path"]
        res["file_bytes"] = (sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)
                             if os.path.isdir(p) else os.path.getsize(p))
    if kind == "load" and spec["check"]:
        if model is not None:
            bad = model_mismatches(model, layout, spec["seed"])
        else:
            expected = E.build_state(layout, spec["seed"])
            bad = [n for n, t in expected.items() if n not in out or out[n].dtype != t.dtype
                   or out[n].shape != t.shape or not torch.equal(out[n], t)]
        res["check"] = {"ok": not bad, "mismatched": bad}
    return res


# ------------------------------------------------------------------------------------------------
# Orchestration

def selected(only: Optional[str], default: Optional[List[str]] = None) -> Dict[str, List[str]]:
    """kind -> methods; loads pull in the save whose output they read."""
    wanted = set(only.split(",")) if only and only != "all" else set(default or [])
    methods = {k: [m for m in t if not wanted or f"{k}:{m}" in wanted] for k, t in KINDS.items()}
    unknown = wanted - {f"{k}:{m}" for k, t in KINDS.items() for m in t}
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; known: "
                         f"{', '.join(f'{k}:{m}' for k, t in KINDS.items() for m in t)}")
    for m in methods["load"]:
        if LOAD[m][2] not in methods["save"]:
            methods["save"].append(LOAD[m][2])
    return methods


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def run_rounds(args: argparse.Namespace, tmp: str, layout: Layout, methods: Dict[str, List[str]], repeats: int,
               drop: bool, tag: str = "") -> Tuple[Dict[Tuple[str, str], List[Dict[str, Any]]], List[str]]:
    """`repeats` rounds; a round takes the families (raw, torch, dcp, ...) in an order rotated per
    round, and per family its saves, then its loads of the file just written, then deletes it, so the
    page cache holds one family's output at a time."""
    samples: Dict[Tuple[str, str], List[Dict[str, Any]]] = defaultdict(list)
    failures: List[str] = []
    nbytes = E.payload_bytes(layout)
    timeout = 180 + 240 * nbytes / C.GB
    base = {"layout": layout, "seed": args.seed, "concurrency": args.concurrency, "segment_bytes": None,
            "prefault": args.prefault, "scratch": tmp, "dd_count": -(-nbytes // (64 << 20)), "check": False}
    for r in range(repeats):
        for family in C.rounds_order(FAMILIES, r):
            if args.wait_quiet:  # before each family, not only at the start: others come and go
                C.settle()
                C.wait_until_quiet(args.wait_quiet, window_s=1.0)
            saves = [m for m in methods["save"] if SAVE[m][2] == family]
            loads = [m for m in methods["load"] if SAVE[LOAD[m][2]][2] == family]
            out = {m: os.path.join(tmp, SAVE[m][4]) for m in saves}
            for method in C.rounds_order(saves, r):
                C.settle()
                res = C.run_isolated(worker, dict(base, kind="save", method=method, path=out[method]),
                                     timeout=timeout, preload=PRELOAD)
                samples[("save", method)].append(res)
                speed = C.gbps(res["nbytes"], res["seconds"])
                C.log(f"{tag}[round {r + 1}/{repeats}] save {method:16s} {speed:6.2f} GB/s"
                      f"  RSS over state {res['rss_over_state'] / C.MB:6.0f} MB")
                if method not in {LOAD[m][2] for m in loads}:
                    remove(out[method])
            for method in C.rounds_order(loads, r):
                dropped = C.settle(drop)
                src = out[LOAD[method][2]]
                cached = C.cached_fraction(src)
                res = C.run_isolated(worker, dict(base, kind="load", method=method, path=src, check=r == 0),
                                     timeout=timeout, preload=PRELOAD)
                res.update(cache_dropped=dropped, cached_fraction=cached)
                samples[("load", method)].append(res)
                if "check" in res and not res["check"]["ok"]:
                    failures.append(f"load {method}: round trip mismatch in {res['check']['mismatched']}")
                if res.get("verify_patched_calls") == 0:
                    failures.append("load saver_noverify: the verify=False patch was not applied (sources.py changed?)")
                speed = C.gbps(res["nbytes"], res["seconds"])
                C.log(f"{tag}[round {r + 1}/{repeats}] load {method:16s} {speed:6.2f} GB/s"
                      f"  RSS over state {res['rss_over_state'] / C.MB:6.0f} MB  page cache "
                      f"{C.fmt_num(None if cached is None else 100 * cached, 0)} %"
                      + ("" if "check" not in res else "  round trip " + ("ok" if res["check"]["ok"] else "MISMATCH")))
            for path in out.values():
                remove(path)
    return samples, failures


def summarize(samples: Dict[Tuple[str, str], List[Dict[str, Any]]]) -> Dict[Tuple[str, str], Dict[str, Any]]:
    summary = E.summarize(samples)
    for key, runs in samples.items():
        s = summary[key]
        s["rss_over_state_max"] = max(x["rss_over_state"] for x in runs)
        s["rss_over_state_median"] = C.median([x["rss_over_state"] for x in runs])
        fr = [x["cached_fraction"] for x in runs if x.get("cached_fraction") is not None]
        s["cached_fraction_median"] = C.median(fr) if fr else None
        s["nbytes"] = runs[0]["nbytes"]
    return summary


def ratio_rows(summary: Dict[Tuple[str, str], Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    ratios, overheads = [], []
    for label, num, den, goal in RATIOS:
        if num in summary and den in summary:
            v = summary[num]["median_gbps"] / summary[den]["median_gbps"]
            ratios.append({"label": label, "value": v, "goal": goal, "met": None if goal is None else v >= goal})
    for label, slow, fast, goal in OVERHEADS:
        if slow in summary and fast in summary:
            v = 100 * (summary[slow]["median_s"] / summary[fast]["median_s"] - 1)
            overheads.append({"label": label, "value_pct": v, "goal_pct": goal,
                              "met": None if goal is None else v <= goal})
    return ratios, overheads


# ------------------------------------------------------------------------------------------------
# Reports

def _ref(kind: str, method: str) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """Like-for-like references (raw, torch, DCP) of a row: durable saves against durable ones."""
    if kind == "load":
        return "raw", "torch", "dcp"
    return ("raw_fsync", None, "dcp_fsync") if SAVE[method][3] else ("raw", "torch", "dcp")


def main_table(summary: Dict[Tuple[str, str], Dict[str, Any]]) -> Tuple[List[str], List[List[str]]]:
    headers = ["op", "method", "GB/s", "min-max GB/s", "median s", "x raw", "x torch", "x DCP", "CPU/wall",
               "peak RSS over state MB", "page cache", "note"]
    rows = []
    for kind, table in KINDS.items():
        for method, spec in table.items():
            s = summary.get((kind, method))
            if s is None:
                continue
            rel = [C.fmt_num(s["median_gbps"] / summary[(kind, r)]["median_gbps"], 2, "x")
                   if r and (kind, r) in summary and r != method else "" for r in _ref(kind, method)]
            cached = s.get("cached_fraction_median")
            rows.append([kind, spec[0], C.fmt_num(s["median_gbps"]),
                         f"{C.fmt_num(s['worst_gbps'])}-{C.fmt_num(s['best_gbps'])}", C.fmt_num(s["median_s"], 3),
                         *rel, C.fmt_num(s["cpu_per_wall_median"]),
                         "n/a" if method == "dd" else C.fmt_num(s["rss_over_state_max"] / C.MB, 0),
                         "" if cached is None else f"{100 * cached:.0f} %", spec[1]])
    return headers, rows


def budget_rows(d: Dict[str, Any]) -> Tuple[List[str], List[List[str]]]:
    rows = []
    for r in d["ratios"]:
        rows.append([r["label"], C.fmt_num(r["value"], 2, "x"), "" if r["goal"] is None else f">= {r['goal']:g}x",
                     "" if r["met"] is None else ("MET" if r["met"] else "MISSED")])
    for o in d["overheads"]:
        rows.append([o["label"], C.fmt_num(o["value_pct"], 1, " %"),
                     "" if o["goal_pct"] is None else f"<= {o['goal_pct']:g} %",
                     "" if o["met"] is None else ("MET" if o["met"] else "MISSED")])
    for x in d["results"]:
        if x["method"].startswith(("saver", "engine")):
            over = x["rss_over_state_max"]
            rows.append([f"peak RSS over state, {x['label']}", f"{over / C.MB:.0f} MB", "<= 256 MB",
                         "MET" if over <= RSS_BUDGET else "MISSED"])
    return ["budget", "value", "goal", ""], rows


def default_header(d: Dict[str, Any]) -> List[str]:
    cfg, m, n = d["config"], d["machine"], d["noise"]
    lines = [f"State: {d['payload_bytes'] / C.GB:.3f} GB = {cfg['tables']} tables x {d['rows_per_table']} rows x "
             f"(int64 id + float32 embedding[{cfg['dim']}] + {cfg['slots']} float32 slot(s)); "
             f"{cfg['repeats']} interleaved round(s), medians; recsave concurrency {cfg['concurrency']}.",
             f"Machine: {m['cpus']} CPUs ({m['cpu']}), {(m['memory_bytes'] or 0) / 2**30:.0f} GiB RAM, {m['fs']}, "
             f"torch {m['torch']}, safetensors {m['safetensors']}; recsave at {d.get('commit')}.",
             f"Reads: {d['reads']}.",
             "Writes: each to a fresh file after `sync`; rows without fsync end in the page cache.",
             f"Noise: {n['busy_before_cpus']:.2f} CPUs busy before start; other tasks used a median "
             f"{n['others_cpu_share_median']:.0%} of a CPU during the operations (kernel writeback of the saves "
             f"included), {n.get('others_cpu_share_loads', float('nan')):.0%} during the loads; load average "
             f"{n['loadavg_start']:.2f} -> {n['loadavg_end']:.2f}"
             + ("  ** machine busy: figures are noisy **"
                if n.get("others_cpu_share_loads", n["others_cpu_share_median"]) > 0.2 else "")]
    return lines


def default_markdown(d: Dict[str, Any]) -> str:
    h, rows = d["table"]
    bh, brows = budget_rows(d)
    return "\n".join(["### Save and load, one state", ""] + [f"{x}  " for x in default_header(d)] + [
        "", C.markdown_table(h, rows, "llrrrrrrrrrl"), "", C.markdown_table(bh, brows, "lrrl")])


def sweep_markdown(s: Dict[str, Any]) -> str:
    sizes = s["sizes_gb"]
    headers = ["op", "method"] + [f"{g:g} GB" for g in sizes] + ["s/GB (fit)", "R^2", "s/GB spread"]
    rows = [[x["kind"], x["label"]] + [C.fmt_num(p["median_gbps"]) if p else "" for p in x["points"]]
            + [C.fmt_num(x["fit"]["slope"], 3), C.fmt_num(x["fit"]["r2"], 4), C.fmt_num(x["spread_pct"], 1, " %")]
            for x in s["methods"]]
    return "\n".join([
        "### Throughput (GB/s, median) against state size", "",
        f"{s['repeats']} round(s) per size; reads {s['reads']}; noise: other tasks used a median "
        f"{s['others_cpu_share_median']:.0%} of a CPU. *s/GB (fit)*: slope of a least-squares line through "
        "time against size (all samples); *R^2* of that line; *s/GB spread*: (max - min) / median of time per "
        "GB over the sizes.", "", C.markdown_table(headers, rows, "ll" + "r" * (len(headers) - 2))])


def write_markdown(path: str, data: Dict[str, Any]) -> None:
    parts = [default_markdown(data["default"])] if "default" in data else []
    if "sweep" in data:
        parts.append(sweep_markdown(data["sweep"]))
    C.write_text(path, "\n\n".join(parts) + "\n")


def plot_sweep(s: Dict[str, Any], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        C.log("matplotlib is not installed (pip install -e '.[bench]'): no plot, the JSON and tables are written")
        return None
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for col, kind in enumerate(("save", "load")):
        for x in (x for x in s["methods"] if x["kind"] == kind):
            pts = [(p["payload_gb"], p["median_gbps"], p["median_s"]) for p in x["points"] if p]
            line, = axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=x["label"])
            axes[1][col].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", ls="none", color=line.get_color())
            f = x["fit"]
            if not math.isnan(f["slope"]):
                xs = [0, max(p[0] for p in pts)]
                axes[1][col].plot(xs, [f["intercept"] + f["slope"] * v for v in xs], color=line.get_color(),
                                  lw=1, label=f"{x['label']} (R^2 {f['r2']:.3f})")
        axes[0][col].set(xscale="log", xlabel="state size (GB)", ylabel="GB/s (median)", title=f"{kind}: throughput")
        axes[0][col].set_xticks(s["sizes_gb"], [f"{g:g}" for g in s["sizes_gb"]])
        axes[0][col].minorticks_off()
        axes[1][col].set(xlabel="state size (GB)", ylabel="seconds (median)", title=f"{kind}: time, linear fit")
        for ax in axes[:, col]:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"recsave compare sweep (reads {s['reads'].split(' ')[0]})")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------
# Runs

def reads_label(samples: Dict[Tuple[str, str], List[Dict[str, Any]]]) -> str:
    loads = [x for k, v in samples.items() if k[0] == "load" for x in v]
    fr = [x["cached_fraction"] for x in loads if x.get("cached_fraction") is not None]
    share = f"{100 * C.median(fr):.0f} % of the file's pages in the page cache before a load (median)" if fr else ""
    if loads and all(x.get("cache_dropped") for x in loads):
        return f"cold (page cache dropped before every load; {share})"
    return f"warm ({share}; the file was just written, reads come from RAM)"


def noise_of(samples: Dict[Tuple[str, str], List[Dict[str, Any]]], kind: Optional[str] = None) -> float:
    """Median share of a CPU that other tasks used during the operations (of one kind)."""
    return C.median([x["others_cpu_s"] / x["seconds"] for k, v in samples.items() if kind in (None, k[0]) for x in v])


def run_default(args: argparse.Namespace, tmp: str, drop: bool, busy: float) -> Dict[str, Any]:
    layout = state_layout(int(args.size_gb * C.GB), args.tables, args.dim, args.slots, args.rows)
    load0 = os.getloadavg()[0]
    samples, failures = run_rounds(args, tmp, layout, selected(args.only), args.repeats, drop)
    summary = summarize(samples)
    ratios, overheads = ratio_rows(summary)
    d = {"config": {k: v for k, v in vars(args).items() if k not in ("json",)},
         "payload_bytes": E.payload_bytes(layout), "rows_per_table": layout[0][2][0], "layout": layout,
         "machine": C.machine_info(tmp), "commit": args.commit, "reads": reads_label(samples),
         "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
         "results": [{"kind": k, "method": m, "label": KINDS[k][m][0], "note": KINDS[k][m][1], **summary[(k, m)],
                      "samples": samples[(k, m)]} for k, t in KINDS.items() for m in t if (k, m) in summary],
         "ratios": ratios, "overheads": overheads, "failures": failures,
         "noise": {"busy_before_cpus": busy, "loadavg_start": load0, "loadavg_end": os.getloadavg()[0],
                   "others_cpu_share_median": noise_of(samples), "others_cpu_share_loads": noise_of(samples, "load")}}
    d["table"] = main_table(summary)
    return d


def run_sweep(args: argparse.Namespace, tmp: str, drop: bool) -> Dict[str, Any]:
    methods = selected(args.sweep_methods, SWEEP_DEFAULT)
    per_size, failures, all_samples = [], [], defaultdict(list)
    for gb in args.sizes:
        layout = state_layout(int(gb * C.GB), args.tables, args.dim, args.slots)
        C.check_free_space(tmp, 3.5 * E.payload_bytes(layout) + (1 << 28))
        samples, f = run_rounds(args, tmp, layout, methods, args.sweep_repeats, drop, tag=f"[{gb:g} GB]")
        failures += f
        per_size.append((E.payload_bytes(layout), summarize(samples), samples))
        for k, v in samples.items():
            all_samples[k] += v
    out = []
    for kind, table in KINDS.items():
        for method in methods[kind]:
            key = (kind, method)
            points = [None if key not in s else
                      {"payload_gb": n / C.GB, "seconds": [x["seconds"] for x in smp[key]],
                       **{f: s[key][f] for f in ("median_s", "median_gbps", "min_s", "max_s", "rss_over_state_max")}}
                      for n, s, smp in per_size]
            xs = [p["payload_gb"] for p in points if p for _ in p["seconds"]]
            ys = [t for p in points if p for t in p["seconds"]]
            per_gb = [p["median_s"] / p["payload_gb"] for p in points if p]
            out.append({"kind": kind, "method": method, "label": table[method][0], "points": points,
                        "fit": C.linear_fit(xs, ys),
                        "spread_pct": 100 * (max(per_gb) - min(per_gb)) / C.median(per_gb) if per_gb else None})
    return {"sizes_gb": args.sizes, "repeats": args.sweep_repeats, "commit": args.commit, "config": dict(vars(args)),
            "reads": reads_label(all_samples), "others_cpu_share_median": noise_of(all_samples),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "methods": out, "failures": failures}


def profile_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """cProfile of one Saver.save (fsync off) and one Saver.load into a fresh model."""
    import cProfile
    import io
    import pstats
    import recsave

    layout, out = spec["layout"], {}
    for what in ("save", "load"):
        model = build_model(layout, spec["seed"], fill=what == "save")
        saver = recsave.Saver(model, output_dir=spec["path"], max_keep=None, concurrency=spec["concurrency"])
        prof = cProfile.Profile()
        with recsave.knobs.override(fsync=False):
            start = time.perf_counter()
            prof.runcall(saver.save if what == "save" else saver.load, *(["ckpt_1"] if what == "save" else []))
            seconds = time.perf_counter() - start
        saver.close()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(spec["top"])
        stats.sort_stats("cumulative").print_stats(spec["top"])
        out[what] = {"seconds": seconds, "stats": text.getvalue()}
        del model, saver
    return out


def run_profile(args: argparse.Namespace, tmp: str) -> None:
    layout = state_layout(int(args.profile_gb * C.GB), args.tables, args.dim, args.slots)
    res = C.run_isolated(profile_worker, {"layout": layout, "seed": args.seed, "path": os.path.join(tmp, "saver"),
                                          "concurrency": args.concurrency, "top": 25},
                         timeout=600 + 600 * args.profile_gb, preload=PRELOAD)
    nbytes = E.payload_bytes(layout)
    text = []
    for what in ("save", "load"):
        text.append(f"==== Saver.{what} of {nbytes / C.GB:.3f} GB (fsync off, warm): {res[what]['seconds']:.2f} s, "
                    f"{C.gbps(nbytes, res[what]['seconds']):.2f} GB/s, under cProfile ====")
        text.append(res[what]["stats"])
    path = C.write_text(args.json.replace(".json", "-profile.txt"), "\n".join(text))
    print("\n".join(text) + f"\nprofile: {os.path.relpath(path)}")


# ------------------------------------------------------------------------------------------------

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=None, help="state size in GB (1e9 bytes); default 2.05")
    p.add_argument("--rows", type=int, default=None, help="rows per table (instead of --size-gb)")
    p.add_argument("--tables", type=int, default=4, help="tables (default 4)")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--slots", type=int, default=1, help="optimizer slots per table, each [rows, dim] (default 1)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    p.add_argument("--concurrency", type=int, default=4, help="recsave engine / Saver threads (default 4)")
    p.add_argument("--only", default=None, help="comma-separated kind:method, e.g. save:saver,load:saver")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny states, 1 round (< 60 s)")
    p.add_argument("--drop-caches", action="store_true", help="root only: drop the page cache before each load")
    p.add_argument("--no-prefault", dest="prefault", action="store_false",
                   help="skip cycling 1.25x the state through memory before each operation (benchmarks/README.md)")
    p.add_argument("--sweep", action="store_true", help="measure throughput against state size instead")
    p.add_argument("--sizes", default=None, help="sweep sizes in GB (default 0.25,0.5,1,2,4)")
    p.add_argument("--sweep-repeats", type=int, default=None, help="rounds per sweep size (default 2)")
    p.add_argument("--sweep-methods", default=None,
                   help=f"kind:method list for the sweep, or 'all' (default {','.join(SWEEP_DEFAULT)})")
    p.add_argument("--profile", action="store_true", help="cProfile one Saver.save and Saver.load instead")
    p.add_argument("--profile-gb", type=float, default=1.0, help="state size of --profile (default 1 GB)")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                   help="wait up to S seconds for other processes to go quiet before measuring, and again "
                        "before each method family")
    p.add_argument("--dir", default=None, help="parent of the temporary directory (removed afterwards)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="results file (default results/compare.json, -quick with --quick)")
    a = p.parse_args(argv)
    a.size_gb = a.size_gb or (0.064 if a.quick else 2.05)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.sweep_repeats = a.sweep_repeats or (1 if a.quick else 2)
    a.sizes = [float(x) for x in (a.sizes or ("0.016,0.032,0.064" if a.quick else "0.25,0.5,1,2,4")).split(",")]
    a.json = a.json or os.path.join(C.RESULTS_DIR, "compare-quick.json" if a.quick else "compare.json")
    if min(a.size_gb, a.repeats, a.tables, a.dim, a.concurrency, a.sweep_repeats, *a.sizes) <= 0 or a.slots < 0:
        p.error("sizes, --repeats, --tables, --dim, --concurrency must be positive and --slots >= 0")
    return a


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    args.commit = C.git_revision()  # what the workers import (the forkserver imports recsave once)
    drop = args.drop_caches and C.can_drop_caches()
    if args.drop_caches and not drop:
        C.log("--drop-caches needs root: reads stay warm")
    with C.bench_tempdir(args.dir, prefix="recsave-compare-") as tmp:
        if args.profile:
            run_profile(args, tmp)
            return 0
        largest = max(args.sizes + [args.size_gb])
        C.check_free_space(tmp, 3.5 * largest * C.GB + (1 << 28))
        quiet = C.wait_until_quiet(args.wait_quiet)
        C.log(f"temporary directory {tmp}; other processes busy {quiet['busy_cpus']:.2f} CPUs")
        # --sweep replaces the default run; --quick smoke-tests both
        keys = ["sweep"] if args.sweep else (["default", "sweep"] if args.quick else ["default"])
        results = {k: run_sweep(args, tmp, drop) if k == "sweep" else run_default(args, tmp, drop, quiet["busy_cpus"])
                   for k in keys}
    for key, d in results.items():
        data = C.update_json(args.json, key, d)
        if key == "sweep":
            print(sweep_markdown(d))
            png = plot_sweep(d, args.json.replace(".json", ".png"))
            print(f"\nplot: {os.path.relpath(png)}" if png else "\nplot: skipped (no matplotlib)")
        else:
            h, rows = d["table"]
            bh, brows = budget_rows(d)
            print("\n".join(default_header(d)) + "\n\n" + C.text_table(h, rows, "llrrrrrrrrrl") + "\n\n"
                  + C.text_table(bh, brows, "lrrl") + "\n\nMarkdown:\n\n" + default_markdown(d) + "\n")
    md = args.json.replace(".json", ".md")
    write_markdown(md, data)
    print(f"\nJSON: {os.path.relpath(args.json)} ({', '.join(keys)})   markdown: {os.path.relpath(md)}")
    failures = [f for d in results.values() for f in d["failures"]]
    if failures:
        print("\nFAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
