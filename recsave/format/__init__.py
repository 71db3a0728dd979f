"""The on-disk format (docs/FORMAT.md): shard files in safetensors layout plus a JSON index, read
into the typed records of `recsave.format.records` (Index, TensorEntry, Chunk, ...).

`write_shards` / `read_tensors` go through the C++ engine; `recsave.format.oracle` is an independent
pure-Python reader kept as the test oracle.
"""
from recsave.format.dtypes import DType, from_torch
from recsave.format.index import FORMAT_VERSION, INDEX_FILE, MAGIC, merge_parts, new_part
from recsave.format.index import read as read_index
from recsave.format.index import validate as validate_index
from recsave.format.index import write as write_index
from recsave.format.reader import read_tensors
from recsave.format.records import (
                                    BucketRange,
                                    Chunk,
                                    DenseMeta,
                                    FileEntry,
                                    Index,
                                    IndexPart,
                                    Meta,
                                    Partition,
                                    TableMeta,
                                    TensorEntry,
)
from recsave.format.segments import BucketSegments
from recsave.format.writer import RowSource, shard_file_name, write_shards

__all__ = [
    "DType", "from_torch", "FORMAT_VERSION", "INDEX_FILE", "MAGIC", "merge_parts", "new_part",
    "read_index", "validate_index", "write_index", "read_tensors", "RowSource", "shard_file_name",
    "write_shards", "Index", "IndexPart", "FileEntry", "TensorEntry", "Chunk", "BucketRange",
    "BucketSegments", "Partition", "Meta", "TableMeta", "DenseMeta",
]
