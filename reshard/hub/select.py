"""Which files of a repo a command needs, from the repo's file list alone (pure: names in, names out).

Weights are chosen per folder by the rule the layouts read a folder with (``layouts/hf/folder.py``
``weight_names``): the files an index names, else ``model.safetensors`` / ``pytorch_model.bin``, else every file
of the first tensor suffix present, never optimizer state. The folders are the checkpoint's own and, below it,
the iteration a tracker names (Megatron, SAT), else those named for a rank. So a repo holding both
``*.safetensors`` and ``*.bin`` copies, ``consolidated.safetensors`` beside indexed shards, or an ``original/``
folder of ``.pth`` files is downloaded once, without the copies. Planning needs only small files (configs,
indexes, ``reshard.json``); a conversion also copies what sits beside the weights (tokenizer, generation config,
chat template, remote code, licence, card).
"""

from __future__ import annotations

import fnmatch
import json
import posixpath
import re
from collections.abc import Callable, Iterable, Sequence

from reshard.errors import HubError, shown
from reshard.layouts import TENSOR_SUFFIXES, rank_folder_patterns, tracker_files, weight_names

# What is copied beside the weights: configs, tokenizers, chat templates, remote code, licence, card.
SIDE_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py", "*.md", "LICENSE*", "NOTICE*")
CONFIG_LEVELS = 3  # config.json is looked for in the checkpoint folder and up to 3 above (config.find_config)


def literal(path: str) -> str:
    """``path`` as an fnmatch pattern matching only itself (``allow_patterns`` are fnmatch patterns)."""
    return re.sub(r"([\[\]*?])", r"[\1]", path)


def under(path: str, root: str) -> bool:
    return not root or path == root or path.startswith(root + "/")


def _folder(root: str) -> str:
    """The folder of a checkpoint named by a folder, by one of its weight files, or by its config."""
    return posixpath.dirname(root) if root.endswith((*TENSOR_SUFFIXES, ".json")) else root


def config_candidates(root: str) -> list[str]:
    """``config.json`` in the checkpoint's folder and up to :data:`CONFIG_LEVELS` folders above, inside the repo."""
    folder, found = _folder(root), []
    for _ in range(CONFIG_LEVELS + 1):
        found.append(posixpath.join(folder, "config.json") if folder else "config.json")
        if not folder:
            break
        folder = posixpath.dirname(folder)
    return found


def plan_patterns(root: str) -> list[str]:
    """``allow_patterns`` for what planning reads: configs, every index under the checkpoint, its manifest and
    Megatron tracker (fnmatch's ``*`` crosses ``/``: rank folders' indexes match too)."""
    folder = _folder(root)
    prefix = literal(folder + "/") if folder else ""
    small = [prefix + "*.index.json", prefix + "reshard.json", *(prefix + t for t in tracker_files())]
    return [*map(literal, config_candidates(root)), *small]


def side_patterns(root: str, files: Iterable[str]) -> list[str]:
    """``allow_patterns`` for the small files directly in the checkpoint's folder that a conversion copies
    beside its output (tokenizer, generation config, chat template, remote code, licence, card)."""
    folder = _folder(root)
    return [
        literal(f)
        for f in files
        if posixpath.dirname(f) == folder
        and not f.endswith(TENSOR_SUFFIXES)
        and any(fnmatch.fnmatchcase(posixpath.basename(f), p) for p in SIDE_PATTERNS)
    ]


def check_names(files: Iterable[str], *, where: str = "") -> None:
    """Refuse a repo listing with a name that is not a plain relative path (``rank_00/../../x``, ``/etc/x``,
    ``a\\b``): names from the Hub are untrusted, and huggingface_hub refuses to download them only later, with
    a ``ValueError``.

    Raises:
        HubError: naming the first such file.
    """
    for name in files:
        parts = name.split("/")
        if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
            raise HubError(
                f"the repo lists {shown(name, limit=200)}, a path outside the repo (or not a plain one): refused",
                path=where or None,
                hint="ask the repo's owner to rename it",
            )


def weight_files(files: Sequence[str], root: str, read_text: Callable[[str], str], *, where: str = "") -> list[str]:
    """The weight files under ``root`` (a folder, or one weight file) that reading the checkpoint takes.

    Folders read are ``root`` itself and, below it, the iteration a tracker names (Megatron, SAT), else folders
    named for a rank (``rank_00/``, ``tp_rank_1/``, ``mp_rank_00/``): ``original/`` or ``onnx/`` beside the
    weights are not the checkpoint. ``read_text(path)`` returns a small file already fetched; ``where`` names
    the repo in errors.

    Raises:
        HubError: a listed name that leaves the repo (``..``, absolute), an index that names a file the repo does
            not hold, or nothing at ``root``.
    """
    check_names(files, where=where)
    present = set(files)
    if root in present:
        return [root] if root.endswith(TENSOR_SUFFIXES) else []
    inside = [f for f in files if under(f, root)]
    if not inside:
        raise HubError(f"no file or folder {root!r} at this revision", path=where or None)
    trackers = [(folder_of, posixpath.join(root, t) if root else t) for t, folder_of in tracker_files().items()]
    iteration = next((folder_of(read_text(path)) for folder_of, path in trackers if path in present), None)
    rank_folder = rank_folder_patterns()
    folders: dict[str, list[str]] = {}
    for f in inside:
        folders.setdefault(posixpath.dirname(f), []).append(posixpath.basename(f))
    chosen: list[str] = []
    for folder, names in sorted(folders.items()):
        below = folder[len(root) :].strip("/").split("/") if folder != root else []
        if below and not (
            below[0] == iteration if iteration else any(r.search(p) for p in below for r in rank_folder)
        ):
            continue
        join = (lambda n, folder=folder: posixpath.join(folder, n)) if folder else (lambda n: n)
        chosen += [join(n) for n in weight_names(names, _index_reader(names, join, read_text, where))]
    return chosen


def _index_reader(
    names: list[str], join: Callable[[str], str], read_text: Callable[[str], str], where: str
) -> Callable[[str], list[str]]:
    """Reads the index of a folder holding ``names``: the files it names, every one of which the repo must hold.

    Raises (when called):
        HubError: the index names a file that is not in the folder.
    """

    def files(index: str) -> list[str]:
        named = _index_files(read_text(join(index)))
        missing = [n for n in named if n not in names]
        if missing:
            raise HubError(
                f"{join(index)} names {missing[0]}, which is not in the repo at this revision", path=where or None
            )
        return named

    return files


def _index_files(text: str) -> list[str]:
    try:
        weight_map = json.loads(text)["weight_map"]
        return list(dict.fromkeys(str(f) for f in weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return []  # a corrupt index is reported when the layout reads it


__all__ = ["config_candidates", "literal", "plan_patterns", "side_patterns", "weight_files"]
