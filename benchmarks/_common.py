"""Helpers shared by the benchmarks: timing, medians, tables, per-operation peak RSS in a fresh
process, page-cache handling and temporary directories.

Deliberately free of torch: the orchestrating process stays small, so the processes it starts do
not inherit a large memory high-water mark. Benchmarks import this as ``import _common`` (the
script's own folder is on sys.path when run as ``python benchmarks/<name>.py``).
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import platform
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
GB = 1e9  # throughput is reported in decimal GB/s
MB = 1e6


def ensure_repo_on_path() -> None:
    """Makes ``import recsave`` work from a checkout without an installed package."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)


# ------------------------------------------------------------------------------------------------
# Timing and statistics

class Timer:
    """``with Timer() as t: ...`` then ``t.seconds``."""

    def __enter__(self) -> "Timer":
        self.seconds = float("nan")
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self._start


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / GB if seconds and seconds > 0 else float("nan")


def summarize(seconds: Sequence[float], nbytes: float) -> Dict[str, float]:
    """Median / min / max of a list of durations, and the matching throughputs."""
    return {
        "median_s": median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "median_gbps": gbps(nbytes, median(seconds)),
        "best_gbps": gbps(nbytes, min(seconds)),
        "worst_gbps": gbps(nbytes, max(seconds)),
    }


# ------------------------------------------------------------------------------------------------
# Memory: peak RSS of one operation

def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """ru_maxrss of this process (kilobytes on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Resets the kernel's RSS high-water mark to the current RSS (Linux >= 4.0,
    /proc/self/clear_refs "5"). False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def prefault_memory(nbytes: int, directory: Optional[str] = None) -> float:
    """Cycles `nbytes` of memory through the page cache (a scratch file in `directory`, written
    and deleted, never synced) and through anonymous memory (touched and freed); returns the
    seconds it took.

    On VMs whose balloon reports free pages to the host (virtio-balloon free page reporting), a page
    the guest kernel hands out for the first time in a while costs a host page fault, which makes
    any operation that allocates memory (page cache on write, buffers on read) several times slower
    and very noisy. Freed just before the timed operation, these pages are reused while still
    backed. On bare metal this only costs the time it takes."""
    import mmap

    import numpy as np

    if nbytes <= 0:
        return 0.0
    start = time.perf_counter()
    if directory:
        chunk = np.ones(4 << 20, dtype=np.uint8)
        fd, path = tempfile.mkstemp(prefix=".prefault-", dir=directory)
        try:
            for _ in range(max(1, nbytes // chunk.nbytes)):
                os.write(fd, chunk)
        finally:
            os.close(fd)
            os.remove(path)
    m = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # Free page reporting hands the host whole free 2 MB blocks, which are what transparent huge
        # pages are made of (recsave advises its table storage): cycle those too.
        m.madvise(mmap.MADV_HUGEPAGE)
    view = np.frombuffer(m, dtype=np.uint8)
    view[::4096] = 1
    del view
    m.close()
    return time.perf_counter() - start


def system_busy_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:8]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields)
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    return ru.ru_utime + ru.ru_stime


class MeasureOp:
    """Times one operation and measures its peak RSS above the RSS it started with, its CPU time
    and the CPU time other processes used meanwhile (a noise indicator).

        with MeasureOp() as m:
            op()
        m.result()  # {"seconds", "cpu_s", "others_cpu_s", "rss_baseline", "rss_peak", "rss_delta", "peak_reset"}

    Use it in a fresh process (see run_isolated) after the state is built, so the peak is this
    operation's. Where the high-water mark cannot be reset, the baseline is the peak so far, which
    under-reports an operation that stays below an earlier transient peak.
    """

    def __enter__(self) -> "MeasureOp":
        self.peak_reset = reset_peak_rss()
        self.baseline = current_rss_bytes() if self.peak_reset else max(current_rss_bytes(), peak_rss_bytes())
        self._busy0 = system_busy_seconds()
        self._cpu0 = _cpu_seconds()
        self._timer = Timer().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.__exit__(*exc)
        self.seconds = self._timer.seconds
        self.cpu = _cpu_seconds() - self._cpu0
        self.others_cpu = max(0.0, system_busy_seconds() - self._busy0 - self.cpu)
        self.peak = peak_rss_bytes()

    def result(self) -> Dict[str, Any]:
        return {"seconds": self.seconds, "cpu_s": self.cpu, "others_cpu_s": self.others_cpu,
                "rss_baseline": self.baseline, "rss_peak": self.peak,
                "rss_delta": max(0, self.peak - self.baseline), "peak_reset": self.peak_reset}


_CTX: Optional[Any] = None


def isolated_context(preload: Sequence[str] = ()) -> Any:
    """A forkserver multiprocessing context whose server has imported `preload` once, so each
    measured process starts in milliseconds yet shares no memory history with this one."""
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        _CTX = ctx
    return _CTX


def _child(conn: Any, fn: Callable[..., Any], args: tuple) -> None:
    try:
        try:
            reply = ("ok", fn(*args))
        except BaseException:
            reply = ("error", traceback.format_exc())
        conn.send(reply)
    except (BrokenPipeError, EOFError):
        pass  # the parent is gone
    finally:
        conn.close()


class WorkerError(RuntimeError):
    pass


def run_isolated(fn: Callable[..., Any], *args: Any, timeout: Optional[float] = None,
                 preload: Sequence[str] = ()) -> Any:
    """Runs fn(*args) in a fresh process (forked from a clean forkserver) and returns its result.
    `fn` must be a module-level function; it measures itself (MeasureOp) after building its state.
    Raises WorkerError with the child's traceback, or on a crash or timeout."""
    ctx = isolated_context(preload)
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args), daemon=True)
    proc.start()
    send.close()
    ok = False
    try:
        if not recv.poll(timeout):
            raise WorkerError(f"{getattr(fn, '__name__', fn)}{args!r}: no result after {timeout} s")
        try:
            status, payload = recv.recv()
        except EOFError:
            proc.join(5)
            raise WorkerError(f"{getattr(fn, '__name__', fn)}{args!r}: worker died "
                              f"(exit code {proc.exitcode}; out of memory?)") from None
        ok = True
    finally:
        recv.close()
        if ok:
            proc.join(30)
        if proc.is_alive():  # interrupted, timed out or stuck: do not leave it writing
            proc.kill()
            proc.join()
    if status != "ok":
        raise WorkerError(f"worker failed:\n{payload}")
    return payload


# ------------------------------------------------------------------------------------------------
# Page cache and temporary files

def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def settle(drop_caches: bool = False, evict: Optional[str] = None) -> bool:
    """Flushes dirty pages (so one operation's writeback is not charged to the next) and, when
    asked, makes the next read cold: root drops the whole page cache; anyone else evicts the pages
    of `evict` (a file, or every file under a directory) with posix_fadvise(DONTNEED), which drops
    clean cached pages of a file one may open. Returns whether the cache was dropped / evicted."""
    os.sync()
    if not drop_caches:
        return False
    if can_drop_caches():
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
            return True
        except OSError:
            pass
    return evict is not None and evict_from_cache(evict)


def evict_from_cache(path: str) -> bool:
    """posix_fadvise(DONTNEED) on `path` (a file, or every file under a directory), after os.sync():
    the kernel drops those files' clean pages from the page cache. No root needed."""
    if not hasattr(os, "posix_fadvise"):
        return False
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


@contextlib.contextmanager
def bench_tempdir(parent: Optional[str] = None, prefix: str = "recsave-bench-") -> Iterator[str]:
    """A fresh directory (under `parent` when given), removed afterwards even on failure, Ctrl-C or
    SIGTERM."""
    if parent:
        os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    previous = signal.getsignal(signal.SIGTERM)

    def _on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _on_term)
    try:
        yield path
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(path, ignore_errors=True)


def clear_dir(path: str) -> None:
    """Removes everything inside `path` (keeps the directory)."""
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(full)


def fs_type(path: str) -> str:
    """File system type of the mount holding `path` (from /proc/self/mounts)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def machine_info(directory: str) -> Dict[str, Any]:
    from importlib import metadata

    def version(pkg: str) -> Optional[str]:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    mem = None
    with contextlib.suppress(OSError, ValueError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {
        "cpu": cpu, "cpus": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
        "python": platform.python_version(), "torch": version("torch"), "numpy": version("numpy"),
        "safetensors": version("safetensors"), "dir": directory, "fs": fs_type(directory),
        "disk_free_bytes": shutil.disk_usage(directory).free, "euid": os.geteuid(),
    }


# ------------------------------------------------------------------------------------------------
# Output

def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A plain aligned table; `align` gives 'l' or 'r' per column (default: first left, rest right)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if a == "l" else v.rjust(w) for v, w, a in zip(vals, widths, align)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def fmt_num(x: Optional[float], digits: int = 2, suffix: str = "") -> str:
    if x is None or x != x:  # None or NaN
        return "n/a"
    return f"{x:.{digits}f}{suffix}"


def write_json(path: str, obj: Any) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_free_space(directory: str, needed_bytes: float) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        raise SystemExit(f"{directory}: {free / GB:.1f} GB free, the benchmark needs about "
                         f"{needed_bytes / GB:.1f} GB; pass --dir elsewhere or a smaller --size-gb")


def rounds_order(items: List[Any], round_no: int) -> List[Any]:
    """`items` rotated by the round number: every method takes every position across rounds."""
    if not items:
        return []
    k = round_no % len(items)
    return items[k:] + items[:k]


# ------------------------------------------------------------------------------------------------
# Page-cache residency, machine quietness, fits, merged result files

def cached_fraction(path: str) -> Optional[float]:
    """Share of the bytes of `path` (a file, or every file under a directory) that sit in the page
    cache right now (mincore on a read-only mapping; nothing is read). None where it cannot tell."""
    import ctypes
    import mmap

    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    total = resident = 0
    for name in files:
        size = os.path.getsize(name)
        if size == 0:
            continue
        fd = os.open(name, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in bytes(vec)) * page
                total += pages * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else None


def others_cpu_share(seconds: float = 2.0) -> float:
    """CPUs' worth of work (1.0 = one full core) all processes did over the next `seconds`; call it
    while this process idles to see how busy the machine is."""
    busy0, t0 = system_busy_seconds(), time.perf_counter()
    time.sleep(seconds)
    return (system_busy_seconds() - busy0) / (time.perf_counter() - t0)


def wait_until_quiet(max_wait_s: float, threshold: float = 0.2, window_s: float = 3.0) -> Dict[str, Any]:
    """Samples how busy the machine is; while it is above `threshold` CPUs, waits (at most
    `max_wait_s`), logging what it sees. Returns {"busy_cpus", "waited_s", "quiet"}."""
    start = time.perf_counter()
    busy = others_cpu_share(window_s)
    while busy > threshold and time.perf_counter() - start < max_wait_s:
        log(f"machine busy: other processes use {busy:.2f} CPUs; waiting for it to quiet down "
            f"({time.perf_counter() - start:.0f} of {max_wait_s:.0f} s)")
        time.sleep(10)
        busy = others_cpu_share(window_s)
    return {"busy_cpus": busy, "waited_s": time.perf_counter() - start, "quiet": busy <= threshold}


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> Dict[str, float]:
    """Least-squares y = intercept + slope * x and its R^2 (nan where undefined)."""
    n = len(xs)
    nan = float("nan")
    if n < 2:
        return {"slope": nan, "intercept": nan, "r2": nan}
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return {"slope": nan, "intercept": nan, "r2": nan}
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    return {"slope": slope, "intercept": intercept, "r2": 1 - ss_res / ss_tot if ss_tot > 0 else nan}


def update_json(path: str, key: str, obj: Any) -> Dict[str, Any]:
    """Sets `key` of the JSON object in `path` (created if absent or unreadable) to `obj`, keeping
    the other keys, and writes it back atomically; returns the whole object."""
    data: Dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            loaded = json.load(f)
        if isinstance(loaded, dict):
            data = loaded
    data[key] = obj
    write_json(path, data)
    return data


def write_text(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return path


def git_revision() -> Optional[str]:
    """The checkout's commit, with "+dirty" when tracked files have uncommitted changes."""
    import subprocess

    try:
        rev = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("+dirty" if dirty else "")


def finish(summary: Dict[str, Any], json_path: Optional[str]) -> int:
    """The exit status of a reliability run (1 when `summary["failures"]` lists any), after writing
    the summary to `json_path` when given."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 1 if summary["failures"] else 0
