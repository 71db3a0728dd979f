"""Storage layer: one interface for local disk and fsspec URLs (retries, atomic writes), the
output directory's writer lock, and the torch.distributed helpers the save and load paths use.

Which implementation serves a path is decided here (:func:`get_storage`) and nowhere else: callers
use the :class:`Storage` methods, which do the local or the remote thing themselves."""
import errno as _errno

from recsave.errors import StorageError
from recsave.storage.base import Storage
from recsave.storage.local import LocalStorage
from recsave.storage.remote import FsspecStorage
from recsave.storage.retry import backoff_s, is_transient

__all__ = ["Storage", "LocalStorage", "FsspecStorage", "get_storage", "is_url", "is_transient", "backoff_s"]


def is_url(path: str) -> bool:
    """Whether `path` names a location with a scheme (``s3://``, ``memory://``, ``file://``...)."""
    return "://" in path


def get_storage(path: str) -> Storage:
    """LocalStorage for plain paths, FsspecStorage for URLs."""
    if not isinstance(path, str) or not path:
        raise StorageError(f"storage path must be a non-empty string, got {path!r}", errno=_errno.EINVAL)
    return FsspecStorage(path) if is_url(path) else LocalStorage()
