"""Scale benchmark: what a save and a load cost in coordination as the number of ranks W grows.

    python benchmarks/scale.py            # W = 2, 4, 8 gloo ranks on this machine, 3 rounds each
    python benchmarks/scale.py --quick    # W = 2, 4, 8, tiny tables, 1 round (< 2 minutes)

Each rank is a process of its own (gloo, CPU) holding its share of `--tables` HashTables (ids routed
with recsave.partition.owner_of). Per save and per load it counts, on every rank, the
torch.distributed calls recsave makes (collective rounds) and their payload (the pickled objects
sent and received: the object collectives pad every rank's object to the largest, which the
`padded` figures include), the Storage calls (on S3 each is one request or more: the model in
benchmarks/README.md, "Scale"), the index's size, rank 0's commit time (merge the parts, write
model.pt / extra.pt / the index / the `checkpoint` list) and the wall time. The figures are fitted
against W (least squares, `_common.linear_fit`) to extrapolate to large W. Timings on a 2-core
machine with 8 processes are noisy (the ranks share the cores): the counts and bytes are exact.
Results: benchmarks/results/scale.json and scale.md (`scale-quick.*` with --quick).
"""
from __future__ import annotations

import argparse
import base64
import collections
import datetime
import functools
import json
import os
import pickle
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

C.ensure_repo_on_path()

# torch.distributed functions counted (whatever recsave calls among them)
COLLECTIVES = ["all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
               "all_gather", "gather", "broadcast", "all_reduce", "barrier", "monitored_barrier", "new_group"]
OBJECT_OUT = {"all_gather_object": 0, "gather_object": 1, "broadcast_object_list": 0}  # arg position of the list


class Counter:
    """Counts the torch.distributed and Storage calls made while `phase` is set."""

    def __init__(self) -> None:
        self.phase: Optional[str] = None
        self.data: Dict[str, Dict[str, Any]] = collections.defaultdict(lambda: {
            "collectives": collections.Counter(), "sent_bytes": 0, "received_bytes": 0, "received_padded": 0,
            "storage": collections.Counter(), "seconds": collections.Counter()})

    def collective(self, name: str, fn: Any, world: int) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            d = self.data[self.phase] if self.phase else None
            if d is not None:
                d["collectives"][name] += 1
                if name in ("all_gather_object", "gather_object"):
                    d["sent_bytes"] += len(pickle.dumps(args[OBJECT_OUT[name] ^ 1] if name == "all_gather_object"
                                                        else args[0]))
            out = fn(*args, **kwargs)
            if d is not None and name in OBJECT_OUT:
                got = args[OBJECT_OUT[name]] if len(args) > OBJECT_OUT[name] else kwargs.get("object_gather_list")
                if got:  # None on the ranks a gather does not deliver to
                    sizes = [len(pickle.dumps(x)) for x in got]
                    d["received_bytes"] += sum(sizes)
                    d["received_padded"] += max(sizes) * len(sizes)
            return out
        return counted

    def timed(self, label: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.phase:
                    self.data[self.phase]["seconds"][label] += time.perf_counter() - start
        return run

    def storage_call(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.phase:
                self.data[self.phase]["storage"][name] += 1
            return fn(*args, **kwargs)
        return run


def instrument(counter: Counter, world: int) -> None:
    import torch.distributed as td

    from recsave.format import index as index_mod
    from recsave.save import pipeline
    from recsave.storage.local import LocalStorage

    for name in COLLECTIVES:
        if hasattr(td, name):
            setattr(td, name, counter.collective(name, getattr(td, name), world))
    pipeline.CheckpointWriter._commit = counter.timed("commit (rank 0)", pipeline.CheckpointWriter._commit)
    pipeline.CheckpointWriter._write_rank_files = counter.timed("write rank files",
                                                                pipeline.CheckpointWriter._write_rank_files)
    index_mod.read = counter.timed("index read + parse", index_mod.read)
    index_mod.merge_parts = counter.timed("merge parts", index_mod.merge_parts)
    for name in ("exists", "isdir", "listdir", "makedirs", "size", "regular_file_size", "ukey", "remove_tree",
                 "remove_file", "read_bytes", "open_shard", "write_atomic", "open_write", "write_shard",
                 "create_exclusive", "being_created"):
        setattr(LocalStorage, name, counter.storage_call(name, getattr(LocalStorage, name)))


def worker(rank: int, world: int, init_file: str, work: str, spec: Dict[str, Any]) -> None:
    """One rank: build this rank's tables, save and load `spec['rounds']` times, dump the counts."""
    import torch
    import torch.distributed as td

    import recsave
    from recsave import knobs, partition

    td.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                          timeout=datetime.timedelta(seconds=300))
    counter = Counter()
    instrument(counter, world)
    torch.set_num_threads(1)

    def model_of(fill: bool) -> torch.nn.Module:
        model = torch.nn.ModuleDict()
        for t in range(spec["tables"]):
            table = model[f"t{t}"] = recsave.HashTable(spec["dim"], name=f"t{t}")
            table.add_slot("adagrad_acc")
            table.set_partition(rank, world)
            if fill:
                ids = torch.arange(spec["rows"], dtype=torch.int64) * 7919 + t
                mine = ids[partition.owner_of(ids, world) == rank]
                table.load_rows(mine, torch.randn(mine.numel(), spec["dim"]),
                                {"adagrad_acc": torch.rand(mine.numel(), spec["dim"])})
        return model

    out = os.path.join(work, "out")
    saver = recsave.Saver(model_of(True), output_dir=out, max_keep=2, concurrency=2)
    loader = recsave.Saver(model_of(False), output_dir=out, max_keep=None, concurrency=2)
    result: Dict[str, Any] = {"rank": rank, "rounds": []}
    with knobs.override(fsync=False):
        for r in range(spec["rounds"]):
            rnd: Dict[str, Any] = {}
            for what, run in (("save", lambda r=r: saver.save(f"ckpt_{r + 1}")), ("load", loader.load)):
                td.barrier()
                counter.phase = what
                start = time.perf_counter()
                run()
                rnd[f"{what}_s"] = time.perf_counter() - start
                counter.phase = None
                d = counter.data.pop(what)
                rnd[what] = {k: dict(v) if isinstance(v, collections.Counter) else v for k, v in d.items()}
            rnd["index_bytes"] = os.path.getsize(os.path.join(out, f"ckpt_{r + 1}", "index"))
            result["rounds"].append(rnd)
    saver.close()
    loader.close()
    with open(os.path.join(work, f"rank_{rank}.json"), "w") as f:
        json.dump(result, f)
    td.barrier()
    td.destroy_process_group()


def index_breakdown(path: str) -> Dict[str, int]:
    """Bytes of the index JSON by what they describe: bucket row starts, segment CRCs and ends, the
    rest of the chunk entries (per rank and tensor), file entries, the rest (meta, header)."""
    with open(path, "rb") as f:
        raw = f.read()
    index = json.loads(raw)

    def size(x: Any) -> int:
        return len(json.dumps(x, separators=(",", ":")))

    out = {"total": len(raw), "row_starts": 0, "crc32c": 0, "segments": 0, "chunk_other": 0, "chunks": 0,
           "files": size(index["files"]), "file_count": len(index["files"])}
    # format_version 3 lists each distinct bucket range once (counted here); earlier versions
    # repeat it in every chunk of a table's tensors (counted there)
    out["row_starts"] = size(index.get("bucket_ranges", []))
    for entry in index["tensors"].values():
        for chunk in entry["chunks"]:
            out["chunks"] += 1
            buckets = chunk.get("buckets", {})
            rs = buckets.get("row_starts", []) if isinstance(buckets, dict) else []
            out["row_starts"] += size(rs)
            out["crc32c"] += size(chunk["crc32c"])
            # segment ends listed (versions 1-3) or the bucket rule named (version 4)
            segs = size(chunk["segments"]) if "segments" in chunk else size(chunk.get("bucket_segments", []))
            out["segments"] += segs
            out["chunk_other"] += size(chunk) - size(rs) - size(chunk["crc32c"]) - segs
    crcs = [c["crc32c"] for e in index["tensors"].values() for c in e["chunks"]]  # version 3 packs them
    out["crc_count"] = sum(len(x) if isinstance(x, list) else len(base64.b64decode(x)) // 4 for x in crcs)
    out["rest"] = out["total"] - out["row_starts"] - out["crc32c"] - out["segments"] - out["chunk_other"] - out["files"]
    return out


def synthetic_commit(world: int, tables: int, slots: int, rank_bytes: float, dim: int = 64,
                     num_buckets: int = 4096, listed: bool = False) -> Dict[str, Any]:
    """Rank 0's index work at `world` ranks, measured on synthetic parts shaped like a save's (per
    rank and table: ids, embedding and slot chunks of `rank_bytes` / tables bytes in all, the rank's
    bucket row starts, checksum segments cut at them by the Saver's rule with the `segment_bytes`
    knob): pickled part size, unpickling every part (what gather_object does on rank 0),
    merge_parts, the index JSON and parsing it (what every loading rank does). The chunks name the
    rule (format_version 4), or with `listed` list the same ends (version 3, as before 4 existed)."""
    from recsave import gcpause, knobs
    from recsave.format import index as index_mod
    from recsave.format import segments as bucket_rule
    from recsave.format.records import BucketRange, Chunk, FileEntry, IndexPart, Partition, TensorEntry

    seg, least = knobs.get("segment_bytes"), knobs.get("min_segment_bytes")
    row_bytes = {"id": 8, **{c: 4 * dim for c in ["embedding"] + [f"slot{j}" for j in range(slots)]}}
    rows = int(rank_bytes / tables / sum(row_bytes.values()))
    parts = []
    for r in range(world):
        first, stop = r * num_buckets // world, (r + 1) * num_buckets // world
        files, tensors = {}, {}
        for t in range(tables):
            # each table its own bucket range, as in a save (tables differ in rows), shared by its tensors
            n_rows = rows + t
            buckets = BucketRange(first, tuple(n_rows * (b - first) // (stop - first) for b in range(first, stop + 1)))
            fname = f"sparse-{r}-{t}.safetensors"
            offset = 1000
            ends_of: Dict[int, Tuple[int, ...]] = {}  # the layout's ends were shared by a table's tensors
            for col, rb in row_bytes.items():
                n = n_rows * rb
                rule = bucket_rule.rule_for(rb, seg, least)
                ends = ends_of.setdefault(rb, tuple(bucket_rule.ends(buckets.row_starts, rb, rule)))
                crcs = tuple((e * 2654435761 + r) & 0xFFFFFFFF for e in ends)
                form: Dict[str, Any] = {"segments": ends} if listed else {"bucket_segments": rule}
                chunk = Chunk(fname, offset, n, crcs, rows=(0, n_rows), buckets=buckets, **form)
                tensors[f"t{t}@{col}"] = TensorEntry("int64" if col == "id" else "float32",
                                                     (n_rows,) if col == "id" else (n_rows, dim), (chunk,))
                offset += n
            files[fname] = FileEntry(offset, r)
        files[f"io_state_{r}.pt"] = FileEntry(1200, r, 12345)
        parts.append(IndexPart(r, files, tensors))
    blobs = [pickle.dumps(p) for p in parts]
    out: Dict[str, Any] = {"world": world, "tables": tables, "slots": slots, "rank_bytes": rank_bytes,
                           "form": "listed ends (version 3)" if listed else "bucket rule (version 4)",
                           "part_pickled_bytes": C.median([len(b) for b in blobs])}
    start = time.perf_counter()
    with gcpause.paused():  # as storage/dist.gather_to_rank0
        got = [pickle.loads(b) for b in blobs]
    out["unpickle_s"] = time.perf_counter() - start
    start = time.perf_counter()
    index = index_mod.merge_parts(got, step=1, world_size=world, partition=Partition("mix64", num_buckets))
    out["merge_s"] = time.perf_counter() - start
    start = time.perf_counter()
    data = index_mod.dumps(index)
    out["dumps_s"] = time.perf_counter() - start
    out["index_bytes"] = len(data)
    start = time.perf_counter()
    index_mod.parse(data, "synthetic/index")
    out["parse_s"] = time.perf_counter() - start
    return out


def run_world(world: int, args: argparse.Namespace, tmp: str) -> Dict[str, Any]:
    work = os.path.join(tmp, f"w{world}")
    os.makedirs(work)
    init_file = os.path.join(work, "init")
    spec = json.dumps({"tables": args.tables, "rows": args.rows, "dim": args.dim, "rounds": args.repeats})
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r), str(world), init_file,
                               work, spec], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"W={world}: a rank failed:\n" + "\n".join(o[-3000:] for o in outs))
    ranks = []
    for r in range(world):
        with open(os.path.join(work, f"rank_{r}.json")) as f:
            ranks.append(json.load(f))
    out = summarize_world(world, ranks)
    out["index_breakdown"] = index_breakdown(os.path.join(work, "out", f"ckpt_{args.repeats}", "index"))
    return out


def summarize_world(world: int, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per operation: collective calls per rank (rank 0's, which does the most), bytes sent and
    received by rank 0 and by all ranks together, Storage calls of rank 0 and of the median rank,
    times (medians over rounds; the slowest rank's wall time)."""
    out: Dict[str, Any] = {"world": world, "index_bytes": C.median([x["index_bytes"] for x in ranks[0]["rounds"]])}
    for what in ("save", "load"):
        last = [rk["rounds"][-1][what] for rk in ranks]  # counts are the same every round
        r0 = last[0]
        others = last[1:] or last
        out[what] = {
            "collective_calls": dict(r0["collectives"]),
            "rounds_rank0": sum(r0["collectives"].values()),
            "rank0_received_bytes": r0["received_bytes"],
            "rank0_received_padded": r0["received_padded"],
            "all_received_padded": sum(x["received_padded"] for x in last),
            "all_sent_bytes": sum(x["sent_bytes"] for x in last),
            "storage_calls_rank0": sum(r0["storage"].values()),
            "storage_calls_other": C.median([sum(x["storage"].values()) for x in others]),
            "storage_rank0": r0["storage"],
            "storage_rank1": others[0]["storage"],
            "wall_s": C.median([max(rk["rounds"][i][f"{what}_s"] for rk in ranks)
                                for i in range(len(ranks[0]["rounds"]))]),
            "seconds_rank0": {k: C.median([rd[what]["seconds"].get(k, 0.0) for rd in ranks[0]["rounds"]])
                              for k in r0["seconds"]},
        }
    return out


FITTED = [  # (label, getter): fitted against W, and against W^2 where all ranks' totals grow so
    ("index bytes", lambda x: x["index_bytes"]),
    ("save: collective calls, rank 0", lambda x: x["save"]["rounds_rank0"]),
    ("save: bytes received by rank 0 (padded)", lambda x: x["save"]["rank0_received_padded"]),
    ("save: bytes received, all ranks (padded)", lambda x: x["save"]["all_received_padded"]),
    ("save: Storage calls, rank 0", lambda x: x["save"]["storage_calls_rank0"]),
    ("save: Storage calls, other ranks (median)", lambda x: x["save"]["storage_calls_other"]),
    ("save: commit s (rank 0)", lambda x: x["save"]["seconds_rank0"].get("commit (rank 0)", 0.0)),
    ("save: wall s (slowest rank)", lambda x: x["save"]["wall_s"]),
    ("load: collective calls, rank 0", lambda x: x["load"]["rounds_rank0"]),
    ("load: bytes received, all ranks (padded)", lambda x: x["load"]["all_received_padded"]),
    ("load: Storage calls, rank 0", lambda x: x["load"]["storage_calls_rank0"]),
    ("load: Storage calls, other ranks (median)", lambda x: x["load"]["storage_calls_other"]),
    ("load: whole-file reads (index, list, .pt), rank 1", lambda x: x["load"]["storage_rank1"].get("read_bytes", 0)),
    ("load: index read + parse s (rank 0)", lambda x: x["load"]["seconds_rank0"].get("index read + parse", 0.0)),
    ("load: wall s (slowest rank)", lambda x: x["load"]["wall_s"]),
]


def fit_rows(worlds: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    ws = [x["world"] for x in worlds]
    rows = []
    for label, get in FITTED:
        ys = [float(get(x)) for x in worlds]
        lin = C.linear_fit(ws, ys)
        quad = C.linear_fit([w * w for w in ws], ys)
        at = lin["intercept"] + lin["slope"] * 1000
        at_q = quad["intercept"] + quad["slope"] * 1000 * 1000
        rows.append({"label": label, "values": ys, "per_w": lin["slope"], "at_0": lin["intercept"], "r2": lin["r2"],
                     "per_w2": quad["slope"], "r2_w2": quad["r2"], "at_1000_linear": at, "at_1000_quadratic": at_q})
    return rows


def markdown(d: Dict[str, Any]) -> str:
    ws = [x["world"] for x in d["worlds"]]
    headers = ["quantity"] + [f"W={w}" for w in ws] + ["per rank (fit)", "R^2", "R^2 vs W^2", "W=1000 (linear fit)"]
    rows = [[r["label"]] + [C.fmt_num(v, 3) if v < 100 else f"{v:,.0f}" for v in r["values"]]
            + [C.fmt_num(r["per_w"], 4), C.fmt_num(r["r2"], 3), C.fmt_num(r["r2_w2"], 3),
               C.fmt_num(r["at_1000_linear"], 2) if abs(r["at_1000_linear"]) < 100 else f"{r['at_1000_linear']:,.0f}"]
            for r in d["fits"]]
    calls = "; ".join(f"W={x['world']}: save {x['save']['collective_calls']}, load {x['load']['collective_calls']}; "
                      f"Storage calls of a load, rank 0 {x['load']['storage_rank0']}, rank 1 "
                      f"{x['load'].get('storage_rank1', 'n/a')}" for x in d["worlds"][:1])
    bd = [x["index_breakdown"] for x in d["worlds"]]
    parts = ["row_starts", "crc32c", "segments", "chunk_other", "files", "rest", "total"]
    breakdown = C.markdown_table(
        ["index bytes"] + [f"W={w}" for w in ws],
        [[k] + [f"{b[k]:,}" for b in bd] for k in parts]
        + [["chunks / CRCs / files"] + [f"{b['chunks']} / {b['crc_count']} / {b['file_count']}" for b in bd]],
        "l" + "r" * len(ws))
    return "\n".join([
        f"### scale.py: {d['config']['tables']} tables x {d['config']['rows']:,} ids "
        f"(dim {d['config']['dim']}, 1 slot) over W gloo ranks on one machine; recsave at {d['commit']}", "",
        f"Machine: {d['machine']['cpus']} CPUs ({d['machine']['cpu']}); {d['config']['repeats']} round(s), medians; "
        "counts and bytes are exact, times noisy (W processes share the cores).", "",
        C.markdown_table(headers, rows, "l" + "r" * (len(headers) - 1)), "",
        f"Collectives per operation ({calls}).", "",
        "What the index bytes describe (JSON bytes of each part):", "", breakdown, "",
        f"Rank 0's index work on synthetic parts ({d['config']['model_tables']} tables with 1 slot, "
        f"{d['config']['model_rank_gb']:g} GB per rank, dim 64; `synthetic_commit`), seconds on this machine:", "",
        C.markdown_table(["W", "index bytes", "part (pickled)", "unpickle W parts", "merge_parts", "index JSON",
                          "parse (every loading rank)"],
                         [[str(x["world"]), f"{x['index_bytes']:,}", f"{x['part_pickled_bytes']:,.0f}",
                           C.fmt_num(x["unpickle_s"], 3), C.fmt_num(x["merge_s"], 3), C.fmt_num(x["dumps_s"], 3),
                           C.fmt_num(x["parse_s"], 3)] for x in d.get("synthetic", [])], "rrrrrrr"), ""])


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4,8", help="world sizes (default 2,4,8)")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=None, help="ids per table over all ranks (default 400000; 20000 quick)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--repeats", type=int, default=None, help="save + load rounds per W (default 3; 1 quick)")
    p.add_argument("--synthetic", default=None,
                   help="world sizes of the synthetic rank-0 index work (default 64,250,1000; 16,64 quick)")
    p.add_argument("--model-tables", type=int, default=26, help="tables of the synthetic index (default 26)")
    p.add_argument("--model-rank-gb", type=float, default=10.0, help="GB per rank of the synthetic index (10)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.rows = a.rows or (20_000 if a.quick else 400_000)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.json = a.json or os.path.join(C.RESULTS_DIR, "scale-quick.json" if a.quick else "scale.json")
    a.worlds = [int(w) for w in a.worlds.split(",")]
    a.synthetic = [int(w) for w in (a.synthetic or ("16,64" if a.quick else "64,250,1000")).split(",") if w]
    return a


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        worker(int(argv[1]), int(argv[2]), argv[3], argv[4], json.loads(argv[5]))
        return 0
    args = parse_args(argv)
    with C.bench_tempdir(args.dir, prefix="recsave-scale-") as tmp:
        worlds = []
        for w in args.worlds:
            start = time.perf_counter()
            worlds.append(run_world(w, args, tmp))
            C.log(f"W={w}: save {worlds[-1]['save']['wall_s']:.3f} s, load {worlds[-1]['load']['wall_s']:.3f} s, "
                  f"index {worlds[-1]['index_bytes']:,} bytes ({time.perf_counter() - start:.0f} s with start-up)")
        machine = C.machine_info(tmp)
    synthetic = []
    for w in args.synthetic:
        synthetic.append(synthetic_commit(w, args.model_tables, 1, args.model_rank_gb * C.GB))
        C.log(f"synthetic index at W={w}: {synthetic[-1]['index_bytes']:,} bytes")
    d = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "commit": C.git_revision(),
         "machine": machine, "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "worlds": worlds,
         "fits": fit_rows(worlds), "synthetic": synthetic}
    C.write_json(args.json, d)
    md = markdown(d)
    C.write_text(args.json.replace(".json", ".md"), md)
    print(md + f"\nJSON: {os.path.relpath(args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
