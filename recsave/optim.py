"""Public path of the sparse optimizers (``from recsave.optim import SparseAdagrad``); they are
defined in recsave/tables/optim.py."""
from recsave.tables.optim import SparseAdagrad, SparseAdam, SparseOptimizer, SparseSGD

__all__ = ["SparseOptimizer", "SparseSGD", "SparseAdagrad", "SparseAdam"]
