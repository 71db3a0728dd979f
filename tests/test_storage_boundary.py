"""Only recsave/storage/ knows whether a path is local or remote: everywhere else the Storage
methods do the local or the remote thing themselves (docs/API.md section 4)."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "recsave"
# Names whose use outside the storage layer is a local-vs-remote branch: the old `is_local` flag, the
# concrete classes (isinstance checks, direct construction) and the URL test.
FORBIDDEN = {"is_local", "LocalStorage", "FsspecStorage", "is_url"}


def storage_kind_uses(source: str, filename: str = "<source>"):
    """(line, name) of every forbidden name in `source`: read, imported, or as an attribute."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Name) and node.id in FORBIDDEN:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN:
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found += [(node.lineno, a.name) for a in node.names if a.name.rsplit(".", 1)[-1] in FORBIDDEN]
    for node in ast.walk(ast.parse(source, filename)):  # `is_local` spelled as a string (getattr)
        if isinstance(node, ast.Constant) and node.value in FORBIDDEN:
            found.append((node.lineno, node.value))
    return sorted(found)


@pytest.mark.parametrize("snippet,expected", [
    ("if storage.is_local:\n    pass\n", [(1, "is_local")]),
    ("from recsave.storage import LocalStorage\nx = isinstance(s, LocalStorage)\n",
     [(1, "LocalStorage"), (2, "LocalStorage")]),
    ("import recsave.storage\nok = isinstance(s, recsave.storage.FsspecStorage)\n", [(2, "FsspecStorage")]),
    ("local = getattr(storage, 'is_local', False)\n", [(1, "is_local")]),
    ("from recsave.storage import is_url\n", [(1, "is_url")]),
    ("storage = get_storage(path)\nstorage.write_shard(p, c, durable=True)\n", []),
])
def test_the_scan_finds_storage_kind_branches(snippet, expected):
    assert storage_kind_uses(snippet) == expected


def test_no_storage_kind_branches_outside_the_storage_layer():
    files = [p for p in PACKAGE.rglob("*.py") if "storage" not in p.relative_to(PACKAGE).parts[:1]]
    assert len(files) > 30  # the scan really looks at the package
    offenders = {str(p.relative_to(PACKAGE.parent)): uses for p in files
                 if (uses := storage_kind_uses(p.read_text(encoding="utf-8"), str(p)))}
    assert offenders == {}, ("local-vs-remote decisions belong in recsave/storage/: add a Storage method "
                             f"instead of branching on the kind of storage: {offenders}")
