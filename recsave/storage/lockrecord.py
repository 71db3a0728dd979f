"""The writer lock's file and how another process judges it (the lock itself: storage/lock.py).

The file ``<output_dir>/.recsave-writer.lock`` holds one JSON record ``{"host", "pid", "token",
"acquired_at", "renewed_at", "pid_space"}``. Here: reading it (`read_holder`), writing a record
(`dumps`), naming its holder (`describe`), and the verdict of a writer that finds it there: stale
(`stale_reason`: dead pid on this host, a lease without renewal, or for a record without a usable
``renewed_at`` its file unchanged for a lease) or held, and then the refusal's message
(`held_message`)."""
from __future__ import annotations

import json
import math
import os
import socket
import time
from typing import Any, Dict, NamedTuple, Optional, Tuple

from recsave import knobs
from recsave.errors import CheckpointNotFoundError, CorruptCheckpointError, WriterLockedError
from recsave.storage.base import Storage

LOCK_FILE = ".recsave-writer.lock"
MAX_LOCK_BYTES = 64 << 10


def pid_space() -> Optional[str]:
    """This process's pid space: the boot id and the pid namespace (None where unknown: then no
    dead-pid shortcut is taken, only the lease decides)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """False only when no process `pid` exists here; a number that is no process id (0 or less:
    a process group; too large for the system call) proves nothing, and counts as alive."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OverflowError, OSError):  # PermissionError: exists, owned by someone else; else no pid here
        return True
    return True


def read_holder(storage: Storage, path: str) -> Tuple[Optional[bytes], Optional[Dict[str, Any]]]:
    """The lock file at `path`: (raw bytes, parsed holder or None if unparseable); (None, None) when
    there is none. WriterLockedError when it cannot be read three times over."""
    for attempt in range(3):
        try:
            raw = storage.read_bytes(path, MAX_LOCK_BYTES)
            break
        except (CheckpointNotFoundError, FileNotFoundError):
            return None, None
        except CorruptCheckpointError as exc:  # replaced between its size and its read: another taker?
            last = exc
            time.sleep(0.05 * (attempt + 1))
    else:
        # The same error three times is the file itself (too big, not a file), not a race.
        raise WriterLockedError(f"{path}: the writer lock cannot be read ({last}); if no Saver is "
                                f"writing its directory, delete the lock file", path=path) from last
    try:
        holder = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return raw, None
    return raw, holder if isinstance(holder, dict) else None


def dumps(record: Dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True).encode()


def renewal_time(holder: Dict[str, Any]) -> Optional[float]:
    """The holder's renewed_at when it is one a live writer could have written: a finite number
    (not a bool), at most a lease ahead of this host's clock (hosts' clocks agree to well within a
    quarter lease); None otherwise (missing, garbled, written by something else)."""
    renewed = holder.get("renewed_at")
    if isinstance(renewed, bool) or not isinstance(renewed, (int, float)):
        return None
    try:  # an int too large for a float (JSON allows any number of digits) is garbage too
        renewed = float(renewed)
    except OverflowError:
        return None
    if not math.isfinite(renewed):
        return None
    return renewed if renewed - time.time() <= float(knobs.get("writer_lease_s")) else None


def describe(holder: Optional[Dict[str, Any]]) -> str:
    if not holder:
        return "holder unknown"
    renewed = renewal_time(holder)
    age = f", renewed {time.time() - renewed:.0f} s ago" if renewed is not None else ""
    pid = holder.get("pid")
    who = f"pid {pid} on host {holder.get('host')!r}" if pid is not None else "an unknown holder (no pid recorded)"
    return f"held by {who}{age}"


class FileAge(NamedTuple):
    """The lock file's age as `file_age` found it: seconds since it was last written; None when
    unknown, with `error` saying why when asking the storage failed, or `gone` when the file was
    released meanwhile (the lock is free: try to take it again)."""
    seconds: Optional[float]
    error: Optional[str] = None
    gone: bool = False


def file_age(storage: Storage, path: str) -> FileAge:
    """How long ago the lock file was last written, by the storage's clock against this host's
    (they must agree to well within a lease, as for renewed_at): unknown when the storage does not
    say, the file is gone, or asking failed (never raises an OSError)."""
    try:
        modified = storage.modified_at(path)
    except CheckpointNotFoundError:
        return FileAge(None, gone=True)
    except OSError as exc:  # StorageError is an OSError: the store unreachable, the file unreadable
        return FileAge(None, str(exc) or type(exc).__name__)
    return FileAge(None if modified is None else time.time() - modified)


def stale_reason(storage: Storage, path: str, holder: Optional[Dict[str, Any]],
                 raw: bytes) -> Tuple[Optional[str], Optional[FileAge]]:
    """Why the lock at `path` (`raw`, parsed: `holder`) is abandoned (None if its holder may be
    alive), and the lock file's age when the record has no usable renewal time (else None), which
    `held_message` words the refusal with: one stat of the file per refusal."""
    lease = float(knobs.get("writer_lease_s"))
    if holder is None:
        # An empty lock file may be one another writer's create is still filling.
        return (None if raw == b"" and storage.being_created(path) else "the lock file is unreadable"), None
    renewed = renewal_time(holder)
    age: Optional[FileAge] = None
    if renewed is None:
        # No renewal time to go by: without another rule such a lock would refuse every writer
        # forever. A holder renews by rewriting the file, so the file's own age (by the
        # storage's clock) is how long ago it was renewed; unknown where the storage cannot say
        # (or asking it failed: a live holder's lock is never taken on a guess).
        age = file_age(storage, path)
        if age.seconds is not None and age.seconds > lease:
            return (f"it records no renewal time, and its file was last modified {age.seconds:.0f} s ago > "
                    f"writer_lease_s={lease:g}"), age
    elif time.time() - renewed > lease:
        return f"not renewed for {time.time() - renewed:.0f} s > writer_lease_s={lease:g}", None
    pid = holder.get("pid")
    # A pid means this process's pid only on the same host (hostname), boot and pid namespace:
    # containers sharing a hostname have pid spaces of their own.
    space = pid_space()
    if holder.get("host") == socket.gethostname() and space is not None and holder.get("pid_space") == space \
            and isinstance(pid, int) and not pid_alive(pid):
        return f"process {pid} on this host is dead", age
    return None, age


def held_message(output_dir: str, path: str, holder: Optional[Dict[str, Any]], age: Optional[FileAge]) -> str:
    """The message of a WriterLockedError for a lock that is not stale: whose it is, and what to
    do; `age`: what `stale_reason` found of the lock file's age (None when the record has a usable
    renewal time, so it did not look)."""
    held = f"{output_dir} is being written by another Saver ({describe(holder)}; lock file {path}); "
    if holder is None or age is None:
        return held + ("close that Saver or let it finish, save into another output_dir, or delete the "
                       "lock file if that writer is gone")
    lease = float(knobs.get("writer_lease_s"))
    unchanged = f"it is taken over once its file is unchanged for writer_lease_s={lease:g} s"
    if age.seconds is not None:
        when = f"{unchanged} (last modified {age.seconds:.0f} s ago)"
    elif age.error is not None:
        when = f"{unchanged} (when it was last modified could not be read: {age.error})"
    else:
        when = "the storage reports no modification time for it, so it never goes stale by itself"
    return held + (f"its record has no renewal time (cut short, or not written by recsave): {when}; "
                   f"wait for that, save into another output_dir, or delete the lock file if no writer "
                   f"uses {output_dir}")
