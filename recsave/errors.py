"""The exceptions recsave raises.

Every error derives from :class:`RecsaveError` and, where one fits, from the matching builtin, so
``except FileNotFoundError`` keeps working for callers who do not know recsave. Messages name the file,
the table or key, and what to do about it.
"""
from __future__ import annotations

from typing import Optional

__all__ = [
    "RecsaveError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "OverLimitError",
    "FormatVersionError",
    "CheckpointExistsError",
    "ConfigError",
    "ShapeMismatchError",
    "StorageError",
    "UsageError",
    "ArgumentTypeError",
    "WriterLockedError",
    "RankFailedError",
    "Preempted",
]


class RecsaveError(Exception):
    """Base class of every recsave error.

    ``path`` is the file or directory concerned and ``key`` the table / tensor / parameter name,
    when known.
    """

    def __init__(self, message: str, *, path: Optional[str] = None, key: Optional[str] = None):
        super().__init__(message)
        self.path = path
        self.key = key


class CheckpointNotFoundError(RecsaveError, FileNotFoundError):
    """A checkpoint, output directory or file of a checkpoint does not exist."""


class CheckpointExistsError(RecsaveError, FileExistsError):
    """A committed checkpoint with this id exists already; pick another id or delete it first."""


class CorruptCheckpointError(RecsaveError, ValueError):
    """Bytes on disk disagree with the index: a checksum mismatch, a truncated file, a header or
    offset out of bounds, an index that does not parse. Restore from another checkpoint."""


class IncompleteCheckpointError(CheckpointNotFoundError, CorruptCheckpointError):
    """A file the checkpoint's committed index lists is missing: the checkpoint exists but is
    damaged (incomplete); restore from another checkpoint. A CheckpointNotFoundError (and so a
    FileNotFoundError), as it was before it had a class of its own, so that ``except`` clauses
    written for a missing file keep catching it; also a CorruptCheckpointError, since the bytes
    on disk disagree with the index as much as for a truncated file: the command line reports it
    as damage found (exit 1), never as "no such checkpoint" (exit 2)."""


class OverLimitError(CorruptCheckpointError):
    """A file is larger than the knob that bounds its read allows (``max_index_bytes`` for an
    index): it may be intact, written by a job that raised the knob; raise it here to read the
    file. A CorruptCheckpointError, so a fallback load skips it as before; tools that unlist or
    report damage (``recsave repair``, ``recsave ls``) treat it as unknown, not as damage."""


class FormatVersionError(RecsaveError, ValueError):
    """The checkpoint (or export) was written in a format version this recsave cannot read, e.g. by
    a newer recsave; upgrade recsave. Not a CorruptCheckpointError: such a checkpoint is intact, so a
    fallback load stops on it instead of skipping it, and no save, rotation or gc deletes it.
    A ValueError, as an unsupported value of the file's ``format_version`` (``except ValueError``
    written for the corrupt case keeps catching it)."""


class ConfigError(RecsaveError, ValueError):
    """A load / model-bank configuration is invalid (unknown key, category, unmatched pattern...)."""


class ShapeMismatchError(RecsaveError, ValueError):
    """A tensor in the checkpoint does not fit the model (dim, dtype or shape differ)."""


class StorageError(RecsaveError, OSError):
    """An I/O operation failed (disk full, permission, remote store error). ``errno`` is set when the
    operating system reported one."""

    def __init__(self, message: str, *, path: Optional[str] = None, key: Optional[str] = None,
                 errno: Optional[int] = None):
        super().__init__(message, path=path, key=key)
        self.errno = errno
        self.filename = path

    def __str__(self) -> str:  # OSError's "[Errno n] strerror: filename" would hide the message
        return str(self.args[0]) if self.args else ""


class UsageError(RecsaveError, ValueError):
    """An API was called with arguments it cannot use (wrong buffer, closed writer, bad id...)."""


class ArgumentTypeError(RecsaveError, TypeError):
    """An argument of a public API has the wrong type (a bool is not an int here); ``key`` names
    the argument. Wrong values of the right type raise UsageError (a ValueError) instead."""


class WriterLockedError(RecsaveError, RuntimeError):
    """Another Saver (this process or another one) holds the writer lock of the output directory;
    close it, wait for it to finish, or save into another directory."""


class RankFailedError(RecsaveError, RuntimeError):
    """Another rank failed (raised an error, died, or timed out) during a collective save or load.

    ``collective_failed`` is True when a collective itself failed (a peer died or timed out), so
    that the group cannot be used any more, False when every rank learnt of the failure; then this
    error (and the failing rank's own) has ``rank_failures``: rank -> the class names (its MRO) of
    that rank's error, the same on every rank."""

    collective_failed: bool = False


class Preempted(SystemExit):
    """Raised by CheckpointManager.step() / check_preemption() after a preemption signal (SIGTERM,
    SIGUSR1): every rank saved and committed ``path`` (step ``step``) and the job should end now.

    A SystemExit with code 143 (128 + SIGTERM), so that an uncaught one ends the process with the
    status a scheduler expects from a job it terminated, and ``except Exception`` handlers in the
    training loop do not swallow it. Not a RecsaveError for the same reason: it is no error."""

    def __init__(self, message: str, *, path: Optional[str] = None, step: Optional[int] = None):
        super().__init__(143)
        self.message = message
        self.path = path
        self.step = step

    def __str__(self) -> str:
        return self.message
