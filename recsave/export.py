"""Public path of the Parquet export (``recsave.export.to_parquet``); it is defined in
recsave/tools/export.py."""
from recsave.tools.export import MANIFEST, ParquetSource, is_parquet_source, to_parquet

__all__ = ["to_parquet", "MANIFEST", "ParquetSource", "is_parquet_source"]
