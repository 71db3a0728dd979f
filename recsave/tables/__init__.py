"""Tables layer: HashTable (dynamic int64 ids -> rows and optimizer slots), its id maps, the sparse
optimizers, the id partition (mix64 buckets), and host/device copy helpers."""
