"""Public path of the id partition (``recsave.partition.owner_of`` ...); it is defined in
recsave/tables/partition.py (docs/FORMAT.md section 3, `partition`)."""
from recsave.tables.partition import (
                                      DEFAULT_NUM_BUCKETS,
                                      SCHEME,
                                      bucket_of,
                                      bucket_range,
                                      mix64,
                                      owner_of,
                                      route,
                                      stable_order,
)

__all__ = ["DEFAULT_NUM_BUCKETS", "SCHEME", "mix64", "bucket_of", "bucket_range", "owner_of", "route", "stable_order"]
