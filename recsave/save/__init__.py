"""Save layer: the Saver facade, the snapshot of a model's state, and the write pipeline."""
