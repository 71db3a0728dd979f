"""compare.py's measurements: one operation in a fresh process (time, CPU, peak RSS over the state,
round-trip check), interleaved rounds of all methods, and the summaries of their samples."""
from __future__ import annotations

import argparse
import os
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import _common as C
import engine as E
from _compare_methods import FAMILIES, LOAD, PRELOAD, SAVE, patch_saver_no_verify, run_load, run_save
from _compare_state import Layout, build_model, gathered_state, model_mismatches

Samples = Dict[Tuple[str, str], List[Dict[str, Any]]]  # (kind, method) -> one result per round


def measure_operation(spec: Dict[str, Any]) -> Dict[str, Any]:
    """In a fresh worker process: builds what `spec` asks for, then times one save or load (C.MeasureOp)."""
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
        model = build_model(layout, spec["seed"], fill=True, bucket_order=method == "saver_restored")
    elif kind == "save" and method == "engine_gather":
        state = gathered_state(E.build_state(layout, spec["seed"]))
    elif kind == "save" and method != "dd":
        state = E.build_state(layout, spec["seed"])
    elif kind == "load" and method.startswith("saver"):
        model = build_model(layout, spec["seed"], fill=False)
        patched = patch_saver_no_verify() if method == "saver_noverify" else None
    elif kind == "load" and method == "dcp":
        dest = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in layout}  # pages not touched yet
    if model is not None:
        import recsave
        keep = 1 if method == "saver_rotating" else None
        spec["saver"] = recsave.Saver(model, output_dir=spec["path"], max_keep=keep, concurrency=spec["concurrency"])
        if method == "saver_rotating":  # the checkpoint the timed save prunes, on disk before it starts
            from recsave import knobs
            with knobs.override(fsync=False):
                spec["saver"].save("ckpt_0")
            os.sync()
    if kind == "save" and method.startswith("engine"):
        os.makedirs(spec["path"], exist_ok=True)
    prefault_s = C.prefault_memory(int(1.25 * nbytes), spec["scratch"]) if spec["prefault"] else 0.0
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with C.MeasureOp() as m:
        out = run_save(method, spec, state, model) if kind == "save" else run_load(method, spec, layout, dest)
    res = m.result()
    res.update(nbytes=nbytes, prefault_s=prefault_s, torch_threads=torch.get_num_threads())
    if kind == "save" and isinstance(out, dict):  # e.g. an async save's stall
        res.update(out)
    if method == "dd":  # the work is dd's: its CPU. Its peak RSS is not known: the child's ru_maxrss
        # counts the worker's pages before the exec, so the RSS columns show n/a.
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime
        res.update(nbytes=spec["dd_count"] * (64 << 20), cpu_s=cpu, others_cpu_s=max(0.0, res["others_cpu_s"] - cpu),
                   rss_delta=0)
    # A load holds the state it read; an async save a staged host copy of it. The Saver's rows also
    # hold what a HashTable keeps beyond the benchmark's tensors: after a load its id map and the
    # row metadata (last_step, count), in an async save's staged copy the metadata. Those count as
    # state (`rss_over_state`); `rss_over_tensors` counts only the benchmark's tensors.
    held = nbytes if kind == "load" or method == "saver_async" else 0
    if method == "engine_saverfile":  # it also holds the row metadata it read: the Saver's state
        held = sum(t.nbytes for t in out.values())
    res["table_extra_bytes"] = table_extra_bytes(model, kind, method)
    res["rss_over_tensors"] = res["rss_delta"] - held
    res["rss_over_state"] = res["rss_delta"] - held - res["table_extra_bytes"]
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
        elif method == "engine_saverfile":  # the Saver's names and row order: Saver.load's check covers the file
            bad = []
        else:
            expected = E.build_state(layout, spec["seed"])
            bad = [n for n, t in expected.items() if n not in out or out[n].dtype != t.dtype
                   or out[n].shape != t.shape or not torch.equal(out[n], t)]
        res["check"] = {"ok": not bad, "mismatched": bad}
    return res


def table_extra_bytes(model: Any, kind: str, method: str) -> int:
    """What the Saver's tables hold beyond the benchmark's tensors (ids, embedding, slots): after a
    load, every table's id map and row metadata (HashTable.memory_bytes); in an async save's staged
    copy, the row metadata (16 bytes a row). 0 for other operations."""
    if model is None or not (kind == "load" or method == "saver_async"):
        return 0
    tables = [m for m in model.modules() if hasattr(m, "memory_bytes")]
    if kind == "load":
        return sum(mem["id_map"] + mem["meta"] for mem in (t.memory_bytes() for t in tables))
    return sum(16 * len(t) for t in tables)


def run_rounds(args: argparse.Namespace, tmp: str, layout: Layout, methods: Dict[str, List[str]], repeats: int,
               drop: bool, tag: str = "") -> Tuple[Samples, List[str]]:
    """`repeats` rounds; a round takes the families (raw, torch, dcp, ...) in an order rotated per
    round, and per family its saves, then its loads of the file just written, then deletes it, so the
    page cache holds one family's output at a time."""
    samples: Samples = defaultdict(list)
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
                res = C.run_isolated(measure_operation, dict(base, kind="save", method=method, path=out[method]),
                                     timeout=timeout, preload=PRELOAD)
                samples[("save", method)].append(res)
                speed = C.gbps(res["nbytes"], res["seconds"])
                C.log(f"{tag}[round {r + 1}/{repeats}] save {method:16s} {speed:6.2f} GB/s"
                      f"  RSS over state {res['rss_over_state'] / C.MB:6.0f} MB")
                if method not in {LOAD[m][2] for m in loads}:
                    E.remove(out[method])
            for method in C.rounds_order(loads, r):
                src = out[LOAD[method][2]]
                dropped = C.settle(drop, evict=src)
                cached = C.cached_fraction(src)
                res = C.run_isolated(measure_operation, dict(base, kind="load", method=method, path=src, check=r == 0),
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
                E.remove(path)
    return samples, failures


def summarize(samples: Samples) -> Dict[Tuple[str, str], Dict[str, Any]]:
    summary = E.summarize(samples)
    for key, runs in samples.items():
        s = summary[key]
        s["rss_over_state_max"] = max(x["rss_over_state"] for x in runs)
        s["rss_over_state_median"] = C.median([x["rss_over_state"] for x in runs])
        s["rss_over_tensors_max"] = max(x.get("rss_over_tensors", x["rss_over_state"]) for x in runs)
        s["table_extra_bytes"] = max(x.get("table_extra_bytes", 0) for x in runs)
        fr = [x["cached_fraction"] for x in runs if x.get("cached_fraction") is not None]
        s["cached_fraction_median"] = C.median(fr) if fr else None
        s["nbytes"] = runs[0]["nbytes"]
        if all("stall_s" in x for x in runs):
            s["stall_s_median"] = C.median([x["stall_s"] for x in runs])
    return summary


def reads_label(samples: Samples) -> str:
    loads = [x for k, v in samples.items() if k[0] == "load" for x in v]
    fr = [x["cached_fraction"] for x in loads if x.get("cached_fraction") is not None]
    share = f"{100 * C.median(fr):.0f} % of the file's pages in the page cache before a load (median)" if fr else ""
    if loads and all(x.get("cache_dropped") for x in loads):
        return (f"cold (before every load the page cache dropped as root, else the file's pages evicted with "
                f"posix_fadvise(DONTNEED); {share})")
    return f"warm ({share}; the file was just written, reads come from RAM)"


def noise_of(samples: Samples, kind: Optional[str] = None) -> float:
    """Median share of a CPU that other tasks used during the operations (of one kind)."""
    return C.median([x["others_cpu_s"] / x["seconds"] for k, v in samples.items() if kind in (None, k[0]) for x in v])

