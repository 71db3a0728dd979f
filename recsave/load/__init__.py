"""Load layer: load / model-bank configs, checkpoint and Parquet sources, plan, execute, report."""
