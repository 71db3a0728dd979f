"""Corruption fuzzing of the checkpoint reader.

    python benchmarks/fuzz.py [--mutations 2000] [--seed 0] [--workers 2] [--kinds reader] [--chain]
                              [--asan] [--json PATH]

Builds a small valid output dir (the CTR job of tests/helpers.py: two hash tables with Adagrad slots,
batch norm and MLP, Adam and global_step as extras, a reader as io state; autosaved at steps 2 and 4,
so `checkpoint` lists ckpt_2 and ckpt_4), with small checksum segments. Then, per case, copies it,
applies one mutation and loads the copy in a worker process two ways:

* ``Saver.load()`` of the output dir into a fresh model (latest checkpoint per `checkpoint`);
* ``recsave.format.read_tensors(<latest dir>)``.

Each must either raise a ``recsave.RecsaveError`` subclass or - only when the mutation changed no byte
that matters (see ``classify``: e.g. header padding, informational index keys, files of another
checkpoint, a `checkpoint` file still naming a valid checkpoint) - load values bit-identical to the
reference of the checkpoint it names. Another exception, a silent wrong value, a hang (per-case
timeout), a crashed worker (segfault, abort) or, with ``--asan``, any AddressSanitizer / UBSan report
is a failure. Exits 1 on any failure.

``--kinds`` picks the mutation kinds (comma-separated kinds or groups): ``reader`` (default: the
byte-level kinds above), ``list`` (the `checkpoint` file deleted, emptied, garbled, with stale ids
or duplicated lines) and ``dirs`` (extra directories: empty, with junk, a copy of a checkpoint
without index; most with a damaged `checkpoint` file too), or ``all``. For ``list`` and ``dirs``
cases every checkpoint directory is intact, and the worker instead restores with a
CheckpointManager (fallback on), saves ``ckpt_100`` (max_keep 2) and runs ``recsave gc``: the
restore must return the newest intact checkpoint that the file means (docs/FORMAT.md section 1:
the list rebuilt from the indexes when the file is lost or garbled, stale ids skipped), and
afterwards exactly the checkpoints max_keep keeps of that list plus ``ckpt_100`` may remain, with
no other committed checkpoint deleted and other directories untouched.

``--chain`` (reader kinds only) builds a chain instead: ``ckpt_2`` full and ``ckpt_4`` a delta of
it (docs/FORMAT.md section 10; the manager with ``full_every=3``), and mutates the files of both
about equally often. Damage to a chain member counts as damage of every checkpoint that needs it
(``NEEDS``): any changed byte of ``ckpt_2/index`` (the delta holds its CRC32C) or a damaged file of
``ckpt_2`` makes ``ckpt_4`` unloadable, so ``Saver.load()`` must raise (or load an intact checkpoint
the `checkpoint` file names), never return values of a broken chain. ``read_tensors(ckpt_4)`` reads
the delta's own tensors only, so parent damage does not concern it.

``--asan`` compiles csrc/core/*.cc + csrc/bindings/*.cc with ``-fsanitize=address,undefined`` into
``recsave/_C*.so`` of a temporary copy of the package, puts it first on PYTHONPATH of the workers and
runs them with ``LD_PRELOAD=$(g++ -print-file-name=libasan.so)`` and ``ASAN_OPTIONS=detect_leaks=0``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import select
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")

sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/_common.py)

LATEST, OLDER = "ckpt_4", "ckpt_2"
# checkpoint -> the chain members it needs (its parents up to the base); set by run(chain=True)
NEEDS: Dict[str, List[str]] = {}
RESULT = "@@RESULT "
READY = "@@READY "

# Index keys whose change cannot alter the tensor values loaded (FORMAT.md: informational, free-form,
# only used for resharding, or the seal: an index without `index_crc32c` is one written before seals,
# read as it stands); a changed `step` that loads is reported separately. A sealed index refuses
# every edit of these too, which is always an allowed outcome.
INDEX_LENIENT_TOP = {"recsave_version", "created_at", "step", "meta", "world_size", "bucket_ranges",
                     "index_crc32c"}
INDEX_LENIENT_FILE = {"rank"}
SEAL_KEY = "index_crc32c"  # docs/FORMAT.md section 3, "The seal"
INDEX_LENIENT_CHUNK = {"buckets", "segment_bytes", "segments", "bucket_segments"}  # segments: CRCs must still match


# =============================================================================== worker (loads)
def worker_main(ref_path: str) -> int:
    sys.path[:0] = [TESTS]
    import traceback

    import torch
    from helpers import assert_jobs_equal, job_state, make_job, same_bits

    import recsave

    torch.set_num_threads(1)
    refs = torch.load(ref_path, weights_only=False)
    print(READY + json.dumps({"_C": recsave._C.__file__, "recsave": recsave.__file__}), flush=True)

    def tail(exc: BaseException) -> str:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-1500:]

    def load(out: str) -> Dict[str, Any]:
        try:
            job = make_job(out, save_interval=2, max_keep=2)
            report = job.saver.load()
            state, gstep = job_state(job), job.manager.global_step
        except recsave.RecsaveError as exc:
            return {"outcome": "error", "type": type(exc).__name__, "msg": str(exc)[:300]}
        except BaseException as exc:
            return {"outcome": "exception", "type": type(exc).__name__, "msg": tail(exc)}
        diffs = {}
        for cid, ref in refs.items():
            try:
                assert_jobs_equal(state, ref["job"])
                assert gstep == ref["global_step"], f"global_step {gstep} != {ref['global_step']}"
            except AssertionError as exc:
                diffs[cid] = str(exc)[:300]
                continue
            res = {"outcome": "identical", "ckpt": cid}
            if report.step != ref["step"]:
                res["step"] = report.step
            return res
        return {"outcome": "different", "msg": json.dumps(diffs)}

    def read(ckpt_dir: str) -> Dict[str, Any]:
        try:
            got = recsave.format.read_tensors(ckpt_dir)
        except recsave.RecsaveError as exc:
            return {"outcome": "error", "type": type(exc).__name__, "msg": str(exc)[:300]}
        except BaseException as exc:
            return {"outcome": "exception", "type": type(exc).__name__, "msg": tail(exc)}
        want = refs[LATEST]["tensors"]
        bad = sorted(set(got) ^ set(want)) + [n for n in got if n in want and not same_bits(got[n], want[n])]
        if bad:
            return {"outcome": "different", "msg": f"tensors differ: {bad[:10]}"}
        return {"outcome": "identical", "ckpt": LATEST}

    def restore_save_gc(out: str) -> Dict[str, Any]:
        """list / dirs cases: restore, one save (rotation), gc; what was restored and what is left."""
        import warnings

        from recsave.tools import catalog

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                job = make_job(out, save_interval=2, max_keep=2)
                step = job.manager.restore()
                state = job_state(job)
            except BaseException as exc:
                return {"restore": {"outcome": "exception", "type": type(exc).__name__, "msg": tail(exc)}}
            restored: Dict[str, Any] = {"outcome": "different", "step": step}
            for cid, ref in refs.items():
                try:
                    assert_jobs_equal(state, ref["job"])
                except AssertionError:
                    continue
                restored = {"outcome": "identical", "ckpt": cid, "step": step}
            try:
                job.manager.global_step = 100
                job.manager.save()
                job.saver.close()
                catalog.collect_garbage(out)
            except BaseException as exc:
                return {"restore": restored, "after": {"outcome": "exception", "type": type(exc).__name__,
                                                       "msg": tail(exc)}}
        dirs = sorted(n for n in os.listdir(out) if os.path.isdir(os.path.join(out, n)))
        try:
            with open(os.path.join(out, "checkpoint")) as f:
                listed: Optional[str] = f.read()
        except (OSError, UnicodeDecodeError):
            listed = None
        return {"restore": restored, "warnings": [str(w.message)[:300] for w in caught],
                "after": {"outcome": "done", "dirs": dirs, "list": listed,
                          "committed": [d for d in dirs if os.path.isfile(os.path.join(out, d, "index"))]}}

    for line in sys.stdin:
        req = json.loads(line)
        if req.get("mode") == "list":
            res = {"case": req["case"], **restore_save_gc(req["out"])}
        else:
            res = {"case": req["case"], "load": load(req["out"]),
                   "read": read(os.path.join(req["out"], LATEST))}
        sys.stdout.write(RESULT + json.dumps(res) + "\n")
        sys.stdout.flush()
    return 0


# ======================================================================= building the checkpoint
def build(base: str, chain: bool = False) -> Tuple[str, str]:
    """The pristine output dir and the references file (run in a child: the parent stays torch-free).
    With `chain`, ckpt_4 is a delta of ckpt_2."""
    out, ref_path = os.path.join(base, "pristine"), os.path.join(base, "refs.pt")
    manager_kw = {"full_every": 3, "rebase_ratio": 1e9} if chain else {}
    code = f"""
import sys, os
sys.path[:0] = [{TESTS!r}]
import torch, recsave
from helpers import make_job, job_state
out, ref_path = {out!r}, {ref_path!r}
refs = {{}}
with recsave.knobs.override(segment_bytes=512, fsync=False):
    job = make_job(out, save_interval=2, max_keep=2, manager_kw={manager_kw!r})
    for step, cid in ((2, {OLDER!r}), (4, {LATEST!r})):
        job.train(2)
        refs[cid] = {{"job": job_state(job), "global_step": job.manager.global_step, "step": step,
                      "tensors": recsave.format.read_tensors(os.path.join(out, cid))}}
    job.saver.close()
kinds = [recsave.format.index.read(os.path.join(out, c)).kind for c in ({OLDER!r}, {LATEST!r})]
assert kinds == (["full", "delta"] if {chain!r} else ["full", "full"]), kinds
# sanity: the pristine copy loads back to exactly the trained state
check = make_job(out, save_interval=2, max_keep=2)
check.saver.load()
from helpers import assert_jobs_equal
assert_jobs_equal(job_state(check), refs[{LATEST!r}]["job"])
torch.save(refs, ref_path)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        raise SystemExit(f"building the checkpoint failed:\n{proc.stdout}\n{proc.stderr}")
    for junk in glob.glob(os.path.join(out, ".*")):  # the writer lock (if any) is not part of it
        os.remove(junk)
    return out, ref_path


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["RECSAVE_FSYNC"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, ROOT, env.get("PYTHONPATH", "")]))
    env.update(extra or {})
    return env


# =========================================================================== ASan extension build
def build_asan(work: str) -> Dict[str, str]:
    """Compiles the extension with ASan+UBSan into a copy of the package; returns the worker env."""
    pkg_root = os.path.join(work, "asan-pkg")
    shutil.copytree(os.path.join(ROOT, "recsave"), os.path.join(pkg_root, "recsave"),
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    import pybind11

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    target = os.path.join(pkg_root, "recsave", "_C" + suffix)
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "core", "*.cc"))) + \
        sorted(glob.glob(os.path.join(ROOT, "csrc", "bindings", "*.cc")))
    flags = ["-std=c++17", "-O1", "-g", "-fPIC", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
             "-fno-omit-frame-pointer", "-fvisibility=hidden", "-pthread",
             f"-I{os.path.join(ROOT, 'csrc')}", f"-I{pybind11.get_include()}",
             f"-I{sysconfig.get_paths()['include']}"]
    objdir = os.path.join(work, "asan-obj")
    os.makedirs(objdir)
    procs = []
    for src in sources:  # parallel compiles, one object each
        obj = os.path.join(objdir, os.path.basename(os.path.dirname(src)) + "_" + os.path.basename(src) + ".o")
        procs.append((src, obj, subprocess.Popen(["g++", *flags, "-c", src, "-o", obj],
                                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        if len([p for *_, p in procs if p.poll() is None]) >= (os.cpu_count() or 2):
            procs[-1][2].wait()
    objs = []
    for src, obj, p in procs:
        text = p.communicate()[0]
        if p.returncode != 0:
            raise SystemExit(f"--asan: compiling {src} failed:\n{text}")
        objs.append(obj)
    link = subprocess.run(["g++", "-shared", "-fsanitize=address,undefined", "-pthread", *objs, "-o", target],
                          capture_output=True, text=True)
    if link.returncode != 0:
        raise SystemExit(f"--asan: linking failed:\n{link.stderr}")
    preload = []
    for lib in ("libasan.so", "libstdc++.so"):
        path = subprocess.run(["g++", f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
        if not os.path.isabs(path) or not os.path.exists(path):
            raise SystemExit(f"--asan: g++ does not know {lib} ({path!r})")
        preload.append(path)
    # libstdc++ is preloaded too: python itself does not link it, so without it ASan's __cxa_throw
    # interceptor finds no real __cxa_throw at start-up and aborts on the first C++ exception
    # ("CHECK failed: asan_interceptors.cpp ... real___cxa_throw != 0").
    return {"LD_PRELOAD": " ".join(preload), "PYTHONPATH": os.pathsep.join([pkg_root, TESTS, ROOT]),
            # Python and torch leak by design at exit: leak checking would report them, not recsave.
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1", "_RECSAVE_ASAN_SO": target}


# ===================================================================================== mutations
@dataclass
class Mutation:
    kind: str
    desc: str
    names: Set[str] = field(default_factory=lambda: {LATEST})  # what `checkpoint` may name as latest
    damaged: Set[str] = field(default_factory=set)  # checkpoints with a byte that matters changed
    # checkpoints whose index or table rows (shards) are damaged: what a delta needs of its parents
    rows_damaged: Set[str] = field(default_factory=set)
    via_parent: Set[str] = field(default_factory=set)  # damaged only as a chain member's child
    allowed_read: bool = True  # read_tensors(ckpt_4) may return identical values
    index_touched: Set[str] = field(default_factory=set)  # checkpoints whose index changed in any way
    # list / dirs kinds: what restore must return and which committed checkpoints remain after a
    # save of ckpt_100 (max_keep 2) and gc; directories that must survive
    expect_restore: Optional[str] = None
    expect_kept: List[str] = field(default_factory=list)
    must_remain: List[str] = field(default_factory=list)

    @property
    def allowed_load(self) -> Set[str]:
        return self.names - self.damaged


def _files(out: str) -> List[str]:
    rels = []
    for dirpath, _, files in os.walk(out):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), out)
            if not os.path.basename(rel).startswith("."):
                rels.append(rel)
    return sorted(rels)


ID = r"[A-Za-z0-9_.-]+"


def _parse_list(data: bytes) -> Optional[List[str]]:
    """The ids of a `checkpoint` file (a repeated id counts where it appears last), None when it
    is garbled (FORMAT.md section 1)."""
    import re
    try:
        lines = [ln.strip() for ln in data.decode("utf-8").splitlines()]
    except UnicodeDecodeError:
        return None
    ids: List[str] = []
    for ln in filter(None, lines):
        if not re.fullmatch(ID, ln) or ln in (".", "..", "checkpoint"):
            return None
        if ln in ids:
            ids.remove(ln)
        ids.append(ln)
    return ids


def _has_index(out: str, ckpt: str) -> bool:
    return os.path.lexists(os.path.join(out, ckpt, "index"))


def _list_model(out: str) -> Tuple[Optional[List[str]], List[str]]:
    """(the ids as a reader takes them, None when it rebuilds from the indexes; the listed ids
    that are stale). A reader rebuilds when the file is missing, empty, garbled, lists no id
    with an index, or is cut short (a last line without its newline that is stale or begins an
    unlisted directory's name: docs/FORMAT.md section 1); a writer also drops stale ids."""
    data = _read(os.path.join(out, "checkpoint"))
    ids = _parse_list(data) if data is not None else None
    if not ids:
        return None, []
    assert data is not None
    stale = [i for i in ids if not _has_index(out, i)]
    last = ids[-1]
    cut = not data.endswith(b"\n") and (last in stale or any(
        n != last and n.startswith(last) and n not in ids for n in os.listdir(out)))
    return (None, stale) if len(stale) == len(ids) or cut else (ids, stale)


def expected_latest(out: str, m: Mutation) -> Set[str]:
    """Which checkpoints a plain Saver.load() of the output dir may load (reader kinds)."""
    ids, _ = _list_model(out)  # a `checkpoint` that is no regular file counts as garbled
    if ids is not None:
        return {ids[-1]}
    names: Set[str] = set()  # rebuilt: the newest index that validates; a changed one may or may not
    for c in (LATEST, OLDER):
        if _has_index(out, c) and not os.path.isdir(os.path.join(out, c, "index")):
            names.add(c)
            if c not in m.index_touched:
                break
    return names


def _strict_eq(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_strict_eq(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_strict_eq(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def _files_read(old: Any, new: Any, *, shards_only: bool) -> Tuple[Any, Any]:
    """old and new with only the file entries a reader opens: a load opens the shard files and the
    dense files old lists (never io_state_count: the count is in `meta`), read_tensors only the
    shard files (those old's chunks name). An entry of another file may change without changing
    what is read (in an unsealed index; a sealed one refuses any edit)."""
    if not isinstance(old, dict) or not isinstance(old.get("files"), dict):
        return old, new
    keep = set(old["files"]) - {"io_state_count"}
    if shards_only:
        keep &= {c.get("file") for t in old.get("tensors", {}).values() if isinstance(t, dict)
                 for c in t.get("chunks", []) if isinstance(c, dict)}

    def only(index: Any) -> Any:
        if not isinstance(index, dict) or not isinstance(index.get("files"), dict):
            return index
        return dict(index, files={k: v for k, v in index["files"].items() if k in keep})
    return only(old), only(new)


def index_equivalent(old: Any, new: Any) -> bool:
    """Whether a changed index still means the same bytes for the same tensors (lenient keys aside)."""
    if not isinstance(new, dict):
        return False
    for k in old:
        if k in INDEX_LENIENT_TOP:
            continue
        if k not in new:
            return False
        if k == "files":
            if not isinstance(new[k], dict) or new[k].keys() != old[k].keys():
                return False
            for f, e in old[k].items():
                ne = new[k][f]
                if not isinstance(ne, dict) or {x for x in ne if x not in INDEX_LENIENT_FILE} != \
                        {x for x in e if x not in INDEX_LENIENT_FILE}:
                    return False
                if not all(_strict_eq(e[x], ne[x]) for x in e if x not in INDEX_LENIENT_FILE):
                    return False
        elif k == "tensors":
            if not isinstance(new[k], dict) or new[k].keys() != old[k].keys():
                return False
            for t, e in old[k].items():
                ne = new[k][t]
                if not isinstance(ne, dict) or ne.keys() != e.keys():
                    return False
                for x in e:
                    if x != "chunks":
                        if not _strict_eq(e[x], ne[x]):
                            return False
                        continue
                    if not isinstance(ne[x], list) or len(ne[x]) != len(e[x]):
                        return False
                    for c, nc in zip(e[x], ne[x]):
                        if not isinstance(nc, dict):
                            return False
                        if {y for y in c if y not in INDEX_LENIENT_CHUNK} != \
                                {y for y in nc if y not in INDEX_LENIENT_CHUNK}:
                            return False
                        if not all(_strict_eq(c[y], nc[y]) for y in c if y not in INDEX_LENIENT_CHUNK):
                            return False
        elif k == "partition":
            o, n = old[k], new[k]
            if isinstance(o, dict) and isinstance(n, dict) and "scheme" in o:
                if not _strict_eq(o["scheme"], n.get("scheme")):
                    return False
            elif not _strict_eq(o, n):
                return False
        elif not _strict_eq(old[k], new[k]):
            return False
    return True


def _header_of(data: bytes) -> Optional[Tuple[int, Any]]:
    if len(data) < 8:
        return None
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        return None
    try:
        return n, json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


def shard_equivalent(old: bytes, new: bytes) -> bool:
    if len(old) != len(new) or old[:8] != new[:8]:
        return False
    n = int.from_bytes(old[:8], "little")
    if old[8 + n:] != new[8 + n:]:
        return False
    h_old, h_new = _header_of(old), _header_of(new)
    if h_new is None or not isinstance(h_new[1], dict):
        return False
    a = {k: v for k, v in h_old[1].items() if k != "__metadata__"}  # type: ignore[index]
    b = {k: v for k, v in h_new[1].items() if k != "__metadata__"}
    return _strict_eq(a, b)


def classify(m: Mutation, rel: str, old: Optional[bytes], new: Optional[bytes], *,
             symlink: bool = False) -> None:
    """Records whether `rel` changing from old to new (None: the file is gone or is no longer a
    regular file) changed a byte that matters, i.e. which identical loads stay acceptable."""
    if old is not None and new is not None and old == new:
        return
    parts = rel.split(os.sep)
    if parts == ["checkpoint"]:
        return  # mutate() works out what it names at the end; a reader of the latest dir never looks at it
    ckpt, fname = parts[0], parts[-1]
    if fname == "io_state_count":
        return  # written and listed, but never read: the loader takes the count from the index meta
    if fname == "index":
        if symlink:
            return  # FORMAT.md refuses symlinks among the files the index lists; the index is not one
        m.index_touched.add(ckpt)
        ok = read_ok = False
        if old is not None and new is not None:
            try:
                a, b = json.loads(old.decode("utf-8")), json.loads(new.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                pass
            else:
                ok = index_equivalent(*_files_read(a, b, shards_only=False))
                read_ok = ok or index_equivalent(*_files_read(a, b, shards_only=True))
        if not ok:
            m.damaged.add(ckpt)
            m.rows_damaged.add(ckpt)
        m.allowed_read &= read_ok or ckpt != LATEST
        return
    if fname.startswith("sparse-"):
        if old is None or new is None or not shard_equivalent(old, new):
            m.damaged.add(ckpt)
            m.rows_damaged.add(ckpt)
            m.allowed_read &= ckpt != LATEST
        return
    m.damaged.add(ckpt)  # model.pt, extra.pt, io states: whole-file CRC32C


def propagate(m: Mutation) -> None:
    """Damage to a chain member is damage of every checkpoint that needs it: any changed byte of a
    parent's index (a delta holds the CRC32C of its parent's index bytes) or damage to its rows
    (index, shards). A parent's model.pt, extra.pt and io states are not needed: a delta's dense
    state, extras and io states are its own (docs/FORMAT.md section 10, merge semantics), so a
    delta loading identical values despite them is right."""
    for ckpt, needs in NEEDS.items():
        if ckpt not in m.damaged and any(c in m.rows_damaged or c in m.index_touched for c in needs):
            m.damaged.add(ckpt)
            m.via_parent.add(ckpt)


def _read(path: str) -> Optional[bytes]:
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


NUMBERS = [0, 1, -1, 7, 2 ** 31, 2 ** 32 + 1, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63, 10 ** 30, 1.5,
           1e308, float("nan"), float("inf")]
STRINGS = ["", ".", "..", "../x", "../ckpt_2/index", "/etc/passwd", "/tmp/recsave-fuzz-abs", "a/b", "x" * 300,
           "é", "index", "model.pt", "extra.pt", "io_state_0.pt", "checkpoint", "sparse-0-0.safetensors",
           "sparse-0-1.safetensors", "sparse-0-9.safetensors", "float32", "float16", "bfloat16", "int64",
           "int32", "uint8", "bool", "complex128", "float8_e4m3fn", "qint8", "int3", "bits8", "bogus",
           "recsave.index", "mix64", "F32", "I64", "U8"]


def _mutate_json(rng: random.Random, obj: Any) -> str:
    """Mutates one node of a JSON document in place; returns what it did."""
    nodes: List[Tuple[Any, Any, str]] = []  # (container, key, path)

    def walk(o: Any, path: str) -> None:
        if isinstance(o, dict):
            for k, v in o.items():
                nodes.append((o, k, f"{path}.{k}"))
                walk(v, f"{path}.{k}")
        elif isinstance(o, list):
            for i, v in enumerate(o):
                nodes.append((o, i, f"{path}[{i}]"))
                walk(v, f"{path}[{i}]")
    walk(obj, "")
    cont, key, path = rng.choice(nodes)
    val = cont[key]
    r = rng.random()
    if r < 0.08 and isinstance(cont, dict):
        del cont[key]
        return f"delete {path}"
    if r < 0.12 and isinstance(cont, dict):
        cont[key + "_x"] = 1
        return f"add key {path}_x"
    if isinstance(val, bool) or val is None:
        new: Any = rng.choice([True, False, None, 0, 1, "true"])
    elif isinstance(val, (int, float)):
        new = rng.choice([val + 1, val - 1, -val, val * 2, val // 2 if isinstance(val, int) else val / 2,
                          float(val), str(val), None, [val]] + NUMBERS)
    elif isinstance(val, str):
        new = rng.choice(STRINGS + [val + "x", val[:-1], val.upper(), 1, None, [val]])
    elif isinstance(val, list):
        choice = rng.randrange(5)
        if choice == 0 and val:
            new = val[:-1]
        elif choice == 1 and val:
            new = val + [val[-1]]
        elif choice == 2:
            new = list(reversed(val))
        elif choice == 3:
            new = []
        else:
            new = {"0": val}
    else:  # dict
        new = rng.choice([{}, [], None, "x", {**val, "zz": 1}])
    cont[key] = new
    return f"{path}: {json.dumps(val)[:60]} -> {json.dumps(new)[:60]}"


KINDS = ["bitflip", "byteset", "truncate", "append", "delete", "swap", "dup_range", "zero_range",
         "index_json", "header_json", "header_len", "checkpoint_file", "symlink", "replace_by_dir"]


def mutate(rng: random.Random, out: str, kind: str) -> Mutation:
    files = _files(out)
    latest_files = [f for f in files if f.startswith(LATEST + os.sep)]
    # chain mode: the parents' files about as often as the delta's
    parent_files = [f for f in files if f.split(os.sep)[0] in NEEDS.get(LATEST, [])]
    pool = latest_files + parent_files
    shards = [f for f in pool if os.path.basename(f).startswith("sparse-")]

    def pick() -> str:
        r = rng.random()
        if not parent_files:
            return rng.choice(latest_files if r < 0.8 else files)
        return rng.choice(latest_files if r < 0.45 else parent_files if r < 0.9 else files)

    m = Mutation(kind, "")

    def change(rel: str, new: Optional[bytes], desc: str) -> None:
        path = os.path.join(out, rel)
        old = _read(path)
        if new is None:
            os.remove(path)
        else:
            _write(path, new)
        classify(m, rel, old, new)
        m.desc = (m.desc + "; " if m.desc else "") + f"{rel}: {desc}"

    if kind in ("bitflip", "byteset", "truncate", "append", "dup_range", "zero_range"):
        rel = pick()
        data = bytearray(_read(os.path.join(out, rel)) or b"")
        n = len(data)
        if kind == "bitflip" and n:
            pos, bit = rng.randrange(n), rng.randrange(8)
            # bias towards the interesting first bytes (length prefix, headers)
            if rng.random() < 0.4:
                pos = rng.randrange(min(n, 600))
            data[pos] ^= 1 << bit
            desc = f"flip bit {bit} of byte {pos}"
        elif kind == "byteset" and n:
            pos = rng.randrange(min(n, 600)) if rng.random() < 0.4 else rng.randrange(n)
            val = rng.choice([0, 0x20, 0xff, ord('"'), ord("}"), ord("9"), ord("-"), rng.randrange(256)])
            data[pos] = val
            desc = f"byte {pos} := {val:#x}"
        elif kind == "truncate":
            new_len = rng.choice([0, 1, 7, 8, 9, max(0, n - 1), rng.randrange(n + 1)])
            data = data[:min(new_len, n)]
            desc = f"truncate {n} -> {len(data)}"
        elif kind == "append":
            extra = rng.choice([b"\0", b" ", b"\n", os.urandom(rng.randrange(1, 64))])
            data += extra
            desc = f"append {len(extra)} bytes"
        elif kind == "dup_range" and n > 1:
            length = rng.randrange(1, min(n, 256))
            src, dst = rng.randrange(n - length + 1), rng.randrange(n - length + 1)
            data[dst:dst + length] = data[src:src + length]
            desc = f"copy [{src}, {src + length}) to {dst}"
        elif kind == "zero_range" and n:
            length = rng.randrange(1, min(n, 256) + 1)
            start = rng.randrange(n - length + 1)
            data[start:start + length] = bytes(length)
            desc = f"zero [{start}, {start + length})"
        else:
            desc = "no-op (empty file)"
        change(rel, bytes(data), desc)
    elif kind == "delete":
        rel = pick() if rng.random() < 0.9 else "checkpoint"
        change(rel, None, "deleted")
    elif kind == "swap":
        a, b = rng.sample(files, 2)
        da, db = _read(os.path.join(out, a)), _read(os.path.join(out, b))
        change(a, db, f"contents of {b}")
        change(b, da, f"contents of {a}")
    elif kind == "index_json":
        rel = os.path.join(LATEST if rng.random() < (0.9 if not NEEDS else 0.5) else OLDER, "index")
        obj = json.loads(_read(os.path.join(out, rel)))  # type: ignore[arg-type]
        # Half the time the seal goes first, as in an index an older recsave wrote: the edit then
        # reaches the index's own rules instead of stopping at its checksum.
        unsealed = SEAL_KEY in obj and rng.random() < 0.5
        if unsealed:
            del obj[SEAL_KEY]
        what = _mutate_json(rng, obj) + (" (seal removed)" if unsealed else "")
        change(rel, json.dumps(obj, separators=(",", ":")).encode(), what)
    elif kind == "header_json":
        rel = rng.choice(shards)
        data = _read(os.path.join(out, rel)) or b""
        n, hdr = _header_of(data)  # type: ignore[misc]
        what = _mutate_json(rng, hdr)
        text = json.dumps(hdr, separators=(",", ":")).encode()
        if len(text) <= n and rng.random() < 0.7:
            new = data[:8] + text + b" " * (n - len(text)) + data[8 + n:]  # same length: offsets intact
            what += " (padded in place)"
        else:
            text += b" " * (-len(text) % 8)
            new = len(text).to_bytes(8, "little") + text + data[8 + n:]
            what += f" (header {n} -> {len(text)} bytes)"
        change(rel, new, what)
    elif kind == "header_len":
        rel = rng.choice(shards)
        data = _read(os.path.join(out, rel)) or b""
        n = int.from_bytes(data[:8], "little")
        new_n = rng.choice([0, 1, n - 8, n + 8, len(data) - 8, len(data), 2 ** 63, 2 ** 64 - 1, 100 << 20,
                            (100 << 20) + 1, 2 ** 32])
        change(rel, new_n.to_bytes(8, "little") + data[8:], f"header length {n} -> {new_n}")
    elif kind == "checkpoint_file":
        choices = [b"", b"\n", b"ckpt_2\n", b"ckpt_4\nckpt_2\n", b"../x\n", b"/etc\n", b"ckpt_9\n",
                   b"ckpt_4", b"  ckpt_2\n\n ckpt_4  \n\n", b"ckpt_2\nckpt_4\nckpt_2\n", b"\xff\xfe\n",
                   b"ckpt_4\x00\n", b"checkpoint\n", b"ckpt_4/../ckpt_2\n", b".\n", b"..\n",
                   b"x" * 300 + b"\n", b"ckpt_2\r\nckpt_4\r\n", b"ckpt_lo\n", b"ckpt_2\nckpt_4\nckpt_lo\n",
                   b"ckpt_4\nckpt_nodir\n"]
        new = rng.choice(choices)
        if b"ckpt_lo" in new:  # a leftover of a crashed save: every file but the index
            shutil.copytree(os.path.join(out, LATEST), os.path.join(out, "ckpt_lo"))
            os.remove(os.path.join(out, "ckpt_lo", "index"))
        change("checkpoint", new, f"contents := {new[:60]!r}")
    elif kind == "symlink":
        rel = rng.choice(pool)
        path = os.path.join(out, rel)
        old = _read(path)
        shutil.copyfile(path, path + ".real")
        os.rename(path + ".real", os.path.join(out, "real-" + os.path.basename(rel)))
        os.remove(path)
        os.symlink(os.path.join(out, "real-" + os.path.basename(rel)), path)
        classify(m, rel, old, None, symlink=True)  # FORMAT.md: a listed file that is a symbolic link MUST be refused
        m.desc = f"{rel}: replaced by a symlink to an identical copy"
    elif kind == "replace_by_dir":
        rel = pick()
        path = os.path.join(out, rel)
        old = _read(path)
        os.remove(path)
        os.mkdir(path)
        classify(m, rel, old, None)
        m.desc = f"{rel}: replaced by a directory"
    propagate(m)
    m.names = expected_latest(out, m)
    return m


LIST_KINDS = ["list_deleted", "list_emptied", "list_garbled", "list_stale", "list_duplicated"]
DIR_KINDS = ["dir_empty", "dir_junk", "dir_copy"]
GROUPS = {"reader": KINDS, "list": LIST_KINDS, "dirs": DIR_KINDS, "all": KINDS + LIST_KINDS + DIR_KINDS}
STALE_IDS = ["ckpt_9", "ckpt_1", "ckpt_3", "ckpt_6", "old", "ckpt_99", "ckpt_lo"]
NEW_ID = "ckpt_100"  # what the worker saves after the restore


def _damage_list(rng: random.Random, out: str, kind: str) -> str:
    """Applies one `checkpoint` file mutation of `kind`; returns what it did."""
    path = os.path.join(out, "checkpoint")
    pristine = [OLDER, LATEST]
    if kind == "list_deleted":
        os.remove(path)
        return "checkpoint deleted"
    if kind == "list_emptied":
        new = rng.choice([b"", b"\n", b"  \n\n", b"\r\n", b" "])
    elif kind == "list_garbled":
        text = "".join(f"{i}\n" for i in pristine).encode()
        new = rng.choice([b"\xff\xfe\n", b"ckpt_2\n\xc3\x28\n", b"ckpt_2\n../x\n", b"/etc\n", b"checkpoint\n",
                          b"ckpt_4\x00\n", b"ckpt_2 ckpt_4\n", b'{"latest": "ckpt_4"}\n', b"..\n", b"x" * 300 + b"\n",
                          os.urandom(rng.randrange(1, 40)), text[:rng.randrange(1, len(text))],
                          text + b"ckpt_4/../ckpt_2\n"])
    elif kind == "list_stale":
        ids = list(pristine)
        if rng.random() < 0.3:
            ids = []  # only ids that do not exist
        for _ in range(rng.randrange(1, 4)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(STALE_IDS))
        new = "".join(f"{i}\n" for i in ids).encode()
    else:  # list_duplicated
        ids = list(pristine)
        for _ in range(rng.randrange(1, 4)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(ids))
        new = "".join(f"{i}\n" for i in ids).encode()
    _write(path, new)
    return f"checkpoint := {new[:60]!r}"


def mutate_listing(rng: random.Random, out: str, kind: str) -> Mutation:
    """A list / dirs mutation; every checkpoint directory stays intact. Works out what restore must
    return and what a save of ckpt_100 (max_keep 2) and gc must leave."""
    m = Mutation(kind, "")
    descs = []
    if kind in LIST_KINDS:
        descs.append(_damage_list(rng, out, kind))
    else:
        for _ in range(rng.randrange(1, 3)):
            name = rng.choice(["ckpt_6", "ckpt_8", "ckpt_lo", "ckpt_3", "extra", "ckpt_2.bak"])
            path = os.path.join(out, name)
            if os.path.exists(path):
                continue
            if kind == "dir_empty":
                os.mkdir(path)
                m.must_remain.append(name)
                descs.append(f"{name}/: empty directory")
            elif kind == "dir_junk":
                os.mkdir(path)
                _write(os.path.join(path, rng.choice(["notes.txt", "index.bak", "model.pt.old"])), b"junk")
                m.must_remain.append(name)
                descs.append(f"{name}/: directory with junk")
            else:  # a copy of a checkpoint without its index (a crashed save): gc may remove it
                shutil.copytree(os.path.join(out, rng.choice([OLDER, LATEST])), path)
                os.remove(os.path.join(path, "index"))
                descs.append(f"{name}/: copy of a checkpoint without index")
        if rng.random() < 0.7:
            descs.append(_damage_list(rng, out, rng.choice(LIST_KINDS)))
    m.desc = "; ".join(descs)
    ids, stale = _list_model(out)
    if ids is None:
        ids, stale = [OLDER, LATEST], []  # rebuilt from the indexes: both are intact
    intact = [i for i in ids if i not in stale]
    m.expect_restore = intact[-1]  # the fallback skips stale ids
    m.expect_kept = (intact + [NEW_ID])[-2:]  # a writer drops stale ids, then max_keep 2
    m.names = {m.expect_restore}
    return m


# ====================================================================================== driver
class Worker:
    def __init__(self, ref_path: str, env: Dict[str, str], log: str):
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", ref_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env=env, text=True, bufsize=1)
        self.case: Optional[Tuple[int, Mutation, str]] = None
        self.deadline = 0.0
        self.buf = ""
        self.info: Optional[Dict[str, Any]] = None
        self.log_pos = 0

    def send(self, case: int, m: Mutation, out: str, timeout: float) -> None:
        self.case = (case, m, out)
        self.deadline = time.monotonic() + timeout
        self.log_pos = os.path.getsize(self.log_path)
        mode = "list" if m.kind in LIST_KINDS + DIR_KINDS else "reader"
        self.proc.stdin.write(json.dumps({"case": case, "out": out, "mode": mode}) + "\n")
        self.proc.stdin.flush()

    def log_tail(self, since: int = 0) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            f.seek(since)
            return f.read()[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


SAN_MARKERS = ("ERROR: AddressSanitizer", "AddressSanitizer: CHECK failed", "runtime error:", "ERROR: LeakSanitizer",
               "UndefinedBehaviorSanitizer")


def judge_listing(m: Mutation, res: Dict[str, Any], tally: Dict[str, Counter], failures: List[Dict[str, Any]],
                  case: int) -> None:
    """list / dirs cases: restore returns the newest intact checkpoint the file means; a save and
    gc then leave exactly what max_keep keeps, delete no other committed checkpoint and touch no
    other directory."""
    r, after = res["restore"], res.get("after", {})
    ref_step = {OLDER: 2, LATEST: 4}
    if r["outcome"] == "identical" and r["ckpt"] == m.expect_restore and r["step"] == ref_step[r["ckpt"]]:
        verdicts = ["restore:newest-intact"]
    else:
        verdicts = [f"FAIL:restore-{r['outcome']}"]
    if any("rebuilt the list" in w for w in res.get("warnings", [])):
        verdicts.append("warned:rebuilt")
    kept = sorted(m.expect_kept)
    want_list = "".join(f"{i}\n" for i in m.expect_kept)
    if after.get("outcome") != "done":
        verdicts.append(f"FAIL:save-{after.get('type', 'missing')}")
    elif after["committed"] != kept or after["list"] != want_list:
        verdicts.append("FAIL:committed-after-save-gc")
    elif not set(m.must_remain) <= set(after["dirs"]):
        verdicts.append("FAIL:other-dir-removed")
    else:
        verdicts.append("after:kept-exactly")
    for v in verdicts:
        tally[m.kind][v] += 1
        if v.startswith("FAIL"):
            failures.append({"case": case, "kind": m.kind, "mutation": m.desc, "loader": "restore+save+gc",
                             "verdict": v, "detail": json.dumps({"expect_restore": m.expect_restore,
                                                                 "expect_kept": m.expect_kept, **res})[:1500]})


def judge(m: Mutation, res: Dict[str, Any], tally: Dict[str, Counter], failures: List[Dict[str, Any]],
          notes: Counter, case: int) -> None:
    if "restore" in res:
        judge_listing(m, res, tally, failures, case)
        return
    for loader in ("load", "read"):
        r = res[loader]
        o = r["outcome"]
        if o == "error":
            verdict = "error"
        elif o == "identical":
            allowed = r["ckpt"] in m.allowed_load if loader == "load" else m.allowed_read
            verdict = "identical" if allowed else "FAIL:loaded-despite-damage"
            if loader == "load" and "step" in r:
                notes["index step changed silently (index has no checksum)"] += 1
        elif o == "different":
            verdict = "FAIL:wrong-values"
        else:
            verdict = f"FAIL:{r['type']}"
        tally[m.kind][f"{loader}:{verdict}"] += 1
        if loader == "load" and NEEDS:
            _chain_notes(m, r, notes)
        if verdict.startswith("FAIL"):
            failures.append({"case": case, "kind": m.kind, "mutation": m.desc, "loader": loader,
                             "verdict": verdict, "detail": r.get("msg", r.get("ckpt", ""))})


def _chain_notes(m: Mutation, r: Dict[str, Any], notes: Counter) -> None:
    """Chain mode: how a load of the delta went when only its parent was damaged."""
    if LATEST not in m.names:
        return
    outcome = r["outcome"] + (f" {r['ckpt']}" if r["outcome"] == "identical" else "")
    if LATEST in m.via_parent:
        notes[f"chain: only the parent's index / rows damaged -> load {outcome}"] += 1
    elif LATEST not in m.damaged and m.damaged & set(NEEDS[LATEST]):
        notes[f"chain: only the parent's model.pt / extra.pt / io state damaged -> load {outcome}"] += 1


def parse_kinds(text: str) -> List[str]:
    """Kinds named by a comma-separated list of kinds and groups (GROUPS)."""
    kinds: List[str] = []
    for word in filter(None, (w.strip() for w in text.split(","))):
        for k in GROUPS.get(word, [word]):
            if k not in GROUPS["all"]:
                raise SystemExit(f"--kinds: unknown kind or group {word!r}; groups: {', '.join(GROUPS)}")
            if k not in kinds:
                kinds.append(k)
    return kinds


def run(mutations: int = 2000, seed: int = 0, workers: int = 2, asan: bool = False,
        timeout: Optional[float] = None, verbose: bool = False, kinds: Optional[List[str]] = None,
        chain: bool = False) -> Dict[str, Any]:
    kinds = kinds or KINDS
    NEEDS.clear()
    if chain:
        if set(kinds) - set(KINDS):
            raise SystemExit("--chain: only reader kinds (the list / dirs judging assumes full checkpoints)")
        NEEDS[LATEST] = [OLDER]
    t0 = time.monotonic()
    rng = random.Random(seed)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    work = tempfile.mkdtemp(prefix="recsave-fuzz-", dir=shm)
    summary: Dict[str, Any] = {"mutations": 0, "failures": [], "asan": asan, "notes": Counter(), "chain": chain}
    tally: Dict[str, Counter] = defaultdict(Counter)
    pool: List[Worker] = []
    try:
        pristine, ref_path = build(work, chain)
        env = _env()
        if asan:
            t_build = time.monotonic()
            env = _env(build_asan(work))
            summary["asan_build_seconds"] = round(time.monotonic() - t_build, 1)
        timeout = timeout or (180.0 if asan else 30.0)
        for i in range(workers):
            pool.append(Worker(ref_path, env, os.path.join(work, f"worker-{i}.log")))
        for w in pool:  # wait until ready (imports torch)
            _await_ready(w, 300 if asan else 120)
        summary["extension"] = pool[0].info
        if asan and pool[0].info["_C"] != env["_RECSAVE_ASAN_SO"]:
            raise SystemExit(f"--asan: workers imported {pool[0].info['_C']}, not the sanitized build")
        next_case = 0
        while next_case < mutations or any(w.case for w in pool):
            for w in pool:
                if w.case is None and next_case < mutations:
                    case_dir = os.path.join(work, f"case-{next_case}")
                    shutil.copytree(pristine, case_dir, symlinks=True)
                    kind = kinds[next_case % len(kinds)] if next_case < len(kinds) else rng.choice(kinds)
                    case_rng = random.Random(f"{seed}-{next_case}")
                    m = mutate(case_rng, case_dir, kind) if kind in KINDS else \
                        mutate_listing(case_rng, case_dir, kind)
                    w.send(next_case, m, case_dir, timeout)
                    next_case += 1
            busy = [w for w in pool if w.case]
            ready, _, _ = select.select([w.proc.stdout for w in busy], [], [], 0.5)
            for i, w in enumerate(pool):
                if not w.case:
                    continue
                case, m, case_dir = w.case
                res = None
                dead = None
                if w.proc.stdout in ready:
                    line = w.proc.stdout.readline()
                    if line.startswith(RESULT):
                        res = json.loads(line[len(RESULT):])
                    elif line == "":
                        dead = f"worker died ({_rc(w.proc.wait())})"
                    else:
                        continue  # stray output
                elif time.monotonic() > w.deadline:
                    dead = f"hang: no answer within {timeout:.0f} s"
                if res is None and dead is None:
                    continue
                summary["mutations"] += 1
                log = w.log_tail(w.log_pos)
                san = [ln for ln in log.splitlines() if any(s in ln for s in SAN_MARKERS)]
                if res is not None and not san:
                    judge(m, res, tally, summary["failures"], summary["notes"], case)
                else:
                    verdict = "FAIL:sanitizer" if san else ("FAIL:hang" if dead and dead.startswith("hang")
                                                            else "FAIL:crash")
                    tally[m.kind][verdict] += 1
                    summary["failures"].append({"case": case, "kind": m.kind, "mutation": m.desc,
                                                "loader": "worker", "verdict": verdict,
                                                "detail": (dead or "") + "\n" + log[-3000:]})
                if verbose:
                    print(f"case {case} {m.kind}: {m.desc[:100]} -> "
                          f"{res and (res['load']['outcome'], res['read']['outcome'])}", flush=True)
                w.case = None
                if summary["failures"] and summary["failures"][-1]["case"] == case:
                    keep = os.path.join(work, f"failed-case-{case}")
                    os.rename(case_dir, keep)
                else:
                    shutil.rmtree(case_dir, ignore_errors=True)
                if res is None or san:  # restart a dead / hung / reporting worker
                    w.close()
                    pool[i] = Worker(ref_path, env, os.path.join(work, f"worker-{i}-{case}.log"))
                    _await_ready(pool[i], 300 if asan else 120)
        for w in pool:  # sanitizer reports printed at exit
            w.proc.stdin.close()
            w.proc.wait(timeout=120)
            tail = w.log_tail()
            san = [ln for ln in tail.splitlines() if any(s in ln for s in SAN_MARKERS)]
            if san:
                summary["failures"].append({"case": -1, "kind": "exit", "mutation": "", "loader": "worker",
                                            "verdict": "FAIL:sanitizer", "detail": tail[-3000:]})
    finally:
        for w in pool:
            w.close()
        summary["seconds"] = round(time.monotonic() - t0, 1)
        summary["work_dir"] = work
        if not summary["failures"]:
            shutil.rmtree(work, ignore_errors=True)
    summary["tally"] = {k: dict(sorted(v.items())) for k, v in sorted(tally.items())}
    summary["notes"] = dict(summary["notes"])
    return summary


def _rc(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit {code}"


def _await_ready(w: Worker, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([w.proc.stdout], [], [], 1.0)
        if r:
            line = w.proc.stdout.readline()
            if line.startswith(READY):
                w.info = json.loads(line[len(READY):])
                return
            if line == "":
                break
    raise SystemExit(f"fuzz worker did not start:\n{w.log_tail()}")


def print_summary(s: Dict[str, Any]) -> None:
    print(f"recsave corruption fuzz{' (ASan+UBSan extension)' if s['asan'] else ''}"
          f"{' (chain: ckpt_4 a delta of ckpt_2)' if s.get('chain') else ''}: {s['mutations']} mutations,"
          f" {len(s['failures'])} failures, {s['seconds']} s")
    if s.get("extension"):
        print(f"  extension: {s['extension']['_C']}"
              + (f" (built in {s['asan_build_seconds']} s)" if s.get("asan_build_seconds") else ""))
    for group, cols in ((KINDS, ["load:error", "load:identical", "read:error", "read:identical"]),
                        (LIST_KINDS + DIR_KINDS, ["restore:newest-intact", "after:kept-exactly", "warned:rebuilt"])):
        rows = {k: c for k, c in s["tally"].items() if k in group}
        if not rows:
            continue
        print(f"  {'kind':<16}" + "".join(f"{c:>22}" for c in cols) + "  other")
        for kind, c in rows.items():
            other = {k: v for k, v in c.items() if k not in cols}
            print(f"  {kind:<16}" + "".join(f"{c.get(col, 0):>22}" for col in cols) + f"  {other or ''}")
    for note, n in s["notes"].items():
        print(f"  note: {note}: {n} case(s)")
    for f in s["failures"][:15]:
        print(f"--- FAILURE case {f['case']} [{f['kind']}] {f['loader']} {f['verdict']}: {f['mutation']}\n"
              f"    {str(f['detail'])[:1500]}")
    if s["failures"]:
        print(f"(failed cases kept under {s['work_dir']})")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutations", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kinds", default="reader", type=parse_kinds,
                    help="comma-separated mutation kinds or groups: reader (default), list, dirs, all")
    ap.add_argument("--asan", action="store_true", help="run the cases under an ASan+UBSan build")
    ap.add_argument("--chain", action="store_true",
                    help="ckpt_4 is a delta of ckpt_2: mutate both, damage to the parent breaks the delta")
    ap.add_argument("--timeout", type=float, help="seconds per case (default 30, 180 with --asan)")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    s = run(args.mutations, args.seed, args.workers, args.asan, args.timeout, args.verbose, args.kinds,
            chain=args.chain)
    print_summary(s)
    return C.finish(s, args.json)


if __name__ == "__main__":
    sys.exit(main())
