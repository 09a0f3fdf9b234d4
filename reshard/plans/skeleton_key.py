"""The cache key of a meta build (``plans/skeleton.py`` ``build_skeleton``): a digest of everything its answer
depends on, made in a few milliseconds without importing transformers.

The answer (the model's class, parameter shapes, TP plan, sub-models, tied tensors, the checkpoint names transformers
renames on load (its top-level ``conversion_mapping.py``) and per-layer head counts, or transformers' refusal) is a
function of: the config (its raw mapping, ``model_type`` and ``architectures`` in it), the code that builds and
reads the model (transformers and torch, and whatever optional package transformers delegates a model to, such as
timm), the interpreter, and reshard's own reading of the model. The key holds each:

- the config's raw mapping as canonical JSON (sorted keys; a config with a value JSON cannot spell exactly, a tuple
  or a key that is not a string, gets no key and is never cached);
- reshard's version and the bytes of ``skeleton.py``, which turns the built model into the answer;
- the interpreter's ``sys.version``;
- the name of every distribution installed where transformers is and in the environment's ``site-packages``
  (``transformers-5.23.0.dist-info``, ``torch-2.13.0.dist-info``, ...): transformers' and torch's versions, and any
  package installed, removed or upgraded beside them, change it. Listing those folders costs less than asking
  ``importlib.metadata`` for two versions;
- transformers' own source by (path, size, mtime) of the modules a model's class is made of (the package's top
  level, ``utils/``, ``distributed/``, ``integrations/``, ``generation/``, ``loss/``, ``models/auto/`` and the
  folders of the config's model types, its sub-configs' too), so that an editable install changed under one version
  string misses. A few hundred ``stat`` calls, cheap beside the build they save (measured: docs/performance.md).

Not covered, and a reason to turn the cache off (``RESHARD_CACHE_DIR=``) while editing them: an editable torch, an
editable optional package, or an edit in another folder of an editable transformers (a model folder that the
config's model folders import from). Environment variables are not in the key: transformers reads none that change a
model built on ``meta``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from reshard.version import __version__

# transformers' sub-packages a model class is made of (besides its own models/<type>/ folder).
CODE_FOLDERS = ("", "utils", "distributed", "integrations", "generation", "loss", "models/auto")
_BUILDER = Path(__file__).with_name("skeleton.py")
_MAX_DEPTH = 32  # a config nested deeper is not cached
_MAX_NAME = 100  # a model type longer than any of transformers' has no folder


def skeleton_key(raw: dict) -> str | None:
    """The key of the meta build of the config ``raw``; None when it cannot be keyed (transformers not found, a
    config JSON cannot spell exactly): such a build is not cached."""
    if not _plain(raw, 0):
        return None
    try:
        root = transformers_root()
        if root is None:
            return None
        facts = {
            "reshard": __version__,
            "builder": hashlib.sha256(_BUILDER.read_bytes()).hexdigest(),
            "python": sys.version,
            "distributions": _distributions(root.parent),
            "transformers": str(root),
            "sources": _sources(root, _model_types(raw)),
            "config": raw,
        }
        text = json.dumps(facts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (OSError, ValueError, ImportError, RecursionError):
        return None
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def transformers_root() -> Path | None:
    """transformers' package folder, found as an import would find it, without importing it."""
    spec = importlib.util.find_spec("transformers")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def _plain(value: object, depth: int) -> bool:
    """``value`` is made of JSON's own types only (so its canonical JSON names it exactly)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth > _MAX_DEPTH:
        return False
    if type(value) is list:
        return all(_plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())
    return False


def _distributions(site: Path) -> list[str]:
    """The distributions installed in ``site`` (transformers' folder) and in ``sys.path``'s site-packages."""
    folders = {site, *(Path(p) for p in sys.path if Path(p).name in ("site-packages", "dist-packages"))}
    names = []
    for folder in sorted(folders):
        try:
            with os.scandir(folder) as listing:
                names += [f"{folder}/{e.name}" for e in listing if e.name.endswith((".dist-info", ".egg-info"))]
        except OSError:
            continue
    return sorted(names)


def _model_types(raw: dict) -> set[str]:
    """The ``model_type`` of the config and of its sub-configs (a composite model builds theirs too)."""
    found, todo = set(), [(raw, 0)]
    while todo:
        mapping, depth = todo.pop()
        if isinstance(mapping.get("model_type"), str):
            found.add(mapping["model_type"])
        todo += [(v, depth + 1) for v in mapping.values() if isinstance(v, dict) and depth < _MAX_DEPTH]
    return found


def _sources(root: Path, model_types: set[str]) -> list[list[object]]:
    """(path, size, mtime) of transformers' modules in :data:`CODE_FOLDERS` and the model types' folders."""
    folders = set(CODE_FOLDERS)
    for model_type in model_types:
        folder = _model_folder(root / "models", model_type)
        if folder is not None:
            folders.add(f"models/{folder}")
    stats = []
    for folder in sorted(folders):
        try:
            with os.scandir(root / folder) as listing:
                for entry in listing:
                    if entry.name.endswith(".py"):
                        info = entry.stat()
                        stats.append([f"{folder}/{entry.name}", info.st_size, info.st_mtime_ns])
        except OSError:
            stats.append([folder, None, None])
    return sorted(stats, key=lambda s: str(s[0]))


def _model_folder(models: Path, model_type: str) -> str | None:
    """The folder of ``models/`` for a model type: its name with ``-`` as ``_``, else its longest ``_`` prefix that
    is one (``qwen2_5_vl_text`` is in ``qwen2_5_vl``, ``clip_vision_model`` in ``clip``); None if none is."""
    if len(model_type) > _MAX_NAME or "." in model_type or "/" in model_type or "\\" in model_type:
        return None
    parts = model_type.replace("-", "_").split("_")
    for end in range(len(parts), 0, -1):
        name = "_".join(parts[:end])
        if name and (models / name).is_dir():
            return name
    return None
