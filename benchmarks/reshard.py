"""Multi-rank save / load throughput and N -> M resharding reads, with real gloo processes.

    python benchmarks/reshard.py [--size-gb 0.5] [--quick]

Builds a sparse state of two tables (ids + embedding + one optimizer slot) split over the ranks by
recsave.tables.partition, then measures in one run:
  * save and load throughput with 1, 2 and 4 ranks (total bytes / slowest rank's time);
  * per-rank bytes read / sparse bytes of the checkpoint when 4 ranks' checkpoint is loaded by
    3 and by 2 ranks (goal: <= 1/M + 5 %).
Writes benchmarks/results/reshard.json and prints a table (markdown with --markdown).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _common

DIM = 64


def worker(args: argparse.Namespace) -> None:
    """One rank: build or load, time the operation, write a JSON line of figures."""
    _common.ensure_repo_on_path()
    import datetime

    import torch
    import torch.distributed as dist

    from recsave import HashTable, Saver, knobs, partition
    from recsave.tables.optim import SparseAdagrad

    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    model = torch.nn.Module()
    model.a = HashTable(DIM, name="a")
    model.b = HashTable(DIM, name="b")
    opt = SparseAdagrad(model, lr=0.1)
    saver = Saver(model, sparse_optim=opt, output_dir=args.dir, max_keep=None)
    result = {"rank": args.rank}
    with knobs.override(fsync=not args.no_fsync):
        if args.worker == "save":
            ids = torch.arange(args.rows, dtype=torch.int64) * 2654435761 + 17
            mine = ids[partition.owner_of(ids, args.world) == args.rank]
            g = torch.Generator().manual_seed(args.rank)
            for table in (model.a, model.b):
                table.set_partition(args.rank, args.world)
                table.load_rows(mine, torch.randn(mine.numel(), DIM, generator=g),
                                {"adagrad_acc": torch.rand(mine.numel(), DIM, generator=g)})
            dist.barrier()
            start = time.perf_counter()
            saver.save("ckpt_1")
            result["seconds"] = time.perf_counter() - start
        else:
            dist.barrier()
            start = time.perf_counter()
            report = saver.load(load_conf={"exclude": ["io_state"]})
            result["seconds"] = time.perf_counter() - start
            result["bytes_read"] = report.bytes_read
            result["rows"] = len(model.a) + len(model.b)
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


def run(mode: str, world: int, directory: str, rows: int, no_fsync: bool) -> list:
    os.makedirs(directory, exist_ok=True)
    init = os.path.join(os.path.dirname(directory), f".init-{mode}-{world}-{time.monotonic_ns()}")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", mode, "--rank", str(r),
                               "--world", str(world), "--init", init, "--dir", directory, "--rows", str(rows)]
                              + (["--no-fsync"] if no_fsync else []),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise SystemExit(f"{mode} with {world} ranks failed:\n{out}")
        results.append(json.loads(out.rsplit("RESULT ", 1)[1]))
    return results


def sparse_bytes(ckpt_dir: str) -> int:
    with open(os.path.join(ckpt_dir, "index")) as f:
        index = json.load(f)
    return sum(c["length"] for t in index["tensors"].values() for c in t["chunks"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=0.5, help="sparse state size (ids+embedding+slot)")
    ap.add_argument("--quick", action="store_true", help="64 MB smoke run")
    ap.add_argument("--dir", default=None, help="parent of the temporary directory")
    ap.add_argument("--no-fsync", action="store_true", help="skip fsync (compare with page-cache writes)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--worker", choices=["save", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    size = 0.064e9 if args.quick else args.size_gb * 1e9
    row_bytes = 2 * (8 + 2 * DIM * 4)  # two tables: id + embedding + slot per row
    rows = int(size // row_bytes)
    figures = {"config": {"size_bytes": rows * row_bytes, "rows_per_table": rows, "dim": DIM,
                          "fsync": not args.no_fsync}, "throughput": [], "reshard": []}
    with _common.bench_tempdir(args.dir) as tmp:
        figures["machine"] = _common.machine_info(tmp)
        for world in (1, 2, 4):
            d = os.path.join(tmp, f"w{world}")
            saved = run("save", world, d, rows, args.no_fsync)
            nbytes = sparse_bytes(os.path.join(d, "ckpt_1"))
            loaded = run("load", world, d, rows, args.no_fsync)
            figures["throughput"].append({
                "ranks": world, "bytes": nbytes,
                "save_gbps": _common.gbps(nbytes, max(r["seconds"] for r in saved)),
                "load_gbps": _common.gbps(nbytes, max(r["seconds"] for r in loaded))})
            _common.log(f"{world} rank(s): save {figures['throughput'][-1]['save_gbps']:.2f} GB/s, "
                        f"load {figures['throughput'][-1]['load_gbps']:.2f} GB/s")
        d4 = os.path.join(tmp, "w4")
        total = sparse_bytes(os.path.join(d4, "ckpt_1"))
        for m in (3, 2):
            loaded = run("load", m, d4, rows, args.no_fsync)
            for r in sorted(loaded, key=lambda x: x["rank"]):
                figures["reshard"].append({"from": 4, "to": m, "rank": r["rank"], "bytes_read": r["bytes_read"],
                                           "fraction": r["bytes_read"] / total, "goal": 1 / m + 0.05})
    headers = ["ranks", "sparse MB", "save GB/s", "load GB/s"]
    rows_t = [[t["ranks"], _common.fmt_num(t["bytes"] / 1e6, 0), _common.fmt_num(t["save_gbps"]),
               _common.fmt_num(t["load_gbps"])] for t in figures["throughput"]]
    headers2 = ["load", "rank", "read / sparse bytes", "goal <=", "ok"]
    rows2 = [[f"4 -> {x['to']}", x["rank"], f"{x['fraction']:.4f}", f"{x['goal']:.4f}",
              "yes" if x["fraction"] <= x["goal"] else "NO"] for x in figures["reshard"]]
    table = _common.markdown_table if args.markdown else _common.text_table
    print(table(headers, rows_t))
    print()
    print(table(headers2, rows2))
    path = _common.write_json(os.path.join(_common.RESULTS_DIR, "reshard.json"), figures)
    print(f"\nwrote {path}")
    return 0 if all(x["fraction"] <= x["goal"] for x in figures["reshard"]) else 1


if __name__ == "__main__":
    sys.exit(main())
