"""No two modules of the package import each other, whether at import time, inside a function (lazily) or under
``if TYPE_CHECKING:``: a mutual import is a knot the layers of docs/ARCHITECTURE.md cannot order, and the
registry refactor (issue 27) removes the ones left. ``tests/test_layers.py`` checks the direction of run-time
imports; this checks every import, read statically with ``ast`` (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "reshard"


def module_name(path: Path, package: Path) -> str:
    """``reshard/x/y.py`` -> ``reshard.x.y``; ``reshard/x/__init__.py`` -> ``reshard.x``."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def known_modules(package: Path) -> set[str]:
    return {module_name(path, package) for path in package.rglob("*.py")}


def package_of(path: Path, package: Path) -> str:
    """The package a module's relative imports start from."""
    name = module_name(path, package)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported_modules(path: Path, package: Path, modules: set[str]) -> set[str]:
    """Every module of the package that the file at ``path`` imports, anywhere in it.

    ``from reshard.x import y`` is the module ``reshard.x.y`` when that module exists, else ``reshard.x`` (a name
    defined in it); ``import reshard.x`` and ``from reshard import x`` of a package are its ``__init__``.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package_of(path, package).split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif base in modules:
                    found.add(base)
    return found - {module_name(path, package)}


def mutual_pairs(package: Path) -> list[str]:
    """Each pair of modules that import each other, as ``"a <-> b"`` (a before b)."""
    modules = known_modules(package)
    graph = {module_name(path, package): imported_modules(path, package, modules) for path in package.rglob("*.py")}
    return sorted({" <-> ".join(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph[b]})


def test_the_scan_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker itself on a tiny package with one pair per kind of import, and imports that make no pair."""
    root = tmp_path / "reshard"
    (root / "x").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from reshard.b import thing\n",
        "b.py": "def f():\n    import reshard.a\n",  # lazy, and a plain `import`
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from reshard.x import y\n",
        "x/__init__.py": "from reshard.d import D\n",
        "x/y.py": "from .. import c\n",  # relative, resolved to the module reshard.c
        "d.py": "from reshard import x\n",  # the package reshard.x, i.e. its __init__
        "e.py": "import reshard.d\n",  # one way only: no pair
    }
    for name, text in files.items():
        (root / name).write_text(text)
    assert mutual_pairs(root) == ["reshard.a <-> reshard.b", "reshard.c <-> reshard.x.y", "reshard.d <-> reshard.x"]


def test_no_two_modules_import_each_other() -> None:
    assert mutual_pairs(PACKAGE) == []
