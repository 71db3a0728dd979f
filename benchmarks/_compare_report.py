"""compare.py's reports: throughput ratios and overheads against the budgets (benchmarks/README.md),
the main and budget tables, the markdown file and the sweep plot."""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

import _common as C
from _compare_methods import KINDS, SAVE

# (label, numerator, denominator, goal): throughput ratios; goals from benchmarks/README.md, Budgets.
# The budgets are the Saver's (the API users call); the engine's rows against the same peers show
# its headroom, and durable DCP has no budget (the 2x DCP budget is for saves without fsync).
RATIOS = [
    ("save: Saver (fsync off) / raw write", ("save", "saver"), ("save", "raw"), 0.85),
    ("save: Saver (fsync off) / torch.save", ("save", "saver"), ("save", "torch"), 1.5),
    ("save: Saver (fsync off) / DCP save (no sync)", ("save", "saver"), ("save", "dcp"), 2.0),
    ("save: Saver (fsync on) / raw write + fsync", ("save", "saver_fsync"), ("save", "raw_fsync"), 0.9),
    ("save: Saver (fsync on) / dd conv=fdatasync", ("save", "saver_fsync"), ("save", "dd"), None),
    ("save: Saver (fsync on) / DCP save (default, sync)", ("save", "saver_fsync"), ("save", "dcp_fsync"), None),
    ("save: engine (fsync off) / raw write", ("save", "engine"), ("save", "raw"), None),
    ("save: engine (fsync off) / torch.save", ("save", "engine"), ("save", "torch"), None),
    ("save: engine (fsync off) / DCP save (no sync)", ("save", "engine"), ("save", "dcp"), None),
    ("save: Saver / engine (fsync off)", ("save", "saver"), ("save", "engine"), 0.9),
    ("save: Saver of a restored model / engine (fsync off)", ("save", "saver_restored"), ("save", "engine"), None),
    ("save: Saver / engine gathering the same rows (fsync off)", ("save", "saver"), ("save", "engine_gather"), None),
    ("save: Saver of a restored model / raw write", ("save", "saver_restored"), ("save", "raw"), None),
    ("save: Saver replacing its last checkpoint (max_keep=1) / raw write", ("save", "saver_rotating"),
     ("save", "raw"), None),
    ("save: Saver async_save until committed / Saver.save", ("save", "saver_async"), ("save", "saver"), None),
    ("load: Saver / raw read", ("load", "saver"), ("load", "raw"), 0.9),
    ("load: Saver / torch.load", ("load", "saver"), ("load", "torch"), 1.2),
    ("load: Saver / DCP load", ("load", "saver"), ("load", "dcp"), 1.5),
    ("load: engine (verify) / raw read", ("load", "engine_verify"), ("load", "raw"), None),
    ("load: engine (verify) / torch.load", ("load", "engine_verify"), ("load", "torch"), None),
    ("load: engine (verify) / DCP load", ("load", "engine_verify"), ("load", "dcp"), None),
    ("load: Saver / engine (verify)", ("load", "saver"), ("load", "engine_verify"), 0.9),
    ("load: Saver / engine reading the Saver's files", ("load", "saver"), ("load", "engine_saverfile"), None),
]
# (label, slower, faster, goal %): time(slower) / time(faster) - 1
OVERHEADS = [
    ("load checksums, engine (verify vs no verify)", ("load", "engine_verify"), ("load", "engine_noverify"), 5.0),
    ("load checksums, Saver (verify vs patched off)", ("load", "saver"), ("load", "saver_noverify"), 5.0),
    ("save: Saver fsync on vs off", ("save", "saver_fsync"), ("save", "saver"), None),
    ("save: Saver vs engine (both fsync off)", ("save", "saver"), ("save", "engine"), None),
    ("load: Saver vs engine (both verify)", ("load", "saver"), ("load", "engine_verify"), None),
]
RSS_BUDGET = 256 * C.MB  # peak RSS above the state (benchmarks/README.md, Budgets), in MB (1e6 bytes)
# Methods whose timed operation is not the process's first: their peak RSS says nothing of the
# budget (saver_rotating's untimed first save grew the heap before the peak was reset).
NO_RSS_BUDGET = ("saver_rotating",)


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
    a, sync = summary.get(("save", "saver_async")), summary.get(("save", "saver"))
    if a and sync and a.get("stall_s_median") is not None:  # the steady-state goal is async_save.py's
        overheads.append({"label": "save: async_save stall / Saver.save (first call: new stage buffers)",
                          "value_pct": 100 * a["stall_s_median"] / sync["median_s"], "goal_pct": None, "met": None})
    return ratios, overheads


def _like_for_like(kind: str, method: str) -> Tuple[Optional[str], Optional[str], Optional[str]]:
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
                   if r and (kind, r) in summary and r != method else "" for r in _like_for_like(kind, method)]
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
        if x["method"].startswith(("saver", "engine")) and x["method"] not in NO_RSS_BUDGET:
            over = x["rss_over_state_max"]
            what = "state + staged copy" if x["method"] == "saver_async" else "state"
            extra = x.get("table_extra_bytes", 0)
            if extra:  # say what the tables hold beyond the tensors, and the figure without it
                what += (f" (incl. {extra / C.MB:.0f} MB of "
                         + ("id maps + row metadata" if x["kind"] == "load" else "row metadata")
                         + f"; {x.get('rss_over_tensors_max', over) / C.MB:.0f} MB over the tensors alone)")
            rows.append([f"peak RSS over {what}, {x['label']}", f"{over / C.MB:.0f} MB", "<= 256 MB",
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


def sweep_budgets(s: Dict[str, Any]) -> Tuple[List[str], List[List[str]]]:
    """The ratios of RATIOS (MET / MISSED where they have a goal) and the peak RSS budget at every
    sweep size: the budgets hold across 0.25-4 GB."""
    by = {(x["kind"], x["method"]): x["points"] for x in s["methods"]}
    sizes = s["sizes_gb"]
    rows = []
    for label, num, den, goal in RATIOS:  # budgets, then ratios without one (for reading them)
        if num not in by or den not in by:
            continue
        cells = []
        for p, q in zip(by[num], by[den]):
            if not p or not q:
                cells.append("")
                continue
            v = p["median_gbps"] / q["median_gbps"]
            cells.append(f"{v:.2f}x" if goal is None else f"{v:.2f}x {'MET' if v >= goal else 'MISSED'}")
        rows.append([label, "" if goal is None else f">= {goal:g}x"] + cells)
    for x in s["methods"]:
        if x["method"].startswith(("saver", "engine")) and x["method"] not in NO_RSS_BUDGET:
            rows.append([f"peak RSS over state, {x['label']}", "<= 256 MB"]
                        + ["" if not p else f"{p['rss_over_state_max'] / C.MB:.0f} MB "
                           f"{'MET' if p['rss_over_state_max'] <= RSS_BUDGET else 'MISSED'}"
                           + (f" ({p['rss_over_tensors_max'] / C.MB:.0f} MB over the tensors alone)"
                              if p.get("table_extra_bytes") else "") for p in x["points"]])
    return ["budget", "goal"] + [f"{g:g} GB" for g in sizes], rows


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
        "GB over the sizes.", "", C.markdown_table(headers, rows, "ll" + "r" * (len(headers) - 2)), "",
        "Budgets at every size (medians per size; peak RSS: max over rounds, an async save's over the "
        "state and its staged copy):", "", C.markdown_table(*sweep_budgets(s), "lr" + "r" * len(sizes))])


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
    fig, axes = plt.subplots(3, 2, figsize=(13, 13))
    by = {(x["kind"], x["method"]): x["points"] for x in s["methods"]}
    for label, num, den, goal in RATIOS:  # row 3: the budgeted ratios per size, flat when they scale
        if goal is None or num not in by or den not in by:
            continue
        pts = [(p["payload_gb"], p["median_gbps"] / q["median_gbps"]) for p, q in zip(by[num], by[den]) if p and q]
        ax = axes[2][0 if num[0] == "save" else 1]
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label.split(": ", 1)[1])
        ax.axhline(goal, color=line.get_color(), ls="--", lw=0.8)
    for col, kind in enumerate(("save", "load")):
        axes[2][col].set(xscale="log", xlabel="state size (GB)", ylabel="ratio (median GB/s over median GB/s)",
                         title=f"{kind}: budgeted ratios (dashed: their goals)")
        axes[2][col].set_xticks(s["sizes_gb"], [f"{g:g}" for g in s["sizes_gb"]])
        axes[2][col].minorticks_off()
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

