"""Public path of the Parquet export (``recsave.export.to_parquet``, defined in
recsave/tools/export.py) and the Parquet delta feed (``recsave.export.export_delta``, defined in
recsave/tools/deltafeed.py)."""
from recsave.tools.deltafeed import DELTA_MANIFEST, export_delta
from recsave.tools.export import MANIFEST, ParquetSource, is_parquet_source, to_parquet

__all__ = ["to_parquet", "MANIFEST", "ParquetSource", "is_parquet_source", "export_delta", "DELTA_MANIFEST"]
