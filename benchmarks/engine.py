"""Engine benchmark: recsave's shard writer / reader against torch.save / torch.load, safetensors
and a raw numpy write / read of the same bytes (the physical limit), on one state of >= 1 GB.

    python benchmarks/engine.py                 # 1 GB, 3 interleaved rounds
    python benchmarks/engine.py --quick         # 64 MB, 1 round: smoke test (< 30 s)
    python benchmarks/engine.py --drop-caches   # root only: cold reads (drops the page cache)
    python benchmarks/engine.py --sweep         # also sweep recsave's concurrency / segment size

Every measured operation runs in a fresh process (forked from a clean forkserver) that builds or
loads the state itself; only the operation is timed, and its peak RSS is reported above the RSS the
process had just before it. Each round runs every method once (order rotated per round); the
figures are medians over rounds. Results go to benchmarks/results/engine.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

C.ensure_repo_on_path()

# Modules the forkserver imports once, so each measured process starts warm.
PRELOAD = ["numpy", "torch", "recsave.format", "safetensors.torch"]

# (kind, method) -> label, note. Order = table order.
SAVE = {
    "raw": ("raw write (ndarray.tofile)", "raw baseline, no fsync"),
    "raw_chunked": ("raw write, fallocate + 4 MiB os.write", "recsave's I/O pattern minus CRC/threads"),
    "raw_fsync": ("raw write + os.fsync", "file + directory fsync"),
    "torch": ("torch.save", "no fsync"),
    "safetensors": ("safetensors save_file", "no fsync"),
    "recsave": ("recsave write_shards, fsync off", "CRC32C computed"),
    "recsave_fsync": ("recsave write_shards, fsync on", "default: durable"),
}
LOAD = {
    "raw": ("raw read (readinto)", "raw baseline"),
    "torch": ("torch.load(weights_only=True)", ""),
    "safetensors": ("safetensors load_file(backend=pread)", "copied into memory"),
    "safetensors_mmap": ("safetensors load_file (mmap)", "lazy, zero-copy: pages only mapped"),
    "recsave_verify": ("recsave read_tensors, verify", "default"),
    "recsave_noverify": ("recsave read_tensors, no verify", ""),
}
MEMORY = {
    "crc32c": ("CRC32C of all bytes, 1 thread", "in memory, no I/O"),
    "memcpy": ("copy into fresh buffers", "in memory; warm-read ceiling"),
}
KINDS = {"save": SAVE, "load": LOAD, "memory": MEMORY}
# Which save output each load reads.
LOAD_SOURCE = {"raw": "raw", "torch": "torch", "safetensors": "safetensors",
               "safetensors_mmap": "safetensors", "recsave_verify": "recsave", "recsave_noverify": "recsave"}
OUTPUT_NAME = {"raw": "raw.bin", "raw_chunked": "raw_chunked.bin", "raw_fsync": "raw_fsync.bin", "torch": "state.pt",
               "safetensors": "state.safetensors", "recsave": "recsave", "recsave_fsync": "recsave_fsync"}

# (key, label, numerator, denominator, goal)
RATIOS = [
    ("save_vs_raw", "save: recsave (fsync off) / raw write", ("save", "recsave"), ("save", "raw"), 0.85),
    ("save_vs_raw_chunked", "save: recsave (fsync off) / raw write, fallocate + 4 MiB", ("save", "recsave"),
     ("save", "raw_chunked"), None),
    ("save_vs_torch", "save: recsave (fsync off) / torch.save", ("save", "recsave"), ("save", "torch"), 4.0),
    ("save_vs_safetensors", "save: recsave (fsync off) / safetensors", ("save", "recsave"),
     ("save", "safetensors"), None),
    ("save_fsync_vs_raw_fsync", "save: recsave (fsync on) / raw write + fsync", ("save", "recsave_fsync"),
     ("save", "raw_fsync"), None),
    ("load_vs_raw", "load: recsave (verify) / raw read", ("load", "recsave_verify"), ("load", "raw"), 0.8),
    ("load_noverify_vs_raw", "load: recsave (no verify) / raw read", ("load", "recsave_noverify"),
     ("load", "raw"), None),
    ("load_vs_torch", "load: recsave (verify) / torch.load", ("load", "recsave_verify"), ("load", "torch"), None),
    ("load_vs_safetensors", "load: recsave (verify) / safetensors (pread)", ("load", "recsave_verify"),
     ("load", "safetensors"), None),
]
# (key, label, slower, faster): time(slower) / time(faster) - 1, in percent
OVERHEADS = [
    ("load_checksum_overhead_pct", "load: checksum overhead (verify on vs off)",
     ("load", "recsave_verify"), ("load", "recsave_noverify")),
    ("save_overhead_vs_raw_pct", "save: recsave (CRC in the write pass) vs raw write",
     ("save", "recsave"), ("save", "raw")),
    ("save_fsync_cost_pct", "save: recsave fsync on vs off", ("save", "recsave_fsync"), ("save", "recsave")),
    ("crc_alone_vs_raw_write_pct", "CRC32C alone (1 thread) as % of raw write time",
     ("memory", "crc32c"), None),
]


# ------------------------------------------------------------------------------------------------
# The state: a few embedding tables (ids, weights, one optimizer slot)

def state_layout(total_bytes: int, tables: int, dim: int) -> List[Tuple[str, str, Tuple[int, ...]]]:
    """[(name, dtype name, shape)]: `tables` tables of int64 ids, float32 [rows, dim] weights and a
    float32 [rows, dim] optimizer slot, totalling about `total_bytes`."""
    row_bytes = 8 + 2 * 4 * dim
    rows = max(1, total_bytes // (tables * row_bytes))
    out = []
    for i in range(tables):
        out += [(f"table_{i}.ids", "int64", (rows,)),
                (f"table_{i}.weight", "float32", (rows, dim)),
                (f"table_{i}.optim.momentum", "float32", (rows, dim))]
    return out


def payload_bytes(layout: List[Tuple[str, str, Tuple[int, ...]]]) -> int:
    total = 0
    for _name, dtype, shape in layout:
        n = 8 if dtype == "int64" else 4
        for d in shape:
            n *= d
        total += n
    return total


def build_state(layout: List[Tuple[str, str, Tuple[int, ...]]], seed: int) -> Dict[str, Any]:
    """Deterministic tensors, filled in place (no temporaries, so no transient RSS peak)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, (name, dtype, shape) in enumerate(layout):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        if dtype == "int64":
            torch.arange(shape[0], out=t)
            t.mul_(len(layout)).add_(k)  # ids unique across tables
        else:
            t.uniform_(-0.05, 0.05, generator=g)
        out[name] = t
    return out


# ------------------------------------------------------------------------------------------------
# Operations (run inside a worker; only these are timed)

def _save(method: str, spec: Dict[str, Any], state: Dict[str, Any]) -> None:
    import torch

    path = spec["path"]
    if method == "raw_chunked":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.posix_fallocate(fd, 0, sum(t.nbytes for t in state.values()))
            for t in state.values():
                view = memoryview(t.numpy()).cast("B")
                for b in range(0, len(view), 4 << 20):
                    piece = view[b:b + (4 << 20)]
                    while piece:
                        piece = piece[os.write(fd, piece):]
        finally:
            os.close(fd)
    elif method in ("raw", "raw_fsync"):
        with open(path, "wb") as f:
            for t in state.values():
                t.numpy().tofile(f)
            if method == "raw_fsync":
                f.flush()
                os.fsync(f.fileno())
        if method == "raw_fsync":
            dfd = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    elif method == "torch":
        torch.save(state, path)
    elif method == "safetensors":
        from safetensors.torch import save_file
        save_file(state, path)
    elif method in ("recsave", "recsave_fsync"):
        from recsave import format as fmt
        from recsave import knobs
        knob = {"fsync": method == "recsave_fsync"}
        if spec.get("segment_bytes"):
            knob["segment_bytes"] = spec["segment_bytes"]
        with knobs.override(**knob):
            spec["segment_bytes_used"] = knobs.get("segment_bytes")
            part = fmt.write_shards(path, state, concurrency=spec["concurrency"])
            fmt.write_index(path, fmt.merge_parts([part]))
    else:
        raise ValueError(method)


def _load(method: str, spec: Dict[str, Any], layout: List[Tuple[str, str, Tuple[int, ...]]]) -> Dict[str, Any]:
    import torch

    path = spec["path"]
    if method == "raw":
        out = {}
        with open(path, "rb", buffering=0) as f:
            for name, dtype, shape in layout:
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                view = memoryview(t.numpy()).cast("B")
                done = 0
                while done < len(view):
                    n = f.readinto(view[done:])
                    if not n:
                        raise EOFError(f"{path}: short read")
                    done += n
                out[name] = t
        return out
    if method == "torch":
        return torch.load(path, weights_only=True)
    if method == "safetensors":
        from safetensors.torch import load_file
        return load_file(path, backend="pread")
    if method == "safetensors_mmap":
        from safetensors.torch import load_file
        out = load_file(path)
        for t in out.values():  # fault every page in, so the data is at least mapped
            t.reshape(-1).view(torch.uint8)[::4096].sum()
        return out
    if method in ("recsave_verify", "recsave_noverify"):
        from recsave import format as fmt
        return fmt.read_tensors(path, concurrency=spec["concurrency"], verify=method == "recsave_verify")
    raise ValueError(method)


def _memory(method: str, state: Dict[str, Any]) -> Any:
    import torch

    if method == "crc32c":
        from recsave import _C
        return [_C.crc32c_address(t.data_ptr(), t.nbytes) for t in state.values()]
    if method == "memcpy":
        return {k: torch.empty_like(t).copy_(t) for k, t in state.items()}
    raise ValueError(method)


def _warm_up() -> None:
    """First-use costs that no method should pay inside its timing."""
    import numpy as np
    import torch

    torch.empty(1 << 16).uniform_().sum()
    np.empty(1 << 16).sum()


def worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One measured operation in a fresh process: build (save / memory) or nothing (load), then time
    the operation and measure its peak RSS."""
    import torch

    _warm_up()
    layout = state_layout(spec["size_bytes"], spec["tables"], spec["dim"])
    kind, method = spec["kind"], spec["method"]
    state = build_state(layout, spec["seed"]) if kind in ("save", "memory") else None
    if kind == "save" and method.startswith("recsave"):
        os.makedirs(spec["path"], exist_ok=True)
    out = None
    prefault_s = (C.prefault_memory(int(1.25 * payload_bytes(layout)), spec["scratch"])
                  if spec.get("prefault") else 0.0)
    with C.MeasureOp() as m:
        if kind == "save":
            _save(method, spec, state)
        elif kind == "load":
            out = _load(method, spec, layout)
        else:
            out = _memory(method, state)
    res = m.result()
    res["nbytes"] = payload_bytes(layout)
    res["prefault_s"] = prefault_s
    if "segment_bytes_used" in spec:
        res["segment_bytes"] = spec["segment_bytes_used"]
    res["torch_threads"] = torch.get_num_threads()
    if kind == "save":
        p = spec["path"]
        res["file_bytes"] = (sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p))
                             if os.path.isdir(p) else os.path.getsize(p))
    if kind == "load" and spec.get("check"):
        expected = build_state(layout, spec["seed"])
        bad = [n for n, t in expected.items()
               if n not in out or out[n].dtype != t.dtype or out[n].shape != t.shape or not torch.equal(out[n], t)]
        res["check"] = {"ok": not bad and len(out) == len(expected), "mismatched": bad}
    return res


# ------------------------------------------------------------------------------------------------
# Orchestration

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=None, help="payload size in GB (1e9 bytes); default 1.0")
    p.add_argument("--repeats", type=int, default=None, help="rounds; each runs every method once (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke test: 64 MB, 1 round")
    p.add_argument("--dir", default=None, help="parent of the temporary directory (default: system temp)")
    p.add_argument("--tables", type=int, default=2, help="embedding tables in the state (default 2)")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--concurrency", type=int, default=4, help="recsave engine threads (default 4)")
    p.add_argument("--segment-mb", type=float, default=None,
                   help="recsave segment_bytes knob in MiB (default: the knob's default)")
    p.add_argument("--no-prefault", dest="prefault", action="store_false",
                   help="do not cycle 1.25x the payload through the page cache and anonymous memory "
                        "just before each timed operation (see README: VM free page reporting)")
    p.add_argument("--drop-caches", action="store_true",
                   help="root only: sync and drop the page cache before every load (cold reads)")
    p.add_argument("--sweep", action="store_true",
                   help="also sweep recsave concurrency (1,2,4,8) and segment size (1,4,16,64 MiB)")
    p.add_argument("--only", default=None,
                   help="comma-separated kind:method filter, e.g. save:raw,save:recsave (debugging)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None,
                   help="JSON output path (default benchmarks/results/engine.json, engine-quick.json with --quick)")
    args = p.parse_args(argv)
    if args.size_gb is None:
        args.size_gb = 0.064 if args.quick else 1.0
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.json is None:
        args.json = os.path.join(C.RESULTS_DIR, "engine-quick.json" if args.quick else "engine.json")
    if args.size_gb <= 0 or args.repeats < 1 or args.tables < 1 or args.dim < 1 or args.concurrency < 1:
        p.error("--size-gb, --repeats, --tables, --dim and --concurrency must be positive")
    return args


def selected_methods(args: argparse.Namespace) -> Dict[str, List[str]]:
    methods = {kind: list(table) for kind, table in KINDS.items()}
    if importlib.util.find_spec("safetensors") is None:
        C.log("safetensors is not installed: its rows are skipped")
        for kind in ("save", "load"):
            methods[kind] = [m for m in methods[kind] if not m.startswith("safetensors")]
    if args.only:
        wanted = {tuple(x.split(":", 1)) for x in args.only.split(",")}
        methods = {k: [m for m in ms if (k, m) in wanted] for k, ms in methods.items()}
        for kind, method in wanted:  # a load needs its source written in the same round
            if kind == "load" and LOAD_SOURCE[method] not in methods["save"]:
                methods["save"].append(LOAD_SOURCE[method])
    return methods


def make_spec(args: argparse.Namespace, kind: str, method: str, path: Optional[str], **extra: Any) -> Dict[str, Any]:
    spec = {"kind": kind, "method": method, "path": path, "size_bytes": int(args.size_gb * C.GB),
            "tables": args.tables, "dim": args.dim, "seed": args.seed, "concurrency": args.concurrency,
            "segment_bytes": int(args.segment_mb * (1 << 20)) if args.segment_mb else None, "check": False,
            "prefault": args.prefault, "scratch": args.scratch}
    spec.update(extra)
    return spec


def run_op(spec: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    return C.run_isolated(worker, spec, timeout=timeout, preload=PRELOAD)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def run_rounds(args: argparse.Namespace, tmp: str, methods: Dict[str, List[str]],
               drop: bool) -> Tuple[Dict[Tuple[str, str], List[Dict[str, Any]]], List[str]]:
    samples: Dict[Tuple[str, str], List[Dict[str, Any]]] = defaultdict(list)
    failures: List[str] = []
    timeout = 120 + 120 * args.size_gb
    for r in range(args.repeats):
        rdir = os.path.join(tmp, f"round{r}")
        os.makedirs(rdir)
        out = {m: os.path.join(rdir, OUTPUT_NAME[m]) for m in methods["save"]}
        needed = {LOAD_SOURCE[m] for m in methods["load"]}
        for method in C.rounds_order(methods["save"], r):
            C.settle()
            res = run_op(make_spec(args, "save", method, out[method]), timeout)
            samples[("save", method)].append(res)
            rate = C.gbps(res['nbytes'], res['seconds'])
            C.log(f"[round {r + 1}/{args.repeats}] save   {method:18s} {rate:6.2f} GB/s")
            if method not in needed:
                remove(out[method])
        for method in C.rounds_order(methods["load"], r):
            dropped = C.settle(drop)
            res = run_op(make_spec(args, "load", method, out[LOAD_SOURCE[method]], check=r == 0), timeout)
            res["cache_dropped"] = dropped
            samples[("load", method)].append(res)
            if "check" in res and not res["check"]["ok"]:
                failures.append(f"load {method}: round trip mismatch in {res['check']['mismatched']}")
            rate = C.gbps(res['nbytes'], res['seconds'])
            trip = "" if "check" not in res else "  (round trip " + ("ok" if res["check"]["ok"] else "MISMATCH") + ")"
            C.log(f"[round {r + 1}/{args.repeats}] load   {method:18s} {rate:6.2f} GB/s" + trip)
        for method in C.rounds_order(methods["memory"], r):
            res = run_op(make_spec(args, "memory", method, None), timeout)
            samples[("memory", method)].append(res)
            rate = C.gbps(res['nbytes'], res['seconds'])
            C.log(f"[round {r + 1}/{args.repeats}] memory {method:18s} {rate:6.2f} GB/s")
        shutil.rmtree(rdir, ignore_errors=True)
    return samples, failures


def segment_label(nbytes: Optional[int]) -> str:
    return "n/a" if not nbytes else f"{nbytes / (1 << 20):g} MiB"


def run_sweep(args: argparse.Namespace, tmp: str, drop: bool) -> List[Dict[str, Any]]:
    """recsave save (fsync off) and load (verify) over concurrency and segment size."""
    configs = [(c, None) for c in (1, 2, 4, 8)] + [(4, s << 20) for s in (1, 16, 64)]  # None: knob default
    timeout = 120 + 120 * args.size_gb
    times: Dict[Tuple[int, Optional[int], str], List[float]] = defaultdict(list)
    used: Dict[Tuple[int, Optional[int]], int] = {}
    nbytes = 0
    for r in range(args.repeats):
        for conc, seg in C.rounds_order(configs, r):
            path = os.path.join(tmp, f"sweep-c{conc}-s{seg}")
            C.settle()
            res = run_op(make_spec(args, "save", "recsave", path, concurrency=conc, segment_bytes=seg), timeout)
            times[(conc, seg, "save")].append(res["seconds"])
            used[(conc, seg)] = res["segment_bytes"]
            C.settle(drop)
            res2 = run_op(make_spec(args, "load", "recsave_verify", path, concurrency=conc), timeout)
            times[(conc, seg, "load")].append(res2["seconds"])
            nbytes = res["nbytes"]
            seg_label = segment_label(res['segment_bytes'])
            C.log(f"[sweep {r + 1}/{args.repeats}] concurrency {conc} segment {seg_label}: save "
                  f"{C.gbps(nbytes, res['seconds']):.2f} GB/s, load {C.gbps(nbytes, res2['seconds']):.2f} GB/s")
            remove(path)
    return [{"concurrency": c, "segment_bytes": used[(c, s)],
             "save_gbps": C.gbps(nbytes, C.median(times[(c, s, "save")])),
             "load_verify_gbps": C.gbps(nbytes, C.median(times[(c, s, "load")])),
             "save_seconds": times[(c, s, "save")], "load_seconds": times[(c, s, "load")]}
            for c, s in configs]


def summarize(samples: Dict[Tuple[str, str], List[Dict[str, Any]]]) -> Dict[Tuple[str, str], Dict[str, Any]]:
    out = {}
    for key, runs in samples.items():
        s = C.summarize([x["seconds"] for x in runs], runs[0]["nbytes"])
        s["rss_delta_median"] = C.median([x["rss_delta"] for x in runs])
        s["rss_delta_max"] = max(x["rss_delta"] for x in runs)
        s["cpu_per_wall_median"] = C.median([x["cpu_s"] / x["seconds"] for x in runs])
        s["others_cpu_per_wall_median"] = C.median([x["others_cpu_s"] / x["seconds"] for x in runs])
        if "segment_bytes" in runs[0]:
            s["segment_bytes"] = runs[0]["segment_bytes"]
        out[key] = s
    return out


def compute_ratios(summary: Dict[Tuple[str, str], Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    ratios = []
    for key, label, num, den, goal in RATIOS:
        if num in summary and den in summary:
            value = summary[num]["median_gbps"] / summary[den]["median_gbps"]
            ratios.append({"key": key, "label": label, "value": value, "goal": goal,
                           "met": None if goal is None else value >= goal})
    overheads = []
    for key, label, slow, fast in OVERHEADS:
        if fast is None:  # CRC alone vs raw write
            fast = ("save", "raw")
        if slow in summary and fast in summary:
            if key == "crc_alone_vs_raw_write_pct":
                value = 100 * summary[slow]["median_s"] / summary[fast]["median_s"]
            else:
                value = 100 * (summary[slow]["median_s"] / summary[fast]["median_s"] - 1)
            overheads.append({"key": key, "label": label, "value_pct": value})
    return ratios, overheads


def report(args: argparse.Namespace, summary: Dict[Tuple[str, str], Dict[str, Any]], ratios: List[Dict[str, Any]],
           overheads: List[Dict[str, Any]], sweep: Optional[List[Dict[str, Any]]], reads_cold: bool,
           machine: Dict[str, Any], nbytes: int, noise: Dict[str, Any]) -> str:
    lines = []
    lines.append(f"recsave engine benchmark: {nbytes / C.GB:.3f} GB payload, {args.tables} tables x "
                 f"[ids int64, weight f32[rows,{args.dim}], momentum f32[rows,{args.dim}]], "
                 f"{args.repeats} interleaved round(s), recsave concurrency {args.concurrency}, segment_bytes "
                 f"{segment_label(next((v['segment_bytes'] for v in summary.values() if 'segment_bytes' in v), None))}")
    lines.append(f"machine: {machine['cpus']} CPUs ({machine['cpu']}), "
                 f"{(machine['memory_bytes'] or 0) / 2**30:.0f} GiB RAM, {machine['fs']} at {machine['dir']}, "
                 f"torch {machine['torch']}, safetensors {machine['safetensors']}")
    if reads_cold:
        lines.append("reads: COLD - page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before every load")
    else:
        lines.append("reads: WARM - files were just written, so loads are most likely served from the page cache "
                     "(RAM), not the disk" + ("; run as root with --drop-caches for cold reads"
                                              if not C.can_drop_caches() else "; add --drop-caches for cold reads"))
    lines.append("writes: each to a fresh file after `sync`; without fsync they end in the page cache (dirty "
                 "pages), so 'no fsync' rows measure memory -> page cache, not the disk")
    lines.append("memory: " + ("just before timing, each worker cycled 1.25x the payload through the page cache and "
                               "anonymous memory (--no-prefault to skip), so fresh pages are not charged host page "
                               "faults on VMs"
                               if args.prefault else "no prefault: on VMs fresh pages may cost host page faults"))
    lines.append("GB/s = payload bytes (1e9) / median seconds; CPU/wall = the process's CPU seconds per second; "
                 "peak RSS delta = ru_maxrss during the operation minus RSS just before it, in a fresh process")
    busy = noise["others_cpu_share_median"]
    lines.append(f"noise: load average {noise['loadavg_start']:.2f} at start, {noise['loadavg_end']:.2f} at end; "
                 f"other tasks (incl. kernel writeback) used a median {busy:.0%} of one CPU during the measured "
                 f"operations" + ("  ** machine busy: figures are noisy **" if busy > 0.2 else ""))
    lines.append("")

    headers = ["op", "method", "GB/s (median)", "min-max GB/s", "median s", "x raw", "CPU/wall", "peak RSS delta MB",
               "note"]
    rows = []
    for kind, table in KINDS.items():
        ref = summary.get((kind, "raw"))
        for method, (label, note) in table.items():
            s = summary.get((kind, method))
            if s is None:
                continue
            rel = C.fmt_num(s["median_gbps"] / ref["median_gbps"], 2, "x") if ref else ""
            rows.append([kind, label, C.fmt_num(s["median_gbps"]),
                         f"{C.fmt_num(s['worst_gbps'])}-{C.fmt_num(s['best_gbps'])}", C.fmt_num(s["median_s"], 3),
                         rel, C.fmt_num(s["cpu_per_wall_median"]), C.fmt_num(s["rss_delta_median"] / C.MB, 0), note])
    align = "llrrrrrrl"
    lines.append(C.text_table(headers, rows, align))
    lines.append("")

    rheaders = ["ratio", "value", "goal", ""]
    rrows = []
    for r in ratios:
        goal = "" if r["goal"] is None else f">= {r['goal']:g}x"
        status = "" if r["met"] is None else ("MET" if r["met"] else "MISSED")
        rrows.append([r["label"], C.fmt_num(r["value"], 3, "x"), goal, status])
    for o in overheads:
        rrows.append([o["label"], C.fmt_num(o["value_pct"], 1, " %"), "", ""])
    lines.append(C.text_table(rheaders, rrows, "lrrl"))

    if sweep:
        lines.append("")
        sh = ["recsave concurrency", "segment MiB", "save GB/s (fsync off)", "load GB/s (verify)"]
        srows = [[x["concurrency"], f"{x['segment_bytes'] / (1 << 20):g}", C.fmt_num(x["save_gbps"]),
                  C.fmt_num(x["load_verify_gbps"])] for x in sweep]
        lines.append(C.text_table(sh, srows, "rrrr"))

    lines.append("")
    lines.append("Markdown:")
    lines.append("")
    lines.append(C.markdown_table(headers, rows, align))
    lines.append("")
    lines.append(C.markdown_table(rheaders, rrows, "lrrl"))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    methods = selected_methods(args)
    drop = args.drop_caches
    if drop and not C.can_drop_caches():
        C.log("--drop-caches needs root and a writable /proc/sys/vm/drop_caches: reads stay warm")
        drop = False
    nbytes = payload_bytes(state_layout(int(args.size_gb * C.GB), args.tables, args.dim))
    load_start = os.getloadavg()[0]
    with C.bench_tempdir(args.dir) as tmp:
        # Per round at most: raw, torch, safetensors and recsave kept for the loads, plus one being written.
        C.check_free_space(tmp, 5.5 * nbytes + (1 << 28))
        machine = C.machine_info(tmp)
        C.log(f"temporary directory {tmp} ({machine['fs']}); {nbytes / C.GB:.3f} GB payload, "
              f"{args.repeats} round(s)")
        args.scratch = tmp
        samples, failures = run_rounds(args, tmp, methods, drop)
        sweep = run_sweep(args, tmp, drop) if args.sweep else None
    reads_cold = bool(samples) and all(x.get("cache_dropped") for k, v in samples.items() if k[0] == "load" for x in v)
    summary = summarize(samples)
    ratios, overheads = compute_ratios(summary)
    noise = {"loadavg_start": load_start, "loadavg_end": os.getloadavg()[0],
             "others_cpu_share_median": C.median([x["others_cpu_s"] / x["seconds"]
                                                  for v in samples.values() for x in v])}
    text = report(args, summary, ratios, overheads, sweep, reads_cold, machine, nbytes, noise)
    print(text)
    result = {
        "benchmark": "engine",
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "scratch")},
        "payload_bytes": nbytes,
        "layout": state_layout(int(args.size_gb * C.GB), args.tables, args.dim),
        "machine": machine,
        "reads": "cold" if reads_cold else "warm (page cache not dropped; likely served from RAM)",
        "results": [{"kind": k, "method": m, "label": KINDS[k][m][0], "note": KINDS[k][m][1], **summary[(k, m)],
                     "samples": samples[(k, m)]} for k, table in KINDS.items() for m in table if (k, m) in summary],
        "ratios": ratios,
        "overheads": overheads,
        "noise": noise,
        "sweep": sweep,
        "failures": failures,
    }
    path = C.write_json(args.json, result)
    print(f"\nJSON: {os.path.relpath(path)}")
    if failures:
        print("\nROUND-TRIP FAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
