"""How the gloo worker scripts end: check that nothing of the job is still running, then leave
without the interpreter's teardown.

A process that ran gloo collectives intermittently aborts at interpreter exit with "terminate called
without an active exception" even after destroy_process_group(), in a run that made no recsave call
at all (tests/preempt_job.py's reference mode: training and all_reduce only). The abort is torch's
gloo threads meeting a half torn-down interpreter, not the job's result; it turned CI runs red.
os._exit skips that teardown. A leftover thread would be hidden by it, so the scripts first require
that no thread is alive that a normal exit would wait for (daemon threads, e.g. fsspec's event loop,
are left to die): a background save that outlived the job still fails the test, with an exit status
of its own.
"""
from __future__ import annotations

import os
import sys
import threading

LEFTOVER_THREADS = 5  # exit status when a Python thread outlived the job


def exit_now(code: int) -> None:
    """Flushes stdout / stderr and ends the process with `code`; a success becomes LEFTOVER_THREADS
    (the threads named on stderr) when a thread a normal exit would wait for (not a daemon) is
    still alive."""
    others = [t for t in threading.enumerate()
              if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if others and code == 0:
        print(f"threads still alive at exit: {[t.name for t in others]}", file=sys.stderr)
        code = LEFTOVER_THREADS
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
