"""Storage layer: one interface for local disk and fsspec URLs (retries, atomic writes), the
output directory's writer lock, and the torch.distributed helpers the save and load paths use."""
from recsave.storage.backends import (FsspecStorage, LocalStorage, Storage, backoff_s, get_storage, is_transient,
                                      is_url)

__all__ = ["Storage", "LocalStorage", "FsspecStorage", "get_storage", "is_url", "is_transient", "backoff_s"]
