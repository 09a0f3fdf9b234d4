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


def packages_read(path: Path, package: Path, packages: set[str]) -> set[str]:
    """The packages whose own namespace (their ``__init__``) the file at ``path`` reads: ``from reshard.x import y``
    and ``from . import y`` read ``reshard.x`` even when ``y`` is a submodule (Python looks it up on the package,
    half-initialised if the package is still importing), as does ``import reshard.x``. ``from reshard.x.y import z``
    and ``import reshard.x.y as y`` name the module ``reshard.x.y`` and read no package of their own."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in packages}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package_of(path, package).split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base in packages:
                found.add(base)
    return found - {module_name(path, package)}


def packages_imported_back(package: Path) -> list[str]:
    """Each package whose ``__init__`` imports (directly or through other modules) a module that reads the package
    back, as ``"pkg: pkg -> pkg.a -> pkg"``: the module then runs while the package is half-initialised, and only
    works as long as it needs nothing the ``__init__`` defines after that import line."""
    modules = known_modules(package)
    packages = {module_name(path, package) for path in package.rglob("__init__.py")}
    graph = {
        module_name(path, package): imported_modules(path, package, modules) | packages_read(path, package, packages)
        for path in package.rglob("*.py")
    }
    found = []
    for pkg in sorted(packages):
        came_from: dict[str, str] = {}
        todo = [(pkg, name) for name in sorted(graph[pkg]) if name != pkg]
        while todo:
            parent, name = todo.pop()
            if name in came_from or name == pkg:
                continue
            came_from[name] = parent
            if pkg in graph.get(name, set()):
                chain = [name]
                while chain[-1] != pkg:
                    chain.append(came_from[chain[-1]])
                found.append(f"{pkg}: {' -> '.join([*reversed(chain), pkg])}")
            todo += [(name, other) for other in sorted(graph.get(name, set()))]
    return found


def test_the_package_scan_sees_a_package_read_back(tmp_path: Path) -> None:
    """The checker on a tiny package: ``p/__init__`` imports ``p.a``, which reads ``p`` back with ``from p import``
    (the pattern ``layouts/dcp`` and ``layouts/deepspeed`` had, issue 43); ``q``'s module reads ``q`` back through
    another module and a relative import; ``r`` imports its siblings by their full names and is clean."""
    root = tmp_path / "reshard"
    for folder in ("p", "q", "r"):
        (root / folder).mkdir(parents=True)
    files = {
        "__init__.py": "",
        "p/__init__.py": "from reshard.p import a\n",  # the package naming its own submodule: fine
        "p/a.py": "from reshard.p import b\n",  # reads reshard.p while it is importing
        "p/b.py": "",
        "q/__init__.py": "from reshard.q.c import C\n",
        "q/c.py": "from reshard.q.d import D\nC = 1\n",
        "q/d.py": "from . import e\nD = 1\n",
        "q/e.py": "",
        "r/__init__.py": "from reshard.r.f import F\n",
        "r/f.py": "import reshard.r.g as g\nfrom reshard.r.g import G\nF = 1\n",
        "r/g.py": "G = 1\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    assert packages_imported_back(root) == [
        "reshard.p: reshard.p -> reshard.p.a -> reshard.p",
        "reshard.q: reshard.q -> reshard.q.c -> reshard.q.d -> reshard.q",
    ]


def test_no_package_init_imports_a_module_that_imports_the_package_back() -> None:
    """House rule (issue 43): a package's ``__init__`` may import its submodules, but none of those (nor what they
    import) may read the package back; siblings import each other by their full module names."""
    assert packages_imported_back(PACKAGE) == []
