"""One writer per output directory: a lease file ``<output_dir>/.recsave-writer.lock``.

The file holds JSON ``{"host", "pid", "token", "acquired_at", "renewed_at", "pid_space"}`` (times in
seconds since the epoch; ``pid_space``: the boot id and pid namespace, so that a pid is read as this
process's only where it means the same process). A Saver takes it on its first save (rank 0 only),
renews it on every save and on a daemon thread every quarter ``writer_lease_s`` while it holds it,
and releases it when closed, garbage-collected or at interpreter exit (those two make one attempt,
on a helper thread for remote storage; exit waits for it at most ``lock_release_timeout_s``, so a
gone endpoint cannot hang the interpreter; the lock is then taken over as stale later). A lock is
stale, and taken over with one INFO line on the ``recsave`` logger naming the dead holder (expected
after a crash), when its process is dead on this host (same hostname, boot and pid namespace) or
when it was not renewed for ``writer_lease_s`` seconds. A record without a usable ``renewed_at``
(cut short, garbled, or written by another program) is judged by its file's last modification
as the storage reports it (mtime; an object's last-modified time) instead: stale once that is a
lease old. Holders rewrite the file to renew it, so a live one is never taken that way. The file is created with
``Storage.create_exclusive``: O_EXCL locally; on object stores (no exclusive create) written and
read back, which is best effort.

The renewals on the thread keep a live holder's lock however long a save or the training between
saves takes, so the lease can be short: a crashed holder on another host (whose pid cannot be
checked) blocks a restart for one lease at most. A save calls `ensure_held` before each table it
writes: a holder whose lease may have run out meanwhile (a paused process, a store the thread could
not reach) renews it then or stops, before it writes into a directory that another writer may have
taken over. A failed save removes its files only while `owned()` says the lock is still its own.

Only rank 0 holds the lock; the other ranks of a save get its `grant()` in the save's first exchange
and check it with a `LeaseWatch` at the same points. A rank whose save outlived half a lease since
rank 0's last renewal reads the lock file then, and stops when another writer took it over, or when
rank 0 has not renewed it for three quarters of a lease (rank 0 renews every quarter: it is gone or
stalled, and another writer may take the lock over once a whole lease has passed; at once when the
holder's pid is dead on the taker's host, which the watch sees at its next read only). With the
group broken, such a rank removes its files only while `may_discard()` finds the lock not lost.

The lock file's record, its reading, and the verdict on another writer's lock (stale, or held and
the refusal's message) are storage/lockrecord.py's; this module holds and watches the lock.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from recsave import knobs
from recsave.errors import CheckpointNotFoundError, WriterLockedError
from recsave.storage.base import Storage

# The lock file's record and the judging of another's lock: lockrecord.py. LOCK_FILE, MAX_LOCK_BYTES
# and read_holder were defined here before it, and are still imported from here.
from recsave.storage.lockrecord import (
    LOCK_FILE,
    MAX_LOCK_BYTES,
    describe,
    dumps,
    held_message,
    pid_space,
    read_holder,
    stale_reason,
)

log = logging.getLogger("recsave")


class WriterLock:
    """The writer lease of `output_dir` held by this process (one instance per holder)."""

    def __init__(self, storage: Storage, output_dir: str):
        self.storage, self.output_dir = storage, output_dir
        self.path = storage.join(output_dir, LOCK_FILE)
        self.token = uuid.uuid4().hex
        self.held = False
        self._acquired_at = 0.0
        # Renewals (the save's and the renewal thread's) and the release take turns: a renewal in
        # flight when the lock is released would write the file back.
        self._mutex = threading.Lock()
        self._stop = threading.Event()  # ends the renewal thread of the current holding
        self._renew_started = 0.0  # time.monotonic() when the last successful renewal began
        self._renewal_lease_s: Optional[float] = None  # the lease the renewal thread runs with, if one runs
        self._lost: Optional[str] = None  # why the lock is lost, once a renewal found it taken over
        self._owner = os.getpid()  # a forked child holds a copy of this object, never the lock
        self._finalizer = self._release_when_dropped()
        self._finalizer.detach()  # armed by acquire()

    # ------------------------------------------------------------------------------------ public
    def acquire(self) -> None:
        """Takes the lock (or renews it if held): raises WriterLockedError naming the holder."""
        if self.held and os.getpid() != self._owner:
            # A forked child's copy of its parent's holding: the parent holds the lock, not this
            # process, which takes it like any other (and so waits for the parent to release it).
            self.held = False
            self.token = uuid.uuid4().hex
            self._mutex = threading.Lock()  # the parent's may have been held at the fork
            self._finalizer.detach()
        if self.held:
            self.renew()
            return
        _wait_for_release(self.path)  # a collected Saver of this process may be releasing it
        self.storage.makedirs(self.output_dir)
        started, now = time.monotonic(), time.time()
        self._acquired_at = now
        for _ in range(3):
            if self._create(self._record(now)):
                break
            raw, holder = self._read()
            if raw is None:
                continue  # released in between: try to create it again
            if holder is not None and holder.get("token") == self.token:
                break
            why, age = stale_reason(self.storage, self.path, holder, raw)
            if why is None and age is not None and age.gone:
                continue  # released between the read and the look at its age: try to create it again
            if why is None:
                raise WriterLockedError(held_message(self.output_dir, self.path, holder, age), path=self.path)
            log.info("%s: taking over a stale writer lock (%s; %s)", self.path, why, describe(holder))
            if self._replace(raw, self._record(now)):
                break
        else:
            raise WriterLockedError(f"{self.path}: could not take the writer lock (it kept changing); "
                                    f"another Saver is competing for {self.output_dir}", path=self.path)
        self.held = True
        self._lost = None
        self._renew_started = started
        self._stop = threading.Event()
        self._owner = os.getpid()
        self._finalizer = self._release_when_dropped()
        self._start_renewals()

    def renew(self) -> None:
        """Refreshes renewed_at; raises WriterLockedError if another writer took the lock over (or
        this is a forked child's copy of its parent's holding)."""
        if os.getpid() != self._owner:
            raise WriterLockedError(f"{self.path}: this process (pid {os.getpid()}) is a fork of the writer "
                                    f"holding the lock (pid {self._owner}); a child does not hold it",
                                    path=self.path)
        with self._mutex:
            self._renew()

    @property
    def lost(self) -> bool:
        """Whether a renewal found the lock taken over (until the next acquire)."""
        return self._lost is not None

    def ensure_held(self) -> None:
        """Raises WriterLockedError if the lock is known lost; renews it now (raising if it was
        taken over) when its last renewal began half a lease ago or more, since another writer may
        take it over once a whole lease has passed. Costs nothing while the renewal thread renews."""
        if self._lost is not None:
            raise WriterLockedError(self._lost, path=self.path)
        if time.monotonic() - self._renew_started >= float(knobs.get("writer_lease_s")) / 2:
            self.renew()

    def owned(self) -> Optional[bool]:
        """Whether the lock file still holds this lock's token (None when it cannot be read). A
        failed save removes its files only when True: another writer may be writing the same
        checkpoint id after taking over a lease that ran out."""
        try:
            _, holder = self._read()
        except (OSError, WriterLockedError):  # StorageError is an OSError
            return None
        return holder is not None and holder.get("token") == self.token

    def grant(self) -> Optional["LeaseGrant"]:
        """What the other ranks of a save need to check this lock while they write (LeaseWatch):
        None while no renewal thread runs (the others could not tell a live holder from a dead one).
        The lease is the one the renewals run with (the knob may have changed since acquire)."""
        if not self.held or self._renewal_lease_s is None:
            return None
        return LeaseGrant(self.path, self.token, self._renewal_lease_s, self._acquired_at,
                          max(0.0, time.monotonic() - self._renew_started))

    def beat(self, stop: threading.Event, interval: float) -> bool:
        """One renewal of the renewal thread (public for that thread only); whether to go on (not
        after `stop`, a release, or finding the lock taken over)."""
        with self._mutex:
            if stop.is_set() or not self.held:
                return False
            try:
                self._renew()
            except Exception as exc:  # the store is down, or the file unreadable: retried next beat
                if self._lost is not None:
                    return False
                # str(exc): a record keeping the exception would keep this frame, and the lock, alive.
                log.info("%s: renewing the writer lock failed (%s); retrying in %.3g s", self.path, str(exc), interval)
        return True

    def release(self) -> None:
        """Deletes the lock file if it is still ours (with the usual io_retries). Idempotent. In a
        forked child it only forgets the parent's holding (the parent's renewal thread may have
        held the mutex at the fork)."""
        if os.getpid() != self._owner:
            self.held = False
            self._finalizer.detach()
            return
        self._stop.set()
        with self._mutex:
            self.held = False
            if self._finalizer.detach() is not None and os.getpid() == self._owner:
                _release_now(self.storage, self.path, self.token)

    # ----------------------------------------------------------------------------------- details
    def _release_when_dropped(self) -> weakref.finalize:
        """The finalizer releasing this holding at garbage collection or interpreter exit (its
        arguments must not reference self)."""
        return weakref.finalize(self, _release, self.storage, self.path, self.token, self._mutex, self._stop,
                                self._owner)

    def _start_renewals(self) -> None:
        """The renewal thread of this holding: every quarter writer_lease_s (the knobs of this
        thread). It keeps a weak reference only: a dropped holder's lock is released by its
        finalizer, and the thread ends at its next beat. Where no thread can start, the lock is
        renewed by saves alone (ensure_held renews once half a lease has passed)."""
        lease = float(knobs.get("writer_lease_s"))
        interval = max(0.001, lease / 4)
        self._renewal_lease_s = None
        try:
            threading.Thread(target=knobs.carried(_renewals), args=(weakref.ref(self), self._stop, interval),
                             name="recsave-lease", daemon=True).start()
        except RuntimeError:  # a thread limit, or a shutting-down interpreter
            log.info("%s: no thread for renewing the writer lock; saves renew it", self.path)
            return
        self._renewal_lease_s = lease

    def _renew(self) -> None:
        """renew() under the mutex."""
        if self._lost is not None:
            raise WriterLockedError(self._lost, path=self.path)
        started = time.monotonic()
        raw, holder = self._read()
        if holder is None or holder.get("token") != self.token:
            self.held = False
            self._finalizer.detach()
            self._lost = (f"{self.path}: this Saver lost the writer lock of {self.output_dir} (now "
                          f"{describe(holder) if holder else 'released'}), probably because it was not "
                          f"renewed within writer_lease_s={knobs.get('writer_lease_s')} s; not saving")
            raise WriterLockedError(self._lost, path=self.path)
        self.storage.write_atomic(self.path, dumps(self._record(time.time())))
        self._renew_started = started

    def _record(self, now: float) -> Dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
                "acquired_at": self._acquired_at, "renewed_at": now, "pid_space": pid_space()}

    def _create(self, record: Dict[str, Any]) -> bool:
        """Creates the lock file if absent; whether this call created it."""
        return self.storage.create_exclusive(self.path, dumps(record))

    def _replace(self, old_raw: bytes, record: Dict[str, Any]) -> bool:
        """Overwrites a stale lock, if it still holds `old_raw`; whether we hold the lock now."""
        exclusive = self.storage.replace_exclusive(self.path, old_raw, dumps(record))
        if exclusive is not None:  # local: one taker of racing ones wins
            return exclusive
        raw, _ = self._read()
        if raw is not None and raw != old_raw:
            return False
        self.storage.write_atomic(self.path, dumps(record))
        _, back = self._read()
        return back is not None and back.get("token") == self.token

    def _read(self) -> Tuple[Optional[bytes], Optional[Dict[str, Any]]]:
        """(raw bytes, parsed holder or None if unparseable); (None, None) when there is no lock."""
        return read_holder(self.storage, self.path)

@dataclass(frozen=True)
class LeaseGrant:
    """Rank 0's writer lock as the other ranks of a save check it (LeaseWatch): its file, token,
    the lease its renewals run with, when it was taken (epoch seconds) and how long before the
    grant it was last renewed."""
    path: str
    token: str
    lease_s: float
    acquired_at: float
    renewed_ago: float


class LeaseWatch:
    """A rank other than 0's check of rank 0's writer lock during one save (module docstring).

    Made right after the exchange that granted it, while rank 0 holds the lock freshly renewed, it
    reads the lock file once: rank 0's token there means this rank sees rank 0's file; another
    lock, or none, means it does not (per-rank local disks): no verdict then, and no reads after.
    `check()` reads nothing more until half a lease after rank 0's last renewal it knows of, then
    once per call; a file that is gone or holds another token by then means the lock was lost."""

    def __init__(self, storage: Storage, grant: LeaseGrant):
        self.storage, self.grant = storage, grant
        self._renewed = time.monotonic() - grant.renewed_ago  # rank 0's last renewal, this rank's clock
        self._seen = False  # a read found rank 0's token at grant.path
        self._blind = False  # rank 0's lock file is not on this rank's storage
        self._look(first=True)

    def check(self) -> None:
        """Raises WriterLockedError when another writer took the lock over, or rank 0 has not
        renewed it for three quarters of a lease (it renews every quarter: it is gone or stalled,
        and once a whole lease passed another writer may take the lock over)."""
        if self._blind or time.monotonic() - self._renewed < self.grant.lease_s / 2:
            return
        state, why = self._look()
        if state in ("lost", "stale"):
            raise WriterLockedError(f"{why}; this rank stops writing", path=self.grant.path)

    def may_discard(self) -> bool:
        """Whether this rank may remove its files of a failed save without rank 0's word (the
        group broke): while the lock is rank 0's and its lease has not run out (no other writer
        can have begun), or this rank cannot see it; not when it cannot be read."""
        return self._blind or self._look()[0] in ("ok", "stale", "blind")

    def _look(self, first: bool = False) -> Tuple[str, str]:
        """One read: ("ok" | "stale" | "lost" | "blind" | "unknown", why the lock is stale or lost);
        "stale": not renewed for three quarters of a lease, less than a whole lease. The `first`
        read comes while rank 0 holds the lock: any other lock there is another file."""
        path, lease = self.grant.path, self.grant.lease_s
        try:
            raw, holder = read_holder(self.storage, path)
        except (OSError, WriterLockedError):  # StorageError is an OSError
            raw, holder = b"", None
        if raw is not None and holder is None:  # unreadable, garbled or being replaced: next read later
            self._renewed = max(self._renewed, time.monotonic() - lease / 4)
            return "unknown", ""
        if holder is not None and holder.get("token") == self.grant.token:
            self._seen = True
            renewed = holder.get("renewed_at")
            age = max(0.0, time.time() - renewed) if isinstance(renewed, (int, float)) else 0.0
            self._renewed = time.monotonic() - age
            if age < 0.75 * lease:
                return "ok", ""
            why = (f"{path}: rank 0 has not renewed the writer lock for {age:.1f} s (writer_lease_s={lease:g}; it "
                   f"renews every quarter lease), so it is gone or stalled, and another writer may take the "
                   f"output dir over")
            return ("stale" if age < lease else "lost"), why
        # Not rank 0's token. Seen before: taken over. A lock taken after rank 0's was too (when the
        # first read failed). Else this rank does not see rank 0's file.
        acquired = holder.get("acquired_at") if holder is not None else None
        newer = isinstance(acquired, (int, float)) and acquired >= self.grant.acquired_at
        if self._seen or (newer and not first):
            return "lost", (f"{path}: the writer lock that rank 0 held for this save is now "
                            f"{describe(holder) if holder is not None else 'released'}: another writer "
                            f"took the output dir over")
        self._blind = True
        return "blind", ""


def _renewals(ref: "weakref.ReferenceType[WriterLock]", stop: threading.Event, interval: float) -> None:
    """The renewal thread: renews the lock every `interval` seconds until `stop` is set (release,
    collection, interpreter exit), or the lock is found lost or collected."""
    while not stop.wait(interval):
        lock = ref()
        if lock is None or not lock.beat(stop, interval):
            return
        del lock


def _release_now(storage: Storage, path: str, token: str) -> bool:
    """Removes the lock file if it still holds `token`; whether that worked (never raises)."""
    try:
        raw = storage.read_bytes(path, MAX_LOCK_BYTES)
        if json.loads(raw.decode("utf-8")).get("token") == token:
            storage.remove_file(path)
        return True
    except CheckpointNotFoundError:
        return True
    except Exception:  # nothing to do about it here; a stale lock is taken over later
        return False


# Remote releases started by finalizers, by lock path: a new acquire() of the path waits for it.
_releasing: Dict[str, Future] = {}
# Work of this process that keeps a lock held until it ends (a dropped Saver's in-place deletion of
# pruned checkpoints, save/pruning.py), by lock path: a new acquire() of the path waits for it.
_busy: Dict[str, Future] = {}


def busy_until(path: str, work: Future) -> None:
    """Records that the lock of `path` stays held until `work` is done (the work keeps the lock
    object alive and drops it before its future completes): an acquire() in this process waits for
    it instead of failing with WriterLockedError; one in another process finds the lock held."""
    for done in [p for p, w in _busy.items() if w.done()]:
        del _busy[done]
    _busy[path] = work


def _release(storage: Storage, path: str, token: str, mutex: threading.Lock, stop: threading.Event,
             owner: int) -> None:
    """The finalizer (garbage collection, interpreter exit): one attempt (no io_retries).

    It runs through ``storage.run_detached``: on remote storage on a daemon thread, so a collection
    does not wait for it (it may run on any thread, fsspec's event-loop thread included, whose I/O
    the release needs), and interpreter exit waits at most ``lock_release_timeout_s`` (with the
    endpoint gone, botocore's timeouts could otherwise block exit for minutes). It ends the
    renewals first and waits (bounded) for one in flight at exit, which would write the file back.
    A forked child's copy (its normal exit runs the finalizers too) leaves the parent's lock alone."""
    stop.set()
    if os.getpid() != owner:
        return

    def once() -> None:
        got = mutex.acquire(timeout=_release_timeout_s())
        try:
            with knobs.override(io_retries=0):
                _release_now(storage, path, token)
        finally:
            if got:
                mutex.release()

    release = storage.run_detached(once, name="recsave-lock-release")
    if release.done():  # local storage: released already
        return
    _releasing[path] = release
    if _interpreter_exiting():
        futures_wait([release], timeout=_release_timeout_s())


def _interpreter_exiting() -> bool:
    """Whether the interpreter is shutting down. weakref.finalize sets its flag only after it ran
    the exit finalizers (this one among them); threading's is set when the main thread ends,
    before them. Without a wait here the daemon release thread dies with the interpreter, and the
    lock stays for writer_lease_s."""
    return bool(getattr(threading, "_SHUTTING_DOWN", False) or getattr(weakref.finalize, "_shutdown", False)
                or sys.is_finalizing())


def _wait_for_release(path: str) -> None:
    """Waits for work that keeps a dropped holder's lock of `path` (busy_until), then (bounded) for
    a finalizer's release of it that may still be running."""
    busy = _busy.pop(path, None)
    if busy is not None:  # bounded: a hung store ends in WriterLockedError, naming the lock file
        futures_wait([busy], timeout=max(0.0, float(knobs.get("collective_timeout_s"))))
    release = _releasing.pop(path, None)
    if release is not None:
        futures_wait([release], timeout=_release_timeout_s())


def _release_timeout_s() -> float:
    return max(0.0, float(knobs.get("lock_release_timeout_s")))


def check_held(lock: Optional[WriterLock]) -> None:
    """`lock.ensure_held()` before each piece a long write adds; nothing for None."""
    if lock is not None:
        lock.ensure_held()


def renewed(lock: Optional[WriterLock]) -> None:
    """`lock.renew()` right before a commit point (WriterLockedError if it was lost meanwhile);
    nothing for None."""
    if lock is not None:
        lock.renew()


def still_owned(lock: Optional[WriterLock]) -> bool:
    """Whether a failed write may remove what it wrote: with no lock (the knob off), or while the
    lock file still holds `lock`'s token (another writer may be writing the same names)."""
    return lock is None or lock.owned() is True


def hold(current: Optional[WriterLock], storage: Storage, output_dir: str) -> Optional[WriterLock]:
    """Acquires (first save) or renews (later saves) the writer lock and returns it; when the knob
    ``writer_lock`` is off, returns `current` untouched while it is held (else None)."""
    if not knobs.get("writer_lock"):
        return current if current is not None and current.held else None
    lock = current or WriterLock(storage, output_dir)
    lock.acquire()
    return lock
