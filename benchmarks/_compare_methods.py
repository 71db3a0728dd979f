"""compare.py's methods: the table of save / load methods it measures (raw numpy, dd, torch.save,
DCP, safetensors, the recsave engine and Saver) and their operations, run in a fresh worker process."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import engine as E  # raw, torch, safetensors and engine operations are engine.py's
from _compare_state import Layout

PRELOAD = ["numpy", "torch", "torch.distributed.checkpoint", "recsave", "recsave.format", "safetensors.torch"]

# method -> (label, note, family, durable, output name)
SAVE = {
    "raw": ("raw write (ndarray.tofile)", "physical limit, no fsync", "raw", False, "raw.bin"),
    "raw_fsync": ("raw write + fsync", "file + directory fsync", "raw", True, "raw_fsync.bin"),
    "dd": ("dd bs=64M conv=fdatasync", "zeros, durable: the disk's limit", "raw", True, "dd.bin"),
    "torch": ("torch.save", "no fsync", "torch", False, "state.pt"),
    "dcp": ("DCP save, sync_files=False", "torch.distributed.checkpoint, 1 process", "dcp", False, "dcp"),
    "dcp_fsync": ("DCP save (default: sync_files)", "durable", "dcp", True, "dcp_fsync"),
    "safetensors": ("safetensors save_file", "no fsync", "safetensors", False, "state.safetensors"),
    "engine": ("recsave engine write_shards, fsync off", "CRC32C computed", "engine", False, "engine"),
    "engine_fsync": ("recsave engine write_shards, fsync on", "durable", "engine", True, "engine_fsync"),
    # The engine doing the Saver's data movement: every table's columns gathered in bucket order
    # (RowSource.take of the ids' bucket permutation), as the Saver writes a freshly filled table.
    "engine_gather": ("recsave engine write_shards, rows gathered in bucket order", "the Saver's gather",
                      "engine", False, "engine_gather"),
    "saver": ("recsave Saver.save, fsync off", "HashTable model, whole API", "saver", False, "saver"),
    "saver_fsync": ("recsave Saver.save (default: fsync on)", "durable", "saver", True, "saver_fsync"),
    "saver_restored": ("recsave Saver.save of a restored model, fsync off",
                       "rows in bucket order, as a restore leaves them", "saver", False, "saver_restored"),
    # The steady state of a job with rotation: each save prunes the previous checkpoint (written
    # before the timed save, outside it), as max_keep does between two autosaves.
    "saver_rotating": ("recsave Saver.save replacing its last checkpoint, fsync off",
                       "max_keep=1: prunes the previous one", "saver", False, "saver_rotating"),
    "saver_async": ("recsave Saver.async_save + wait, fsync off", "until committed; RSS over state + staged copy",
                    "saver", False, "saver_async"),
}
# method -> (label, note, save method whose output it reads)
LOAD = {
    "raw": ("raw read (readinto)", "physical limit", "raw"),
    "torch": ("torch.load(weights_only=True)", "", "torch"),
    "dcp": ("DCP load into preallocated tensors", "", "dcp"),
    "safetensors": ("safetensors load_file(backend=pread)", "", "safetensors"),
    "engine_verify": ("recsave engine read_tensors, verify", "", "engine"),
    "engine_noverify": ("recsave engine read_tensors, no verify", "", "engine"),
    "saver": ("recsave Saver.load into a fresh model", "id map rebuilt, CRC verified", "saver"),
    "saver_noverify": ("recsave Saver.load, checksums off", "patched in: not an option", "saver"),
    # The engine alone on the Saver's own files (row metadata too, segments cut at buckets): what a
    # restore costs beyond reading them is the table rebuild (id maps, views).
    "engine_saverfile": ("recsave engine read_tensors of the Saver's checkpoint", "its files, + 3 % row metadata",
                         "saver"),
}
KINDS = {"save": SAVE, "load": LOAD}
FAMILIES = ["raw", "torch", "dcp", "safetensors", "engine", "saver"]
SWEEP_DEFAULT = ["save:raw", "save:torch", "save:dcp", "save:safetensors", "save:engine", "save:saver",
                 "save:engine_gather",
                 "save:saver_restored",
                 "save:saver_rotating",
                 "save:saver_async",
                 "load:raw", "load:torch", "load:dcp", "load:safetensors", "load:engine_verify", "load:saver",
                 "load:engine_saverfile"]


def selected(only: Optional[str], default: Optional[List[str]] = None) -> Dict[str, List[str]]:
    """kind -> methods; loads pull in the save whose output they read."""
    wanted = set(only.split(",")) if only and only != "all" else set(default or [])
    methods = {k: [m for m in t if not wanted or f"{k}:{m}" in wanted] for k, t in KINDS.items()}
    unknown = wanted - {f"{k}:{m}" for k, t in KINDS.items() for m in t}
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; known: "
                         f"{', '.join(f'{k}:{m}' for k, t in KINDS.items() for m in t)}")
    for m in methods["load"]:
        if LOAD[m][2] not in methods["save"]:
            methods["save"].append(LOAD[m][2])
    return methods


# ------------------------------------------------------------------------------------------------
# Operations (inside a fresh worker process; only these are timed)

def run_save(method: str, spec: Dict[str, Any], state: Any, model: Any) -> Optional[Dict[str, Any]]:
    """Runs one save; returns extra figures of the sample (an async save's stall), if any."""
    path = spec["path"]
    if method in ("raw", "raw_fsync", "torch", "safetensors"):
        E._save(method, spec, state)
    elif method in ("engine", "engine_fsync"):
        E._save(method.replace("engine", "recsave"), spec, state)
    elif method == "engine_gather":
        from recsave import format as fmt
        from recsave import knobs
        with knobs.override(fsync=False):
            part = fmt.write_shards(path, state, concurrency=spec["concurrency"])
            fmt.write_index(path, fmt.merge_parts([part]))
    elif method == "dd":
        import subprocess
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={spec['dd_count']}",
                        "conv=fdatasync", "status=none"], check=True)
    elif method in ("dcp", "dcp_fsync"):
        import warnings

        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=method == "dcp_fsync"))
    elif method in ("saver", "saver_fsync", "saver_restored", "saver_rotating"):
        from recsave import knobs
        with knobs.override(fsync=method == "saver_fsync"):
            spec["saver"].save("ckpt_1")
    elif method == "saver_async":  # the first async save of the process: its stage buffers are new
        import time

        from recsave import knobs
        with knobs.override(fsync=False):
            start = time.perf_counter()
            spec["saver"].async_save("ckpt_1")
            stall = time.perf_counter() - start
            spec["saver"].wait()
        return {"stall_s": stall}
    else:
        raise ValueError(method)
    return None


def run_load(method: str, spec: Dict[str, Any], layout: Layout, dest: Any) -> Any:
    if method in ("raw", "torch", "safetensors"):
        return E._load(method, spec, layout)
    if method in ("engine_verify", "engine_noverify"):
        return E._load(method.replace("engine", "recsave"), spec, layout)
    if method == "dcp":
        import warnings

        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(dest, checkpoint_id=spec["path"])
        return dest
    if method in ("saver", "saver_noverify"):
        return spec["saver"].load()
    if method == "engine_saverfile":
        from recsave import format as fmt
        return fmt.read_tensors(os.path.join(spec["path"], "ckpt_1"), concurrency=spec["concurrency"], verify=True)
    raise ValueError(method)


def patch_saver_no_verify() -> List[int]:
    """Saver.load always verifies; for the checksum-overhead row, make the reads it does skip the
    CRC (recsave.load.sources.read_tensors with verify=False). Returns a call counter: [0] = not applied."""
    import recsave.load.sources as sources

    calls = [0]
    original = getattr(sources, "read_tensors", None)
    if original is None:
        return calls

    def unverified(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        kwargs["verify"] = False
        return original(*args, **kwargs)

    sources.read_tensors = unverified
    return calls

