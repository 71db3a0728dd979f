"""Incremental (delta) checkpoint benchmark: for 1 %, 5 % and 20 % of the rows changed between
saves, the bytes of a delta, its save time, the time training waits for an async delta, and the
restore of a base + 10 deltas, each as a ratio to the full checkpoint of the same state (medians of
`--rounds` rounds).

    python benchmarks/incremental.py              # tables of >= 1 GB state, 3 rounds
    python benchmarks/incremental.py --quick      # ~32 MB, 1 round: smoke test

Results are printed and written to benchmarks/results/incremental.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

C.ensure_repo_on_path()

import torch  # noqa: E402

from recsave import HashTable, Saver  # noqa: E402
from recsave.format import index as index_mod  # noqa: E402
from recsave.tables.optim import SparseAdagrad  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self, tables: int, dim: int):
        super().__init__()
        self.tables = torch.nn.ModuleList(HashTable(dim, name=f"t{i}", seed=i) for i in range(tables))
        self.mlp = torch.nn.Linear(tables * dim, 1)


def build(args: argparse.Namespace) -> Model:
    """Tables holding ~size_gb of ids + embedding + one Adagrad slot, filled with load_rows."""
    row_bytes = 8 + 2 * 4 * args.dim + 16  # id, embedding, slot, row metadata
    rows = int(args.size_gb * 1e9 / row_bytes / args.tables)
    model = Model(args.tables, args.dim)
    SparseAdagrad(model, lr=0.01)  # creates the slot
    for i, t in enumerate(model.tables):
        ids = torch.arange(rows, dtype=torch.int64) * 7919 + i
        t.load_rows(ids, torch.randn(rows, args.dim), {"adagrad_acc": torch.rand(rows, args.dim)})
    return model


def change(model: Model, fraction: float, round_no: int) -> None:
    """Rewrites `fraction` of every table's rows (new values, as an optimizer step would)."""
    g = torch.Generator().manual_seed(round_no)
    for t in model.tables:
        ids = t.ids()
        pick = ids[torch.randperm(ids.numel(), generator=g)[: max(1, int(fraction * ids.numel()))]]
        t.load_rows(pick, torch.randn(pick.numel(), t.embedding_dim, generator=g), clear=False)


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(args: argparse.Namespace, work: str, fraction: float, round_no: int) -> Dict[str, float]:
    out = os.path.join(work, f"r{round_no}-{fraction}")
    model = build(args)
    saver = Saver(model, output_dir=out, max_keep=None, concurrency=args.threads)
    full_s = timed(lambda: saver.save("full_0", incremental=True))
    full_bytes = index_mod.read(os.path.join(out, "full_0")).total_bytes
    full_async = timed(lambda: saver.async_save("full_a")[1] and None)
    saver.wait()
    delta_s: List[float] = []
    delta_bytes: List[int] = []
    stall: List[float] = []
    for k in range(1, 11):
        change(model, fraction, round_no * 100 + k)
        if k % 2:
            delta_s.append(timed(lambda k=k: saver.save(f"delta_{k}", incremental=True)))
        else:
            stall.append(timed(lambda k=k: saver.async_save(f"delta_{k}", incremental=True)))
            saver.wait()
        assert saver.last_save_kind == "delta"
        delta_bytes.append(index_mod.read(os.path.join(out, f"delta_{k}")).total_bytes)
    saver.close()
    # Restores in fresh models: the full checkpoint of the last state, and base + 10 deltas.
    saver.save("full_last")
    restore_full = timed(lambda: Saver(Model(args.tables, args.dim), output_dir=out).load(ckpt_id="full_last"))
    restore_chain = timed(lambda: Saver(Model(args.tables, args.dim), output_dir=out).load(ckpt_id="delta_10"))
    C.clear_dir(out)
    return {"full_s": full_s, "full_bytes": full_bytes, "full_async_stall_s": full_async,
            "delta_s": C.median(delta_s), "delta_bytes": C.median(delta_bytes), "delta_stall_s": C.median(stall),
            "restore_full_s": restore_full, "restore_chain_s": restore_chain,
            "bytes_ratio": C.median(delta_bytes) / full_bytes, "save_ratio": C.median(delta_s) / full_s,
            "stall_ratio": C.median(stall) / full_async, "restore_ratio": restore_chain / restore_full}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0, help="table state (ids + embedding + slot + metadata)")
    ap.add_argument("--tables", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=4, help="engine concurrency")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fractions", default="0.01,0.05,0.2")
    ap.add_argument("--dir", default=None, help="parent of the temporary output dir")
    ap.add_argument("--quick", action="store_true", help="~32 MB, 1 round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.size_gb, args.rounds, args.dim = 0.032, 1, 16
    fractions = [float(f) for f in args.fractions.split(",")]
    result: Dict[str, Any] = {"args": vars(args), "fractions": {}}
    rows = []
    with C.bench_tempdir(args.dir) as work:
        result["machine"] = C.machine_info(work)
        for fraction in fractions:
            rounds = [measure(args, work, fraction, r) for r in range(args.rounds)]
            med = {k: C.median([r[k] for r in rounds]) for k in rounds[0]}
            result["fractions"][str(fraction)] = {"rounds": rounds, "median": med}
            rows.append([f"{fraction:.0%}", f"{med['bytes_ratio']:.3f}", f"{med['save_ratio']:.3f}",
                         f"{med['stall_ratio']:.3f}", f"{med['restore_ratio']:.2f}",
                         C.fmt_num(med["full_s"], 3, " s"), C.fmt_num(med["restore_full_s"], 3, " s")])
    headers = ["changed", "delta bytes / full", "delta save / full", "async stall / full",
               "restore base+10 / full", "full save", "full restore"]
    print(C.text_table(headers, rows))
    print()
    print(C.markdown_table(headers, rows))
    default = "results/incremental-quick.json" if args.quick else "results/incremental.json"
    path = C.write_json(args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), default), result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
