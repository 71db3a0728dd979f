"""Async save benchmark: how long training waits for Saver.async_save against a synchronous save of
the same state, how much slower training steps get while the background write runs, and the memory
the host snapshot costs. With CUDA: staging GB/s of CUDA tables into pinned memory against the
pinned device-to-host bandwidth measured in the same run.

    python benchmarks/async_save.py               # ~1 GB state, 3 rounds
    python benchmarks/async_save.py --quick       # ~64 MB, 1 round: smoke test
    python benchmarks/async_save.py --size-gb 2 --rounds 5

Results are printed and written to benchmarks/results/async_save.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

C.ensure_repo_on_path()

import torch  # noqa: E402

from recsave import HashTable, Saver, knobs  # noqa: E402
from recsave.load import contents  # noqa: E402
from recsave.save.snapshot import Stager, capture  # noqa: E402
from recsave.tables.optim import SparseAdagrad  # noqa: E402

STALL_GOAL = 0.05  # steady-state stall / sync save on the CPU (Budgets in benchmarks/README.md)


class Model(torch.nn.Module):
    def __init__(self, tables: int, dim: int, device: str = "cpu"):
        super().__init__()
        self.tables = torch.nn.ModuleList(HashTable(dim, name=f"t{i}", device=device, seed=i)
                                          for i in range(tables))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(tables * dim, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 1)).to(device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.cat([t(ids[:, i]) for i, t in enumerate(self.tables)], -1)
        return self.mlp(x).squeeze(-1)


def build(size_bytes: float, tables: int, dim: int, device: str = "cpu"):
    """A model whose tables (ids + embedding + one Adagrad slot) hold about size_bytes."""
    row_bytes = 8 + 2 * dim * 4
    rows = int(size_bytes / tables / row_bytes)
    model = Model(tables, dim, device)
    sparse = SparseAdagrad(model, lr=0.01)
    dense = torch.optim.Adagrad(model.mlp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for t in model.tables:
        ids = torch.randperm(rows * 4, generator=gen)[:rows] * 2654435761
        values = torch.randn(rows, dim, generator=gen)
        t.load_rows(ids, values, {"adagrad_acc": torch.full((rows, dim), 0.1)})
    return model, sparse, dense, rows


def batches(model: Model, n: int, batch: int, seed: int = 1) -> List[torch.Tensor]:
    """Batches of ids, 90% already in the tables, 10% new."""
    gen = torch.Generator().manual_seed(seed)
    known = [t.ids() for t in model.tables]
    out = []
    for _ in range(n):
        cols = []
        for ids in known:
            pick = ids[torch.randint(0, ids.numel(), (batch,), generator=gen)]
            new = torch.rand(batch, generator=gen) < 0.1
            pick[new] = torch.randint(1 << 40, 1 << 41, (int(new.sum()),), generator=gen)
            cols.append(pick)
        out.append(torch.stack(cols, 1))
    return out


def train_step(model, opts, ids) -> float:
    t0 = time.perf_counter()
    model(ids.to(next(model.mlp.parameters()).device)).pow(2).mean().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure_cpu(args, work: str) -> Dict[str, Any]:
    model, sparse, dense, rows = build(args.size_gb * 1e9, args.tables, args.dim)
    opts = [sparse, dense]
    steps = batches(model, 400, args.batch)
    state_bytes = sum(t.weight.nbytes // t.weight.shape[0] * len(t) * 2 + 8 * len(t) for t in model.tables)
    C.log(f"state: {args.tables} tables x {rows} rows, dim {args.dim}, {state_bytes / 1e9:.2f} GB")
    k = 0

    def step() -> float:
        nonlocal k
        k += 1
        return train_step(model, opts, steps[k % len(steps)])

    for _ in range(10):
        step()  # warm up
    out: Dict[str, List[float]] = {"sync_s": [], "block_s": [], "write_s": [], "base_step_s": [],
                                   "busy_step_s": [], "busy_steps": [], "snapshot_rss_mb": []}
    # One Saver for all rounds, as in a training job: its host buffers are allocated by the first
    # async_save (a warm-up, reported on its own) and reused by the measured ones.
    saver = Saver(model, sparse, output_dir=os.path.join(work, "out"), max_keep=1)
    saver.register_for_checkpointing("dense_opt", dense)
    t0 = time.perf_counter()
    _, write = saver.async_save("ckpt_warmup")
    first_block = time.perf_counter() - t0
    write.result()
    for r in range(args.rounds):
        out["base_step_s"].append(C.median([step() for _ in range(30)]))
        os.sync()
        t0 = time.perf_counter()
        saver.save(f"ckpt_{2 * r}")
        out["sync_s"].append(time.perf_counter() - t0)
        os.sync()
        rss0 = C.current_rss_bytes()
        C.reset_peak_rss()
        t0 = time.perf_counter()
        _, write = saver.async_save(f"ckpt_{2 * r + 1}")
        out["block_s"].append(time.perf_counter() - t0)
        busy = []
        while not write.done():
            busy.append(step())
        write.result()
        out["write_s"].append(time.perf_counter() - t0)
        out["snapshot_rss_mb"].append((C.peak_rss_bytes() - rss0) / 1e6)
        out["busy_step_s"].append(C.median(busy) if busy else float("nan"))
        out["busy_steps"].append(len(busy))
    # Steady state with the knob stage_changed_rows: async saves only, 30 training steps before
    # each (and those that run during the previous write); each copies the rows changed since the
    # previous one.
    changed: Dict[str, List[float]] = {"block_s": [], "staged_fraction": []}
    with knobs.override(stage_changed_rows=True):
        _, write = saver.async_save("ckpt_changed_warmup")  # the whole copy the next ones update
        write.result()
        for r in range(args.rounds):
            for _ in range(30):
                step()
            t0 = time.perf_counter()
            _, write = saver.async_save(f"ckpt_changed_{r}")
            changed["block_s"].append(time.perf_counter() - t0)
            while not write.done():
                step()
            write.result()
            info = saver.last_save
            changed["staged_fraction"].append((info.staged_rows or 0) / sum(len(t) for t in model.tables))
    saver.close()
    restarts = first_save_after_restore(args, saver.output_dir, steps)
    med = {key: C.median(v) for key, v in out.items()}
    med.update({f"changed_{key}": C.median(v) for key, v in changed.items()})
    out.update({f"changed_{key}": v for key, v in changed.items()})
    return {"state_bytes": state_bytes, "rounds": out, "median": med, "first_block_s": first_block,
            "restarts": restarts,
            "block_over_sync": med["block_s"] / med["sync_s"],
            "changed_block_over_sync": med["changed_block_s"] / med["sync_s"],
            "step_slowdown": med["busy_step_s"] / med["base_step_s"],
            "snapshot_gbps": state_bytes / med["block_s"] / 1e9}


def first_save_after_restore(args, output_dir: str, steps: List[torch.Tensor]) -> Dict[str, float]:
    """The stall of the first async_save of a restarted job: a fresh model restored from
    `output_dir`, 30 training steps, then async_save; as a job restarts plain, after
    Saver.prepare_async (what CheckpointManager.restore does in the async modes), and after it with
    the knob stage_changed_rows. One fresh model each, freed before the next."""
    out: Dict[str, float] = {}
    for label, prepare, knob in (("plain", False, False), ("prepare_async", True, False),
                                 ("prepare_async_changed", True, True)):
        model = Model(args.tables, args.dim)
        sparse = SparseAdagrad(model, lr=0.01)
        dense = torch.optim.Adagrad(model.mlp.parameters(), lr=0.01)
        saver = Saver(model, sparse, output_dir=output_dir, max_keep=1)
        saver.register_for_checkpointing("dense_opt", dense)
        with knobs.override(stage_changed_rows=knob):
            saver.load()
            if prepare:
                saver.prepare_async()
            for k in range(30):
                train_step(model, [sparse, dense], steps[k])
            t0 = time.perf_counter()
            _, write = saver.async_save(f"ckpt_restart_{label}")
            out[label] = time.perf_counter() - t0
            write.result()
        saver.close()
        del model, sparse, dense, saver
    return out


def measure_gpu(args) -> Dict[str, Any]:
    """Staging of CUDA tables into pinned memory against raw pinned D2H bandwidth."""
    model, _, _, rows = build(args.gpu_size_gb * 1e9, args.tables, args.dim, device="cuda")
    tables, dense = contents.model_state(model)
    nbytes = sum(t.weight[: len(t)].nbytes * 2 for t in model.tables)
    probe = torch.empty(int(nbytes // 2), dtype=torch.uint8, device="cuda")
    host = torch.empty(probe.numel(), dtype=torch.uint8, pin_memory=True)
    d2h, stage = [], []
    stager = Stager(pinned=True)
    for _ in range(args.rounds + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(probe, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(probe.numel() / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        capture(tables, dense, {}, {}, stager)
        stage.append(nbytes / (time.perf_counter() - t0) / 1e9)
    d2h, stage = d2h[1:], stage[1:]  # the first round allocates the pinned buffers
    return {"staged_bytes": nbytes, "pinned_d2h_gbps": C.median(d2h), "staging_gbps": C.median(stage),
            "staging_over_d2h": C.median(stage) / C.median(d2h), "device": torch.cuda.get_device_name()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0, help="table state (ids + embedding + slot)")
    ap.add_argument("--gpu-size-gb", type=float, default=4.0, help="table state for the CUDA staging test")
    ap.add_argument("--tables", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent of the temporary output dir")
    ap.add_argument("--quick", action="store_true", help="64 MB, 1 round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.size_gb, args.gpu_size_gb, args.rounds = 0.064, 0.064, 1
    result: Dict[str, Any] = {"args": vars(args)}
    with C.bench_tempdir(args.dir) as work:
        result["machine"] = C.machine_info(work)
        result["cpu"] = cpu = measure_cpu(args, work)
    med = cpu["median"]

    def verdict(ratio: float) -> str:
        return "MET" if ratio <= STALL_GOAL else "MISSED"

    def met(stalls: List[float]) -> int:  # rounds whose stall met the goal against that round's sync save
        return sum(b / s <= STALL_GOAL for b, s in zip(stalls, cpu["rounds"]["sync_s"]))

    rows = [
        ["synchronous Saver.save", C.fmt_num(med["sync_s"], 3, " s"), ""],
        ["async_save: training blocked", C.fmt_num(med["block_s"], 3, " s"),
         f"{cpu['block_over_sync']:.3f} x sync (goal <= {STALL_GOAL}: {verdict(cpu['block_over_sync'])}), "
         f"met in {met(cpu['rounds']['block_s'])} of {args.rounds} rounds"],
        ["async_save, knob stage_changed_rows: training blocked", C.fmt_num(med["changed_block_s"], 3, " s"),
         f"{cpu['changed_block_over_sync']:.3f} x sync (goal <= {STALL_GOAL}: "
         f"{verdict(cpu['changed_block_over_sync'])}), met in {met(cpu['rounds']['changed_block_s'])} of "
         f"{args.rounds} rounds; copied {100 * med['changed_staged_fraction']:.1f} % of the rows"],
        ["first async_save: training blocked", C.fmt_num(cpu["first_block_s"], 3, " s"),
         "allocates the host buffers (later saves reuse them)"],
        ["first async_save after a restore", C.fmt_num(cpu["restarts"]["plain"], 3, " s"),
         f"{cpu['restarts']['plain'] / med['sync_s']:.3f} x sync; one run"],
        ["... after prepare_async (CheckpointManager.restore does it)",
         C.fmt_num(cpu["restarts"]["prepare_async"], 3, " s"),
         f"{cpu['restarts']['prepare_async'] / med['sync_s']:.3f} x sync; one run"],
        ["... after prepare_async, knob stage_changed_rows",
         C.fmt_num(cpu["restarts"]["prepare_async_changed"], 3, " s"),
         f"{cpu['restarts']['prepare_async_changed'] / med['sync_s']:.3f} x sync; one run"],
        ["async_save: snapshot speed", C.fmt_num(cpu["snapshot_gbps"], 2, " GB/s"), ""],
        ["async_save: until committed", C.fmt_num(med["write_s"], 3, " s"), ""],
        ["training step, no save", C.fmt_num(med["base_step_s"] * 1e3, 2, " ms"), ""],
        ["training step during the write", C.fmt_num(med["busy_step_s"] * 1e3, 2, " ms"),
         f"{cpu['step_slowdown']:.2f} x ({int(med['busy_steps'])} steps ran during the write)"],
        ["peak RSS added by async_save", C.fmt_num(med["snapshot_rss_mb"], 0, " MB"),
         f"state {cpu['state_bytes'] / 1e6:.0f} MB"],
    ]
    if torch.cuda.is_available():
        result["gpu"] = gpu = measure_gpu(args)
        rows += [["pinned D2H bandwidth", C.fmt_num(gpu["pinned_d2h_gbps"], 2, " GB/s"), gpu["device"]],
                 ["CUDA table staging (async_pinned)", C.fmt_num(gpu["staging_gbps"], 2, " GB/s"),
                  f"{gpu['staging_over_d2h']:.2f} x D2H (goal >= 0.7)"]]
    else:
        rows.append(["CUDA staging", "not measured", "no CUDA device here"])
    print(C.text_table(["what", "figure", "note"], rows))
    print()
    print(C.markdown_table(["what", "figure", "note"], rows))
    default = "results/async_save-quick.json" if args.quick else "results/async_save.json"
    path = C.write_json(args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), default), result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
