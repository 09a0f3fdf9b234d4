"""The package keeps the layers docs/ARCHITECTURE.md lists: a module imports only from its own layer or above."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "reshard"
# docs/ARCHITECTURE.md, "Layers", top to bottom.
LAYERS = ["domain", "io", "formats", "layouts", "hub", "plans", "mappings", "engine", "commands", "front"]
DOMAIN = {
    "errors",
    "dtypes",
    "geometry",
    "config",
    "manifest",
    "vocab",
    "options",
    "sizes",
    "schema",
    "ranks",
    "version",
}
PACKAGES = {
    "megatron": "domain",  # reshard/megatron/: Megatron's pure knowledge (the name table is mappings/megatron/)
    "io": "io",
    "formats": "formats",
    "layouts": "layouts",
    "hub": "hub",
    "plans": "plans",
    "quantization": "plans",
    "mappings": "mappings",
}
PACKAGES |= {"engine": "engine"}
PACKAGES |= {"commands": "commands", "cli": "front", "testing": "front", "__main__": "front"}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return "domain" if parts[1] in DOMAIN else PACKAGES.get(parts[1])


def runtime_imports(path: Path) -> list[str]:
    """``reshard.*`` modules imported at run time (not under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    return [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("reshard.")
        if id(node) not in typing_only
    ]


def test_every_module_belongs_to_a_layer() -> None:
    modules = [".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts) for p in PACKAGE.rglob("*.py")]
    assert [m for m in modules if not m.endswith("__init__") and layer_of(m) is None] == []


def test_no_module_imports_from_a_layer_below_its_own() -> None:
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mine = layer_of(module)
        for imported in runtime_imports(path):
            theirs = layer_of(imported)
            if mine and theirs and LAYERS.index(theirs) > LAYERS.index(mine):
                wrong.append(f"{module} ({mine}) imports {imported} ({theirs})")
    assert wrong == []


# docs/ARCHITECTURE.md, "engine": its rooms, each importing only the ones before it (typing aside).
ENGINE_ROOMS = ["plan", "move", "run"]


def test_the_engines_rooms_import_only_the_rooms_before_them() -> None:
    engine = PACKAGE / "engine"
    assert sorted(p.name for p in engine.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(ENGINE_ROOMS)
    assert sorted(p.name for p in engine.glob("*.py")) == ["__init__.py"]  # every module is in a room
    wrong = []
    for room in ENGINE_ROOMS:
        for path in (engine / room).rglob("*.py"):
            for imported in runtime_imports(path):
                parts = imported.split(".")
                if parts[:2] == ["reshard", "engine"] and len(parts) > 2:
                    if ENGINE_ROOMS.index(parts[2]) > ENGINE_ROOMS.index(room):
                        wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {imported}")
    assert wrong == []
