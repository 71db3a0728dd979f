"""Public path of the Lightning integration (``from recsave.lightning import RecsaveCallback``); it is
defined in recsave/tools/lightning.py and needs the `lightning` package (``recsave[lightning]``)."""
from recsave.tools.lightning import LIGHTNING_STATE, RecsaveCallback

__all__ = ["RecsaveCallback", "LIGHTNING_STATE"]
