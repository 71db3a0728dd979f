"""Tools layer: the `recsave` command line, the catalog (ls / inspect / verify / gc), Parquet
export and the demo training job."""
