"""Serving export and Parquet delta feed throughput against torch.save of the same rows.

    python benchmarks/export.py [--size 1.0] [--dim 64] [--rounds 3] [--quick]

Builds one HashTable of `--size` GB (ids + float32 embedding, 1 GB = 1e9 bytes), saves it as
ckpt_1, changes 10 % of the rows, adds 5 % new ids and deletes 1 %, saves ckpt_2. Then, per round
(median of `--rounds`): recsave.export_serving of ckpt_2 as int8, fp16, bf16 and fp32; the delta
feed ckpt_1 -> ckpt_2 (recsave.export.export_delta); and torch.save of ckpt_2's ids + embedding
(the rows already in memory, i.e. the cost of writing them, not of reading a checkpoint). The
figures are GB/s of the source rows (ids + float32 embedding of ckpt_2; for the feed, of both
checkpoints' rows, which it reads) and each as a ratio to torch.save. Writes
benchmarks/results/export.json (export-quick.json with --quick).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any, Callable, Dict, List

import _common

_common.ensure_repo_on_path()

import torch  # noqa: E402  (after the path set-up)

import recsave  # noqa: E402
from recsave.export import export_delta  # noqa: E402

DTYPES = ("int8", "fp16", "bf16", "fp32")


class Model(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.table = recsave.HashTable(dim, name="table", seed=1)


def build(directory: str, rows: int, dim: int) -> Dict[str, Any]:
    """ckpt_1 and ckpt_2 of one table; returns their paths and ckpt_2's rows."""
    model = Model(dim)
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(rows * 2, generator=g)[:rows].to(torch.int64) * 2654435761
    block = 1 << 20
    for a in range(0, rows, block):
        b = min(rows, a + block)
        model.table.load_rows(ids[a:b], torch.randn(b - a, dim, generator=g), clear=False)
    saver = recsave.Saver(model, output_dir=os.path.join(directory, "run"), max_keep=None)
    first = saver.save("ckpt_1")
    changed = ids[torch.randperm(rows, generator=g)[: rows // 10]]
    model.table.load_rows(changed, torch.randn(changed.numel(), dim, generator=g), clear=False)
    fresh = -(torch.arange(rows // 20, dtype=torch.int64) + 1)
    model.table.load_rows(fresh, torch.randn(fresh.numel(), dim, generator=g), clear=False)
    model.table.delete(ids[torch.randperm(rows, generator=g)[: rows // 100]])
    second = saver.save("ckpt_2")
    saver.close()
    ids2, values, _ = model.table.export()
    return {"ckpt_1": first, "ckpt_2": second, "ids": ids2, "values": values,
            "rows_1": rows, "rows_2": int(ids2.numel())}


def measure(fn: Callable[[str], Any], scratch: str) -> float:
    """Seconds of fn(out) into a fresh directory, removed afterwards."""
    os.makedirs(scratch, exist_ok=True)
    _common.clear_dir(scratch)
    with _common.Timer() as t:
        fn(scratch)
    _common.clear_dir(scratch)
    return t.seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=float, default=1.0, help="GB of ids + float32 embedding (default 1.0)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="0.05 GB, 1 round: a smoke test")
    ap.add_argument("--dir", default=None, help="parent of the scratch directory (default: the temp dir)")
    args = ap.parse_args()
    size, rounds = (0.05, 1) if args.quick else (args.size, args.rounds)
    rows = max(1, int(size * _common.GB / (args.dim * 4 + 8)))
    with _common.bench_tempdir(args.dir) as tmp:
        _common.check_free_space(tmp, size * _common.GB * 6)
        _common.log(f"building ckpt_1 / ckpt_2: {rows} rows of dim {args.dim} ({size:.2f} GB)")
        state = build(tmp, rows, args.dim)
        nbytes = state["rows_2"] * (args.dim * 4 + 8)
        feed_bytes = nbytes + state["rows_1"] * (args.dim * 4 + 8)
        scratch = os.path.join(tmp, "out")
        ops: Dict[str, Callable[[str], Any]] = {
            f"export_serving {d}": (lambda out, d=d: recsave.export_serving(state["ckpt_2"], out, d))
            for d in DTYPES}
        ops["delta feed"] = lambda out: export_delta(state["ckpt_1"], state["ckpt_2"], out)
        ops["torch.save"] = lambda out: (os.makedirs(out, exist_ok=True), torch.save(
            {"ids": state["ids"], "embedding": state["values"]}, os.path.join(out, "rows.pt")))
        samples: Dict[str, List[float]] = {name: [] for name in ops}
        for r in range(rounds):
            for name in _common.rounds_order(list(ops), r):
                samples[name].append(measure(ops[name], scratch))
                _common.log(f"round {r + 1}: {name} {samples[name][-1]:.3f} s")
        shutil.rmtree(scratch, ignore_errors=True)
    base = _common.gbps(nbytes, _common.median(samples["torch.save"]))
    rows_out = []
    results = {}
    for name, secs in samples.items():
        moved = feed_bytes if name == "delta feed" else nbytes
        rate = _common.gbps(moved, _common.median(secs))
        results[name] = {"seconds": secs, "median_s": _common.median(secs), "bytes": moved, "gbps": rate,
                         "x_torch_save": rate / base if base else float("nan")}
        rows_out.append([name, _common.fmt_num(_common.median(secs), 3), _common.fmt_num(rate),
                         _common.fmt_num(results[name]["x_torch_save"])])
    print(_common.text_table(["operation", "median s", "GB/s", "x torch.save"], rows_out))
    summary = {"config": {"size_gb": size, "dim": args.dim, "rounds": rounds, "rows": rows},
               "revision": _common.git_revision(), "results": results}
    name = "export-quick.json" if args.quick else "export.json"
    _common.write_json(os.path.join(_common.RESULTS_DIR, name), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
