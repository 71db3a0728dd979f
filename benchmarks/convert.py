"""Conversion throughput: recsave.convert recsave -> torch.save, recsave -> DCP and torch.save ->
recsave, against torch.save and DCP save of the same state, in one run.

    python benchmarks/convert.py [--size 1.0] [--tables 4] [--dim 64] [--rounds 3] [--dir PATH]

The state: `--tables` HashTables, each ids + a float32 [rows, dim] embedding + one Adagrad-like
slot, sized to `--size` GB in all (1 GB = 1e9 bytes), saved once as a recsave checkpoint. Each
operation runs in a fresh process (peak RSS above its baseline is its own) and writes into a clean
directory; every figure is the median of `--rounds` rounds (GB/s of the state's bytes). The
baselines save the same plain tensors (`<table>.ids`, `.weight`, `.<slot>`) with torch.save and
dcp.save. Writes benchmarks/results/convert.json (convert-quick.json below 0.5 GB).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any, Dict

import _common

SLOT = "adagrad_acc"


def _plain_state(ckpt: str) -> Dict[str, Any]:
    """The checkpoint's tables as plain tensors, the baselines' input (read outside the timing)."""
    import torch

    from recsave.load.sources import open_source

    src = open_source(ckpt)
    state: Dict[str, Any] = {}
    for name in sorted(src.contents.tables):
        ids, cols = src.read_table(name, ["embedding", SLOT], 0, 1, 4)
        state.update({f"{name}.ids": ids, f"{name}.weight": cols["embedding"], f"{name}.{SLOT}": cols[SLOT]})
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    return state


def op(kind: str, src: str, dst: str) -> Dict[str, Any]:
    """One measured operation in this (fresh) process."""
    _common.ensure_repo_on_path()
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    import recsave

    warnings.filterwarnings("ignore", message=".*single process")
    state = _plain_state(src) if kind in ("torch.save", "dcp.save") else None
    with _common.MeasureOp() as m:
        if kind == "recsave->torch":
            recsave.convert(src, dst, "torch")
        elif kind == "recsave->dcp":
            recsave.convert(src, dst, "dcp")
        elif kind == "torch->recsave":
            recsave.convert(src, dst, "recsave")
        elif kind == "torch.save":
            torch.save(state, dst)
        elif kind == "dcp.save":
            dcp.save(state, checkpoint_id=dst, no_dist=True)
        else:
            raise ValueError(kind)
    return m.result()


def build(directory: str, size_gb: float, tables: int, dim: int) -> Dict[str, Any]:
    _common.ensure_repo_on_path()
    import torch

    from recsave import HashTable, Saver

    row_bytes = 8 + 2 * dim * 4
    rows = max(1, int(size_gb * _common.GB / tables / row_bytes))
    model = torch.nn.Module()
    gen = torch.Generator().manual_seed(0)
    for t in range(tables):
        table = HashTable(dim, name=f"t{t}")
        table.add_slot(SLOT, 0.1)
        ids = torch.randperm(rows * 4, generator=gen)[:rows].to(torch.int64) * 2654435761
        table.load_rows(ids, torch.rand(rows, dim, generator=gen), {SLOT: torch.rand(rows, dim, generator=gen)})
        model.add_module(f"t{t}", table)
    out = os.path.join(directory, "ckpt")
    Saver(model, output_dir=out).save("ckpt_1")
    return {"ckpt": out, "rows_per_table": rows, "nbytes": rows * row_bytes * tables}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=1.0, help="state size in GB (1e9 bytes), default 1.0")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    _common.ensure_repo_on_path()
    kinds = ["recsave->torch", "torch.save", "recsave->dcp", "dcp.save", "torch->recsave"]
    with _common.bench_tempdir(args.dir) as work:
        _common.check_free_space(work, args.size * _common.GB * 4)
        state = build(work, args.size, args.tables, args.dim)
        _common.log(f"state: {args.tables} tables x {state['rows_per_table']} rows, {state['nbytes'] / 1e9:.2f} GB")
        pt = os.path.join(work, "state.pt")  # the torch->recsave source, written once
        _common.run_isolated(op, "recsave->torch", state["ckpt"], pt, preload=["torch"])
        runs: Dict[str, list] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in _common.rounds_order(kinds, r):
                dst = os.path.join(work, "out")
                src = pt if kind == "torch->recsave" else state["ckpt"]
                runs[kind].append(_common.run_isolated(op, kind, src, dst, preload=["torch"]))
                if os.path.isdir(dst):
                    shutil.rmtree(dst)
                elif os.path.exists(dst):
                    os.remove(dst)
                _common.settle()
        nbytes = state["nbytes"]
        results = {}
        rows = []
        for kind in kinds:
            secs = [x["seconds"] for x in runs[kind]]
            summary = _common.summarize(secs, nbytes)
            summary["peak_rss_delta_mb"] = max(x["rss_delta"] for x in runs[kind]) / 1e6
            summary["others_cpu_s"] = sum(x["others_cpu_s"] for x in runs[kind])
            results[kind] = summary
            rows.append([kind, _common.fmt_num(summary["median_gbps"]), _common.fmt_num(summary["median_s"], 3),
                         _common.fmt_num(summary["peak_rss_delta_mb"], 0)])
        print(_common.text_table(["operation", "GB/s (median)", "s (median)", "peak RSS +MB"], rows, "lrrr"))
        for conv, base in (("recsave->torch", "torch.save"), ("recsave->dcp", "dcp.save")):
            print(f"{conv} / {base}: {results[conv]['median_gbps'] / results[base]['median_gbps']:.2f}x")
        doc = {"size_gb": nbytes / 1e9, "tables": args.tables, "dim": args.dim, "rounds": args.rounds,
               "revision": _common.git_revision(), "results": results,
               "machine": _common.machine_info(work)}
        name = "convert-quick.json" if args.size < 0.5 else "convert.json"
        path = _common.write_json(os.path.join(_common.REPO_ROOT, "benchmarks", "results", name), doc)
        _common.log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
