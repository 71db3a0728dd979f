"""recsave: fast, safe checkpoints for recommender / CTR training in PyTorch."""
from . import errors, knobs
from .errors import (CheckpointNotFoundError, ConfigError, CorruptCheckpointError, FormatVersionError,
                     RecsaveError, ShapeMismatchError, StorageError, UsageError)
from .version import __version__

__all__ = [
    "errors", "knobs", "__version__", "RecsaveError", "CheckpointNotFoundError", "ConfigError",
    "CorruptCheckpointError", "FormatVersionError", "ShapeMismatchError", "StorageError", "UsageError",
]
