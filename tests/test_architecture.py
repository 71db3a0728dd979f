"""The layering of docs/ARCHITECTURE.md, checked on recsave's import graph as the source states it.

The graph is read with `ast` from recsave/**/*.py (no import runs): every `import recsave.x` and
`from recsave.x import y` (relative imports resolved), at module level, inside functions and under
`if TYPE_CHECKING:` alike, since each is a dependency of the importing module.
"""
from __future__ import annotations

import ast
import functools
import os
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(ROOT, "recsave")

# Lowest first: a module may import from its own layer and the ones before it (docs/ARCHITECTURE.md).
LAYERS = [
    ("foundation", ["recsave.errors", "recsave.argcheck", "recsave.knobs", "recsave.version", "recsave.threads",
                    "recsave.gcpause", "recsave._C", "recsave._compat"]),
    ("tables/storage", ["recsave.tables", "recsave.storage"]),
    ("format", ["recsave.format"]),
    ("load", ["recsave.load"]),
    ("save", ["recsave.save"]),
    ("manager", ["recsave.manager"]),
    # recsave/__init__.py, the public facade, is the top too: only tools (e.g. the demo) may use it.
    ("tools", ["recsave.tools", "recsave", "recsave.optim", "recsave.partition", "recsave.export",
               "recsave.lightning"]),
]
# The public facade: it re-exports (and _compat aliases) modules of every layer; recsave.optim,
# recsave.partition, recsave.export and recsave.lightning are the public paths of four of them.
EXEMPT = {"recsave", "recsave._compat", "recsave.optim", "recsave.partition", "recsave.export", "recsave.lightning"}
# Old-path imports (source, old path) that are still to be fixed: the check passes with exactly
# these, so a new one fails now and a fixed one fails until it is deleted here.
KNOWN_OLD_PATHS: Set[Tuple[str, str]] = set()


class Edge(NamedTuple):
    source: str  # importing module
    target: str  # imported module (an old path resolved to the module it aliases)
    where: str  # file:line of the import
    old_path: str  # the old module path the source wrote (recsave/_compat.py), or ""

    def __str__(self) -> str:
        via = f" (as {self.old_path})" if self.old_path else ""
        return f"{self.where}: {self.source} -> {self.target}{via}"


@functools.lru_cache(maxsize=None)
def _modules(package_dir: str = PACKAGE_DIR) -> Dict[str, str]:
    """Module name -> source path, for every .py under recsave/, plus the extension recsave._C."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, os.path.dirname(package_dir))[:-len(".py")].split(os.sep)
                found[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    found["recsave._C"] = os.path.join(package_dir, "_C.pyi")  # the C++ extension (its stub)
    return found


def _old_paths(package_dir: str) -> Dict[str, str]:
    """recsave._compat.MOVED (old module path -> new one), read from its source."""
    path = os.path.join(package_dir, "_compat.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MOVED" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} no longer assigns MOVED: update this test")


@functools.lru_cache(maxsize=None)
def _import_graph(package_dir: str = PACKAGE_DIR) -> List[Edge]:
    modules, moved = _modules(package_dir), _old_paths(package_dir)
    edges = []
    for source, path in sorted(modules.items()):
        if source == "recsave._C":
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        is_package = path.endswith("__init__.py")
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, source, is_package)
                # `from pkg import name`: the submodule pkg.name where there is one, else pkg itself.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules or f"{base}.{a.name}" in moved
                           else base for a in node.names]
            where = f"{os.path.relpath(path, os.path.dirname(package_dir))}:{getattr(node, 'lineno', 0)}"
            edges += [Edge(source, moved.get(t, t), where, t if t in moved else "")
                      for t in targets if t == "recsave" or t.startswith("recsave.")]
    return sorted(set(edges))


def _absolute(node: ast.ImportFrom, source: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = source.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _layer(module: str) -> Optional[int]:
    """Index in LAYERS of the longest prefix naming module (or None: not in any layer)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module.startswith(prefix + ".") and prefix != "recsave"  # the facade is one file
            if (module == prefix or inside) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def _strongly_connected(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module, or with a self-loop."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    out.append(sorted(component))
    return out


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Guards the checks below against a parser that misses imports: a small package with one import
    of each kind, and the layers of a few real modules."""
    files = {
        "__init__.py": "from recsave import _compat\nfrom recsave.save.saver import Saver\n",
        "_compat.py": "MOVED = {'recsave.saver': 'recsave.save.saver'}\n",
        "knobs.py": "",
        "save/__init__.py": "from recsave.save import saver\n",
        "save/saver.py": "from typing import TYPE_CHECKING\nimport recsave.knobs\n"
                         "if TYPE_CHECKING:\n    from recsave.load.plan import Plan\n",
        "load/__init__.py": "",
        "load/plan.py": "from . import sources\nfrom ..knobs import get\n\n"
                        "def f():\n    from recsave import saver\n",
        "load/sources.py": "from recsave.load import *\nimport os, recsave.knobs as k\n",
    }
    for name, text in files.items():
        (tmp_path / "recsave" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "recsave" / name).write_text(text)
    edges = {(e.source, e.target, e.old_path) for e in _import_graph(str(tmp_path / "recsave"))}
    assert edges == {
        ("recsave", "recsave._compat", ""), ("recsave", "recsave.save.saver", ""),
        ("recsave.save", "recsave.save.saver", ""),
        ("recsave.save.saver", "recsave.knobs", ""), ("recsave.save.saver", "recsave.load.plan", ""),
        ("recsave.load.plan", "recsave.load.sources", ""), ("recsave.load.plan", "recsave.knobs", ""),
        ("recsave.load.plan", "recsave.save.saver", "recsave.saver"),
        ("recsave.load.sources", "recsave.load", ""), ("recsave.load.sources", "recsave.knobs", ""),
    }
    assert _layer("recsave.format.index") == 2 and _layer("recsave") == _layer("recsave.tools.cli") == 6
    assert _layer("recsave.tables.partition") == _layer("recsave.storage.dist") == 1
    assert _layer("recsave.new_module") is None


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _modules() if _layer(m) is None)
    assert not unplaced, f"modules in no layer of LAYERS (add them to docs/ARCHITECTURE.md and here): {unplaced}"


def test_imports_name_modules_that_exist():
    """Every recsave import names a module of the source tree; a module outside recsave/__init__.py and
    recsave/_compat.py does not use an old path (an alias would hide its edge from the checks below
    if it were not resolved here)."""
    modules = _modules()
    missing = [e for e in _import_graph() if e.target not in modules]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(map(str, missing))
    old = [e for e in _import_graph() if e.old_path and e.source not in EXEMPT]
    new = [e for e in old if (e.source, e.old_path) not in KNOWN_OLD_PATHS]
    assert not new, "imports of old module paths (use the new one):\n" + "\n".join(map(str, new))
    assert {(e.source, e.old_path) for e in old} == KNOWN_OLD_PATHS, "fixed: remove it from KNOWN_OLD_PATHS"


def test_modules_import_only_from_their_own_or_lower_layers():
    upward = [e for e in _import_graph()
              if e.source not in EXEMPT and _layer(e.target) is not None and _layer(e.source) is not None
              and _layer(e.target) > _layer(e.source)]
    assert not upward, "imports from a higher layer (docs/ARCHITECTURE.md):\n" + "\n".join(
        f"{e}  ({LAYERS[_layer(e.source)][0]} -> {LAYERS[_layer(e.target)][0]})" for e in upward)


def test_no_import_cycles():
    """Between modules; a package's __init__ importing its own modules (a re-export) does not count."""
    modules = _modules()
    edges = [e for e in _import_graph()
             if not (modules[e.source].endswith("__init__.py") and e.target.startswith(e.source + "."))]
    graph: Dict[str, Set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    cycles = _strongly_connected(graph)
    assert not cycles, "import cycles (each line an import inside one cycle):\n" + "\n\n".join(
        "\n".join(str(e) for e in edges if e.source in c and e.target in c) for c in cycles)
