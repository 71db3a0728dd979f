"""recsave: fast, safe checkpoints for recommender / CTR training in PyTorch.

The layers are subpackages (docs/ARCHITECTURE.md); this module re-exports the public API."""
from recsave import _compat, errors, knobs, partition
from recsave.errors import (
                            ArgumentTypeError,
                            CheckpointExistsError,
                            CheckpointNotFoundError,
                            ConfigError,
                            CorruptCheckpointError,
                            FormatVersionError,
                            IncompleteCheckpointError,
                            OverLimitError,
                            Preempted,
                            RankFailedError,
                            RecsaveError,
                            ShapeMismatchError,
                            StorageError,
                            UsageError,
                            WriterLockedError,
)
from recsave.load.report import LoadedItem, LoadReport
from recsave.manager import CheckpointManager
from recsave.save.saveinfo import SaveInfo
from recsave.save.saver import Saver
from recsave.tables.hashtable import HashTable, split_sparse_dense_state_dict
from recsave.tables.interop import from_dcp_state_dict, to_dcp_state_dict
from recsave.tables.tablelike import TableLike
from recsave.tools.catalog import describe
from recsave.tools.compact import compact
from recsave.tools.convert import convert
from recsave.tools.serving import export_serving
from recsave.version import __version__

__all__ = [
    "HashTable", "split_sparse_dense_state_dict", "to_dcp_state_dict", "from_dcp_state_dict", "convert",
    "TableLike",
    "Saver", "CheckpointManager", "LoadReport", "export_serving",
    "LoadedItem", "errors", "knobs", "partition", "__version__", "RecsaveError",
    "CheckpointExistsError", "CheckpointNotFoundError", "ConfigError", "CorruptCheckpointError",
    "FormatVersionError", "IncompleteCheckpointError", "OverLimitError", "ShapeMismatchError", "StorageError",
    "UsageError", "WriterLockedError",
    "RankFailedError", "ArgumentTypeError", "Preempted", "SaveInfo", "compact",
    "describe",
]

_compat.install()
