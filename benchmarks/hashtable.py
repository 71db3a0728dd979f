"""Hash-table benchmark: throughput of recsave's id map (ids/s) on one and two cores, and the time
of a training step with a recsave.HashTable + recsave.tables.optim sparse optimizer against
torch.nn.Embedding (sparse and dense gradients) with torch's optimizers, on the same ids.

    python benchmarks/hashtable.py            # 4M-id map; 4096 x 26 zipf batches over 4M ids
    python benchmarks/hashtable.py --quick    # small sizes: smoke test (< 60 s)

Runs in this process; torch.set_num_threads and the recsave `concurrency` knob are set to each
thread count in turn. Results: benchmarks/results/hashtable.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

C.ensure_repo_on_path()

import numpy as np  # noqa: E402
import torch  # noqa: E402

import recsave  # noqa: E402
from recsave import _C, knobs, optim  # noqa: E402

LOOKUP_GOAL = 20e6  # ids/s on one core (benchmarks/README.md, Budgets)
TRACKING_GOAL = 0.03  # change tracking's share of a training step, at most (Budgets)


class Measured:
    """Runs `op(prepared)` `repeats` times, `prepare()` untimed before each; keeps the seconds and
    the CPU other processes used meanwhile."""

    def __init__(self, op: Callable[[Any], Any], repeats: int, prepare: Callable[[], Any] = lambda: None):
        self.seconds: List[float] = []
        busy0, own0 = C.system_busy_seconds(), _own_cpu()
        for _ in range(repeats):
            arg = prepare()
            start = time.perf_counter()
            keep = op(arg)
            self.seconds.append(time.perf_counter() - start)
            del keep, arg  # freed outside the timing
        self.others_cpu = max(0.0, C.system_busy_seconds() - busy0 - (_own_cpu() - own0))
        self.wall = sum(self.seconds)


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def unique_ids(n: int, salt: int) -> np.ndarray:
    """n distinct, scattered int64 ids: i * odd constant mod 2^62, offset by `salt` * n."""
    i = np.arange(salt * n, (salt + 1) * n, dtype=np.uint64)
    return ((i * np.uint64(0x9E3779B97F4A7C15)) & np.uint64((1 << 62) - 1)).astype(np.int64)


def zipf_ranks(rng: np.random.Generator, vocab: int, alpha: float, size: int) -> np.ndarray:
    """`size` ranks in [0, vocab) with P(r) proportional to 1 / (r + 1)^alpha."""
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** alpha)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(size)), vocab - 1)


# ------------------------------------------------------------------------------------------------
# Id map

def idmap_rows(args: argparse.Namespace, threads: int, batches: List[np.ndarray]) -> List[Dict[str, Any]]:
    n, reps = args.ids, args.repeats
    ids = unique_ids(n, 0)
    shuffled = ids[np.random.default_rng(1).permutation(n)]
    absent = unique_ids(n, 1)
    batch_ids = sum(b.size for b in batches)
    rows: List[Tuple[str, int, Measured, str]] = []

    def filled() -> Any:
        m = _C.IdMap(0)
        m.lookup_or_insert(ids, threads)
        return m

    rows.append(("insert new ids into an empty map (growth included)", n,
                 Measured(lambda fresh: fresh.lookup_or_insert(ids, threads), reps, lambda: _C.IdMap(0)),
                 "IdMap.lookup_or_insert"))

    def reserved() -> Any:
        m = _C.IdMap(0)
        m.reserve(n)
        return m
    rows.append(("insert new ids into a reserved map", n,
                 Measured(lambda fresh: fresh.lookup_or_insert(ids, threads), reps, reserved), "IdMap.reserve first"))
    if hasattr(_C.IdMap, "load_distinct"):
        rows.append(("restore: ids[i] -> row i into a reserved map", n,
                     Measured(lambda fresh: fresh.load_distinct(ids, threads), reps, reserved),
                     "IdMap.load_distinct (HashTable.prepare_load)"))
    m = filled()
    rows.append(("lookup present ids, random order", n, Measured(lambda _: m.lookup(shuffled, threads), reps),
                 "IdMap.lookup; the budget row"))
    rows.append(("lookup_or_insert of present ids", n,
                 Measured(lambda _: m.lookup_or_insert(shuffled, threads), reps), "training path, nothing new"))
    rows.append(("lookup absent ids", n, Measured(lambda _: m.lookup(absent, threads), reps), "misses"))
    rows.append((f"lookup zipf batches ({args.batch}x{args.fields})", batch_ids,
                 Measured(lambda _: [m.lookup(b, threads) for b in batches], reps), "hot ids, cache friendly"))
    out = torch.empty(batches[0].size, dtype=torch.int64)
    rows.append(("lookup_ptr zipf batches into a preallocated tensor", batch_ids,
                 Measured(lambda _: [m.lookup_ptr(b.ctypes.data, b.size, out.data_ptr(), threads) for b in batches],
                          reps), "no output allocation"))
    m = None  # free the map before the table below builds its own
    table = recsave.HashTable(args.table_dim, name="bench")
    if table.prepare_load(torch.from_numpy(ids), ["embedding"]) is None:
        raise RuntimeError("HashTable.prepare_load refused the ids")
    tbatches = [torch.from_numpy(b) for b in batches]
    rows.append(("HashTable.lookup(insert=True), zipf batches", batch_ids,
                 Measured(lambda _: [table.lookup(b, insert=True) for b in tbatches], reps), "public API, tensors"))
    rows.append(("HashTable.lookup(insert=False), zipf batches", batch_ids,
                 Measured(lambda _: [table.lookup(b, insert=False) for b in tbatches], reps), "public API, tensors"))
    table = None
    if threads == 1:
        keys = np.sort(ids)
        rows.append(("reference: np.searchsorted over sorted ids, random order", n,
                     Measured(lambda _: np.searchsorted(keys, shuffled), reps), "static array, no inserts"))
    try:  # the torch-ops map (for tables on accelerators), where this checkout has it
        from recsave.tables.idmap import TensorIdMap
        tm = TensorIdMap("cpu")
        tm.lookup_or_insert(torch.from_numpy(ids))
        rows.append(("reference: recsave TensorIdMap (torch ops) lookup, zipf batches", batch_ids,
                     Measured(lambda _: [tm.lookup(b) for b in tbatches], reps), "device map, run on the CPU"))
        tm = None
    except Exception as exc:
        C.log(f"TensorIdMap row skipped: {type(exc).__name__}: {exc}")
    return [{"threads": threads, "op": op, "ids_per_op": k, "seconds": x.seconds, "median_s": C.median(x.seconds),
             "ids_per_s": k / C.median(x.seconds), "others_cpu_share": x.others_cpu / x.wall, "note": note}
            for op, k, x, note in rows]


# ------------------------------------------------------------------------------------------------
# Training step

class Tower(torch.nn.Module):
    """Embeddings of [batch, fields] ids, summed over fields, then a linear logit."""

    def __init__(self, embedding: torch.nn.Module, dim: int):
        super().__init__()
        self.embedding = embedding
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).sum(1)).squeeze(1)


def make_model(kind: str, vocab: int, dim: int) -> Tuple[torch.nn.Module, List[Any]]:
    """(model, optimizers) for one of TRAIN's kinds; embeddings start as normal(0, 0.01)."""
    torch.manual_seed(0)
    if kind.startswith("recsave"):
        # *_untracked: change tracking (incremental checkpoints) off, to measure what it costs
        with knobs.override(track_changes=not kind.endswith("_untracked")):
            model = Tower(recsave.HashTable(dim, name="emb", init_std=0.01), dim)
        sparse = (optim.SparseAdagrad(model.embedding, lr=0.05) if kind.startswith("recsave_adagrad")
                  else optim.SparseAdam(model.embedding, lr=1e-3))
    else:
        emb = torch.nn.Embedding(vocab, dim, sparse=kind != "torch_dense_adagrad")
        torch.nn.init.normal_(emb.weight, 0.0, 0.01)
        model = Tower(emb, dim)
        sparse = (torch.optim.SparseAdam(emb.parameters(), lr=1e-3) if kind == "torch_sparse_adam"
                  else torch.optim.Adagrad(emb.parameters(), lr=0.05))
    head = list(model.head.parameters())
    dense = torch.optim.Adam(head, lr=1e-3) if kind.endswith("adam") else torch.optim.Adagrad(head, lr=0.05)
    return model, [sparse, dense]


TRAIN = {
    "recsave_adagrad": "recsave HashTable + recsave SparseAdagrad",
    "recsave_adagrad_untracked": "same, change tracking off",
    "torch_sparse_adagrad": "nn.Embedding(sparse=True) + torch Adagrad",
    "torch_dense_adagrad": "nn.Embedding (dense grad) + torch Adagrad",
    "recsave_adam": "recsave HashTable + recsave SparseAdam",
    "recsave_adam_untracked": "same, change tracking off",
    "torch_sparse_adam": "nn.Embedding(sparse=True) + torch SparseAdam",
}


def train_row(kind: str, args: argparse.Namespace, threads: int, batches: List[torch.Tensor],
              labels: List[torch.Tensor]) -> Dict[str, Any]:
    model, opts = make_model(kind, args.vocab, args.dim)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    steps = args.dense_steps if kind == "torch_dense_adagrad" else args.steps
    seconds, losses, phases = [], [], {"forward": [], "backward": [], "optimizer": []}
    busy0, own0 = C.system_busy_seconds(), _own_cpu()
    for i in range(args.warmup + steps):
        b = i % len(batches)
        t0 = time.perf_counter()
        loss = loss_fn(model(batches[b]), labels[b])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
        t3 = time.perf_counter()
        if i >= args.warmup:
            seconds.append(t3 - t0)
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[k].append(v)
        losses.append(float(loss))
    wall = sum(seconds)
    others = max(0.0, C.system_busy_seconds() - busy0 - (_own_cpu() - own0))
    rows_held = len(model.embedding) if kind.startswith("recsave") else args.vocab
    ids = batches[0].numel()
    return {"threads": threads, "model": kind, "label": TRAIN[kind], "steps": steps, "warmup": args.warmup,
            "seconds": seconds, "median_s": C.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
            "ids_per_s": ids / C.median(seconds), "phases_median_s": {k: C.median(v) for k, v in phases.items()},
            "rows_held": rows_held, "first_loss": losses[0],
            "last_loss": losses[-1], "others_cpu_share": others / max(wall, 1e-9)}


# ------------------------------------------------------------------------------------------------

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ids", type=int, default=None, help="ids in the id-map table (default 4,000,000)")
    p.add_argument("--vocab", type=int, default=None, help="id space of the training batches (default 4,000,000)")
    p.add_argument("--batch", type=int, default=None, help="examples per batch (default 4096)")
    p.add_argument("--fields", type=int, default=26, help="ids per example (default 26)")
    p.add_argument("--alpha", type=float, default=1.05, help="zipf exponent of the id distribution")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension of the training models")
    p.add_argument("--table-dim", type=int, default=8, help="row width of the HashTable in the lookup rows")
    p.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    p.add_argument("--repeats", type=int, default=None, help="repeats per id-map row (default 5)")
    p.add_argument("--batches", type=int, default=None, help="distinct batches (default 20)")
    p.add_argument("--steps", type=int, default=None, help="timed training steps (default 20)")
    p.add_argument("--dense-steps", type=int, default=None, help="timed steps of the dense model (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 3)")
    p.add_argument("--models", default=",".join(TRAIN), help=f"training models (default {','.join(TRAIN)})")
    p.add_argument("--skip-idmap", action="store_true")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--quick", action="store_true", help="smoke test: small sizes, few repeats")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                   help="wait up to S seconds for other processes to go quiet first, and again before "
                        "each section")
    p.add_argument("--json", default=None, help="default results/hashtable.json (-quick with --quick)")
    a = p.parse_args(argv)
    q = a.quick
    a.ids = a.ids or (200_000 if q else 4_000_000)
    a.vocab = a.vocab or (200_000 if q else 4_000_000)
    a.batch = a.batch or (512 if q else 4096)
    a.repeats = a.repeats or (2 if q else 5)
    a.batches = a.batches or (4 if q else 20)
    a.steps = a.steps or (3 if q else 20)
    a.dense_steps = a.dense_steps or (2 if q else 5)
    a.warmup = a.warmup if a.warmup is not None else (1 if q else 3)
    a.threads = [int(t) for t in a.threads.split(",")]
    a.models = [m for m in a.models.split(",") if m]
    unknown = set(a.models) - set(TRAIN)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; known: {', '.join(TRAIN)}")
    a.json = a.json or os.path.join(C.RESULTS_DIR, "hashtable-quick.json" if q else "hashtable.json")
    return a


def report(res: Dict[str, Any]) -> str:
    a = res["config"]
    lines = [f"Machine: {res['machine']['cpus']} CPUs ({res['machine']['cpu']}), torch {res['machine']['torch']}, "
             f"recsave at {res.get('commit')}. "
             f"Noise: {res['busy_before_cpus']:.2f} CPUs busy before start; other tasks used a median "
             f"{res['others_cpu_share_median']:.0%} of a CPU while measuring"
             + ("  ** machine busy: figures are noisy **" if res["others_cpu_share_median"] > 0.2 else ""), ""]
    if res["idmap"]:
        lines += [f"Id map: {a['ids']:,} distinct int64 ids; zipf batches: {a['batches']} x {a['batch']}x{a['fields']} "
                  f"ids (alpha {a['alpha']}) drawn from them; median of {a['repeats']} repeats.", ""]
        ths = a["threads"]
        ops = list(dict.fromkeys(r["op"] for r in res["idmap"]))
        by = {(r["op"], r["threads"]): r for r in res["idmap"]}
        h = ["operation"] + [f"M ids/s, {t} thread{'s' if t > 1 else ''}" for t in ths] + ["note"]
        rows = [[op] + [C.fmt_num(by[(op, t)]["ids_per_s"] / 1e6, 1) if (op, t) in by else "" for t in ths]
                + [next(r["note"] for r in res["idmap"] if r["op"] == op)] for op in ops]
        lines += [C.markdown_table(h, rows, "l" + "r" * len(ths) + "l"), ""]
        for b in res["budgets"]:
            if b.get("kind") != "tracking":
                lines.append(f"- {b['label']}: {b['value'] / 1e6:.1f} M ids/s (goal >= {LOOKUP_GOAL / 1e6:g} M): "
                             f"{'MET' if b['met'] else 'MISSED'}")
        lines.append("")
    if res["train"]:
        lines += [f"Training step: batch {a['batch']}x{a['fields']} ids (zipf alpha {a['alpha']} over "
                  f"{a['vocab']:,} ids), dim {a['dim']}, embeddings summed over fields -> linear -> BCE; "
                  f"forward + backward + optimizer steps + zero_grad; median of the timed steps after "
                  f"{a['warmup']} warm-up steps.", ""]
        h = ["threads", "model", "ms/step (median)", "min-max ms", "fwd / bwd / opt ms", "M ids/s",
             "x nn.Embedding sparse", "rows held"]
        rows = []
        for r in res["train"]:
            ref_kind = "torch_sparse_adam" if "adam" in r["model"] else "torch_sparse_adagrad"
            ref = next((x for x in res["train"] if x["model"] == ref_kind and x["threads"] == r["threads"]), None)
            rows.append([r["threads"], r["label"], C.fmt_num(1e3 * r["median_s"], 1),
                         f"{C.fmt_num(1e3 * r['min_s'], 1)}-{C.fmt_num(1e3 * r['max_s'], 1)}",
                         " / ".join(C.fmt_num(1e3 * v, 1) for v in r["phases_median_s"].values()),
                         C.fmt_num(r["ids_per_s"] / 1e6, 2),
                         C.fmt_num(ref["median_s"] / r["median_s"], 2, "x") if ref and ref is not r else "",
                         f"{r['rows_held']:,}"])
        lines.append(C.markdown_table(h, rows, "rlrrrrrr"))
        tracking = [b for b in res["budgets"] if b.get("kind") == "tracking"]
        if tracking:
            lines.append("")
        for b in tracking:
            lines.append(f"- {b['label']}: {b['value']:+.1%} of a step (goal <= {TRACKING_GOAL:.0%}): "
                         f"{'MET' if b['met'] else 'MISSED'}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    quiet = C.wait_until_quiet(args.wait_quiet)
    rng = np.random.default_rng(0)
    table_ids = unique_ids(args.ids, 0)
    n_batch = args.batch * args.fields
    lookup_batches = [table_ids[zipf_ranks(rng, args.ids, args.alpha, n_batch)] for _ in range(args.batches)]
    # Training ids: ranks scattered over [0, vocab) by a fixed permutation (nn.Embedding needs ids < vocab).
    scatter = torch.from_numpy(rng.permutation(args.vocab))
    train_batches = [scatter[torch.from_numpy(zipf_ranks(rng, args.vocab, args.alpha, n_batch))]
                     .view(args.batch, args.fields) for _ in range(args.batches)]
    labels = [torch.from_numpy(rng.random(args.batch) < 0.25).float() for _ in range(args.batches)]
    res: Dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"},
                           "machine": C.machine_info(C.RESULTS_DIR if os.path.isdir(C.RESULTS_DIR) else C.REPO_ROOT),
                           "commit": C.git_revision(), "busy_before_cpus": quiet["busy_cpus"],
                           "idmap": [], "train": [], "budgets": []}
    for threads in args.threads:
        torch.set_num_threads(threads)
        with knobs.override(concurrency=threads):
            if not args.skip_idmap:
                if args.wait_quiet:
                    C.wait_until_quiet(args.wait_quiet, window_s=1.0)
                C.log(f"id map, {threads} thread(s) ...")
                res["idmap"] += idmap_rows(args, threads, lookup_batches)
            if not args.skip_train:
                for kind in args.models:
                    if args.wait_quiet:
                        C.wait_until_quiet(args.wait_quiet, window_s=1.0)
                    C.log(f"training, {threads} thread(s): {TRAIN[kind]} ...")
                    res["train"].append(train_row(kind, args, threads, train_batches, labels))
    for r in res["idmap"]:
        if r["threads"] == 1 and r["op"].startswith(("lookup present", "lookup zipf", "HashTable.lookup(insert=True)")):
            res["budgets"].append({"label": f"1 thread: {r['op']}", "value": r["ids_per_s"],
                                   "met": r["ids_per_s"] >= LOOKUP_GOAL})
    for r in res["train"]:
        if r["model"].endswith("_untracked"):
            tracked = next((x for x in res["train"] if x["model"] == r["model"][: -len("_untracked")]
                            and x["threads"] == r["threads"]), None)
            if tracked:
                cost = tracked["median_s"] / r["median_s"] - 1
                res["budgets"].append({"label": f"{r['threads']} thread(s): change tracking cost, "
                                                f"{tracked['model']}", "value": cost, "met": cost <= TRACKING_GOAL,
                                       "kind": "tracking"})
    res["others_cpu_share_median"] = C.median([r["others_cpu_share"] for r in res["idmap"] + res["train"]])
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    C.write_json(args.json, res)
    text = report(res)
    md = C.write_text(args.json.replace(".json", ".md"), text + "\n")
    print(text + f"\n\nJSON: {os.path.relpath(args.json)}   markdown: {os.path.relpath(md)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
