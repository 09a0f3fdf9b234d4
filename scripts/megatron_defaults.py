"""Write ``reshard/megatron/defaults.py``: Megatron-LM's argument defaults, read from its source with ``ast``.

reshard refuses a Megatron argument its table does not know unless it is at its default; this script records
what "its default" is, per Megatron-LM release, without importing Megatron-LM (its ``arguments.py`` imports
Megatron-Core, Transformer Engine and more). Two sources, both parsed:

- every ``add_argument`` call of ``megatron/training/arguments.py`` (``dest`` from ``dest=`` or the first
  ``--long-name``; ``store_true`` -> False, ``store_false`` -> True, a literal ``default=``, else None);
- every dataclass ``ArgumentGroupFactory(Class)`` turns into arguments there (Megatron-Core's
  ``TransformerConfig`` and its bases, the training configs): each field's literal default, ``default_factory``
  of ``list`` / ``dict`` as empty, the ``argparse_meta`` default when it names one.

A default that is not a literal (computed at parse time) is not recorded: such an argument is then refused
unless it is None. NeMo 2's ``model.yaml`` uses the same ``TransformerConfig`` field names, so the table serves
it too.

Regenerate (Megatron-LM mirrored as a bare git repository, e.g. by ``git clone --mirror``)::

    python scripts/megatron_defaults.py /path/to/Megatron-LM.git core_v0.16.1 core_v0.19.0

and commit the rewritten ``reshard/megatron/defaults.py`` with the tags named in the commit message.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

ARGUMENTS = "megatron/training/arguments.py"
OUT = Path(__file__).resolve().parents[1] / "reshard" / "megatron" / "defaults.py"
_UNKNOWN = object()  # a default that is not a literal


def _show(repo: str, tag: str, path: str) -> str:
    command = ["git", "-C", repo, "show", f"{tag}:{path}"]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def _grep_class(repo: str, tag: str, name: str) -> list[str]:
    command = ["git", "-C", repo, "grep", "-l", f"^class {name}\\b", tag, "--", "megatron/*.py"]
    found = subprocess.run(command, capture_output=True, text=True).stdout.split()
    return [line.split(":", 1)[1] for line in found]


def _literal(node: ast.AST | None) -> Any:
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _UNKNOWN


def _keywords(call: ast.Call) -> dict[str, ast.AST]:
    return {k.arg: k.value for k in call.keywords if k.arg}


def _add_argument_defaults(source: str) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "add_argument":
            continue
        kw = _keywords(node)
        names = [_literal(a) for a in node.args]
        longs = [n for n in names if isinstance(n, str) and n.startswith("--")]
        dest = _literal(kw["dest"]) if "dest" in kw else (longs[0][2:].replace("-", "_") if longs else None)
        if not isinstance(dest, str):
            continue
        action = _literal(kw.get("action"))
        if "default" in kw:
            value = _literal(kw["default"])
        elif action == "store_true":
            value = False
        elif action == "store_false":
            value = True
        else:
            value = None
        defaults.setdefault(dest, value)  # argparse keeps the first default given to a dest
    return defaults


def _factory_classes(source: str) -> list[tuple[str, set[str]]]:
    classes = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ArgumentGroupFactory":
            if node.args and isinstance(node.args[0], ast.Name):
                exclude = _literal(_keywords(node).get("exclude"))
                classes.append((node.args[0].id, set(exclude) if isinstance(exclude, list) else set()))
    return classes


def _field_default(value: ast.AST) -> Any:
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        kw = _keywords(value)
        meta = _literal(kw.get("metadata"))
        if isinstance(meta, dict) and isinstance(meta.get("argparse_meta"), dict):
            if "default" in meta["argparse_meta"]:
                return meta["argparse_meta"]["default"]
        if "default" in kw:
            return _literal(kw["default"])
        factory = kw.get("default_factory")
        if isinstance(factory, ast.Name) and factory.id in ("list", "dict"):
            return [] if factory.id == "list" else {}
        return _UNKNOWN
    return _literal(value)


def _class_fields(repo: str, tag: str, name: str, seen: set[str]) -> dict[str, Any]:
    if name in seen:
        return {}
    seen.add(name)
    for path in _grep_class(repo, tag, name):
        for node in ast.parse(_show(repo, tag, path)).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                fields: dict[str, Any] = {}
                for base in node.bases:
                    if isinstance(base, ast.Name):
                        fields.update(_class_fields(repo, tag, base.id, seen))
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        if "ClassVar" in ast.unparse(item.annotation):
                            continue
                        fields[item.target.id] = _field_default(item.value) if item.value else _UNKNOWN
                return fields
    return {}


def release_defaults(repo: str, tag: str) -> dict[str, Any]:
    """Argument name -> default of one Megatron-LM release (``_UNKNOWN`` when not a literal)."""
    source = _show(repo, tag, ARGUMENTS)
    defaults: dict[str, Any] = {}
    for cls, exclude in _factory_classes(source):
        for name, value in _class_fields(repo, tag, cls, set()).items():
            if name not in exclude:
                defaults[name] = value
    defaults.update(_add_argument_defaults(source))  # explicit arguments (excluded fields come back this way)
    return defaults


def render(per_tag: dict[str, dict[str, Any]]) -> str:
    """The text of :data:`OUT` for the defaults of each release (tag -> argument -> default), in tag order."""
    tags = tuple(per_tag)
    names = sorted(set().union(*per_tag.values()))
    lines = [
        '"""Megatron-LM\'s argument defaults per release: generated by ``scripts/megatron_defaults.py``, do not edit.',
        "",
        "Name -> the defaults its releases give it (an argument at any of them is at its default). Names whose",
        "default is computed at parse time are absent.",
        '"""',
        "",
        "from typing import Any",
        "",
        f"RELEASES = {tuple(tags)!r}",
        "",
        "DEFAULTS: dict[str, tuple[Any, ...]] = {",
    ]
    for name in names:
        values = [d.get(name, _UNKNOWN) for d in per_tag.values()]
        if all(v is _UNKNOWN for v in values):
            continue
        known = []
        for value in values:
            if value is not _UNKNOWN and not any(value == k and type(value) is type(k) for k in known):
                known.append(value)
        lines.append(f"    {name!r}: {tuple(known)!r},")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(repo: str, *tags: str) -> None:
    text = render({tag: release_defaults(repo, tag) for tag in tags})
    OUT.write_text(text)
    print(f"{OUT}: {len(text.splitlines()) - 12} arguments from {', '.join(tags)}")


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
