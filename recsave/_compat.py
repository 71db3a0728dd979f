"""Old module paths (before the layered layout, see CHANGELOG.md) keep importing: each one
is an alias of the module that now holds its code, so ``import recsave.saver`` and
``recsave.saver.Saver`` still work and name the same objects."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import CodeType, ModuleType
from typing import Optional, Sequence

# old path -> new path (docs/ARCHITECTURE.md names each layer). recsave.optim, recsave.partition and
# recsave.export are public paths of their own (small facade modules), not aliases.
MOVED = {
    "recsave.saver": "recsave.save.saver",
    "recsave.snapshot": "recsave.save.snapshot",
    "recsave.hashtable": "recsave.tables.hashtable",
    "recsave.idmap": "recsave.tables.idmap",
    "recsave.memhint": "recsave.tables.memhint",
    "recsave.devcopy": "recsave.tables.devcopy",
    "recsave.loadconf": "recsave.load.config",
    "recsave.sources": "recsave.load.sources",
    "recsave.parquet": "recsave.load.parquet",
    "recsave.loader": "recsave.load.execute",
    "recsave.report": "recsave.load.report",
    "recsave.lock": "recsave.storage.lock",
    "recsave.dist": "recsave.storage.dist",
    "recsave.ckptlist": "recsave.format.ckptlist",
    "recsave.torchio": "recsave.format.torchio",
    "recsave.catalog": "recsave.tools.catalog",
    "recsave.cli": "recsave.tools.cli",
    "recsave.demo": "recsave.tools.demo",
    "recsave.progress": "recsave.tools.progress",
}


class _AliasLoader(importlib.abc.Loader):
    """Hands out the module at the new path. importlib sets the alias's spec on the module it gets;
    exec_module puts the module's own spec back, so the module keeps its real name and origin."""

    def __init__(self, target: str):
        self.target = target
        self.real_spec: Optional[ModuleSpec] = None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.real_spec

    def get_code(self, fullname: str) -> Optional[CodeType]:
        """For ``python -m recsave.demo`` / ``python -m recsave.cli``: runpy runs the new module."""
        spec = importlib.util.find_spec(self.target)
        loader = spec.loader if spec is not None else None
        return loader.get_code(self.target) if isinstance(loader, importlib.abc.InspectLoader) else None


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
                  ) -> Optional[ModuleSpec]:
        new = MOVED.get(fullname)
        if new is None:
            return None
        real = importlib.util.find_spec(new)  # its file is the alias's origin (runpy's argv[0])
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new),
                                               origin=real.origin if real is not None else None)


def install() -> None:
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
