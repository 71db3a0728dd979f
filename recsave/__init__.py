"""recsave: fast, safe checkpoints for recommender / CTR training in PyTorch."""
from . import errors, knobs, partition
from .errors import (CheckpointExistsError, CheckpointNotFoundError, ConfigError, CorruptCheckpointError,
                     FormatVersionError, RankFailedError, RecsaveError, ShapeMismatchError, StorageError,
                     UsageError, WriterLockedError)
from .hashtable import HashTable, split_sparse_dense_state_dict
from .manager import CheckpointManager
from .report import LoadedItem, LoadReport
from .saver import Saver
from .version import __version__

__all__ = [
    "HashTable", "split_sparse_dense_state_dict", "Saver", "CheckpointManager", "LoadReport",
    "LoadedItem", "errors", "knobs", "partition", "__version__", "RecsaveError",
    "CheckpointExistsError", "CheckpointNotFoundError", "ConfigError", "CorruptCheckpointError",
    "FormatVersionError", "ShapeMismatchError", "StorageError", "UsageError", "WriterLockedError",
    "RankFailedError",
]
