"""recsave against the alternatives on one embedding-style state: save and load through recsave's
public API (a model of HashTables, Saver.save / Saver.load into a fresh model) and through its
engine, torch.save / torch.load, torch.distributed.checkpoint, safetensors, a raw numpy write / read
of the same bytes (the physical limit) and dd (durable writes).

    python benchmarks/compare.py                 # >= 2 GB state, 3 interleaved rounds
    python benchmarks/compare.py --quick         # tiny state, 1 round: smoke test (< 60 s)
    python benchmarks/compare.py --drop-caches   # cold reads (root: drop_caches; else posix_fadvise)
    python benchmarks/compare.py --sweep         # throughput vs state size (0.25 .. 4 GB) + plot
    python benchmarks/compare.py --profile       # cProfile of one Saver.save / Saver.load (1 GB)

Every operation runs in a fresh process (engine.py's machinery: `_common.run_isolated`, peak RSS
from the OS). Results: benchmarks/results/compare.json (keys "default" and "sweep", each updated by
its own run), compare.md (markdown tables for the README) and compare.png (the sweep).

Modules: _compare_state.py (the state), _compare_methods.py (the methods measured),
_compare_measure.py (fresh-process measurements, rounds, summaries), _compare_report.py (ratios,
budgets, tables, markdown, plot); this file runs them and holds the command line.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import engine as E
from _compare_measure import noise_of, reads_label, run_rounds, summarize
from _compare_methods import KINDS, PRELOAD, SWEEP_DEFAULT, selected
from _compare_report import (
    budget_rows,
    default_header,
    default_markdown,
    main_table,
    plot_sweep,
    ratio_rows,
    sweep_markdown,
    write_markdown,
)
from _compare_state import build_model, state_layout

C.ensure_repo_on_path()


# ------------------------------------------------------------------------------------------------
# Runs

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
                       **{f: s[key][f] for f in ("median_s", "median_gbps", "min_s", "max_s", "rss_over_state_max",
                                                 "rss_over_tensors_max", "table_extra_bytes")}}
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
    p.add_argument("--drop-caches", action="store_true",
                   help="cold reads: drop the page cache before each load (root), else evict the file's pages "
                        "(posix_fadvise DONTNEED)")
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
    drop = args.drop_caches
    if drop and not C.can_drop_caches():
        C.log("--drop-caches without root: each load's files are evicted with posix_fadvise(DONTNEED)")
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
