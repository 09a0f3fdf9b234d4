"""The package keeps the layers docs/ARCHITECTURE.md lists: a module imports only from its own layer or above."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "reshard"
# docs/ARCHITECTURE.md, "Layers", top to bottom.
LAYERS = ["domain", "slicing", "io", "formats", "layouts", "hub", "plans", "mappings", "engine", "commands", "front"]
DOMAIN = {
    "errors",
    "dtypes",
    "partition",
    "config",
    "manifest",
    "vocab",
    "options",
    "progress",
    "sizes",
    "schema",
    "ranks",
    "megatron_model",
    "version",
    "tokenizer",
    "transform",
}
PACKAGES = {
    "io": "io",
    "formats": "formats",
    "layouts": "layouts",
    "hub": "hub",
    "plans": "plans",
    "quantization": "plans",
    "mappings": "mappings",
}
PACKAGES |= {"engine": "engine"}
PACKAGES |= {"commands": "commands", "cli": "front", "testing": "front", "__main__": "front", "slicing": "slicing"}


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
