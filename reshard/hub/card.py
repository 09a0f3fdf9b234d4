"""The model card (``README.md``) pushed with an output: Hub metadata and a short account from the manifest.

Metadata: ``base_model`` (the source repo, when the source came from the Hub) with ``base_model_relation``,
``library_name`` (``transformers`` for the ``hf`` layout, which ``from_pretrained`` reads), ``tags`` (with
``reshard``), and the licence, language and task of the source's own card when it had one. The Hub knows four
relations (adapter, merge, quantized, finetune) and none says "the same weights, re-laid out"; reshard writes
``finetune``, the one the Hub infers for a repo of full safetensors weights anyway, and the body says what
changed: source, target layout and tp, vocab handling, the tensors whose shapes changed, and the command.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reshard.geometry import Vocab
from reshard.layouts import find_layout
from reshard.manifest import Manifest
from reshard.version import __version__

CARRIED = ("license", "license_name", "license_link", "language", "pipeline_tag")  # from the source's card
SHOWN = 12  # changed tensors listed by name


def model_card(
    manifest: Manifest,
    *,
    changed: Sequence[dict[str, Any]],
    command: str | None,
    title: str,
    source_card: Path | None = None,
) -> str:
    """The text of ``README.md`` for an output described by ``manifest``.

    Args:
        manifest: the output's ``reshard.json``.
        changed: the report's tensors whose shapes changed (``{"tensor", "old", "new"}``).
        command: the command line that produced the output, if known.
        title: the card's heading (the repo name).
        source_card: the source's ``README.md``, copied beside the output, whose licence and language carry over.

    Example:
        >>> text = model_card(manifest, changed=[], command="reshard fix acme/x -o y", title="y")  # doctest: +SKIP
    """
    from huggingface_hub import ModelCard, ModelCardData

    source, target = manifest.source, manifest.target
    carried: dict[str, Any] = {}
    if source_card is not None and source_card.is_file():
        old = ModelCard.load(source_card, ignore_metadata_errors=True).data.to_dict()
        carried = {key: old[key] for key in CARRIED if old.get(key)}
    repo = source.get("repo")
    data = ModelCardData(
        base_model=repo,
        base_model_relation="finetune" if repo else None,
        library_name=_library(target.get("layout")),
        tags=["reshard"] + (["tensor-parallel"] if int(target.get("tp") or 1) > 1 else []),
        **carried,
    )
    lines = [f"# {title}", "", _origin(source, __version__), ""]
    lines += ["| | source | this repo |", "|---|---|---|"]
    lines += [f"| layout | {source.get('layout')} | {target.get('layout')} |"]
    lines += [f"| tensor-parallel ranks | {source.get('tp')} | {target.get('tp')} |", ""]
    lines += [f"**Vocab.** {_vocab(manifest)}", ""]
    lines += [f"**Tensors changed.** {_changed(manifest, changed)}", ""]
    if command:
        lines += ["**Command.**", "", "```", command, "```", ""]
    lines += [
        f"`reshard.json` records every tensor's shape, partition and digest ({len(manifest.tensors)} tensors); "
        "`reshard verify` on this repo checks the files against it."
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n").content


def _library(layout: str | None) -> str | None:
    """The library the Hub shows as loading the output: its layout's (transformers for an ``hf`` folder)."""
    spec = find_layout(layout)
    return spec.library if spec is not None else None


def _origin(source: dict[str, Any], version: str) -> str:
    if source.get("repo"):
        inside = f", folder `{source['path_in_repo']}`" if source.get("path_in_repo") else ""
        what = f"[`{source['repo']}`](/{source['repo']}) at commit `{source['commit']}`{inside}"  # on this Hub
    else:
        what = f"a local checkpoint (`{Path(str(source.get('path'))).name}`)"
    return (
        f"The weights of {what}, re-laid out by reshard {version}. Every tensor is the source's, bit for bit, "
        "gathered and re-sliced; only vocab padding rows are cut or added."
    )


def _vocab(manifest: Manifest) -> str:
    vocab, tp = manifest.vocab, manifest.target.get("tp")
    if vocab.original is None:
        return "no vocab tensors."
    parts = [f"{vocab.original} tokens."]
    if vocab.source_padded is not None:
        padding = vocab.source_padded - vocab.original
        parts.append(f"The source held {vocab.source_padded} rows ({padding} of padding), cut to {vocab.original}.")
    if vocab.source_config is not None:
        parts.append(f"Its config.json said {vocab.source_config}; this one says {vocab.original}.")
    if vocab.padded is not None and vocab.padded != vocab.original:
        how = f"a multiple of {vocab.pad_multiple}" if vocab.pad_multiple else "uneven split"
        parts.append(f"Padded to {vocab.padded} rows ({how}) for tp={tp}; pad rows are not data.")
    return " ".join(parts)


def _changed(manifest: Manifest, changed: Sequence[dict[str, Any]]) -> str:
    """The vocab tensors by name with their shapes; the others (re-sliced, values unchanged) counted."""
    if not changed:
        return "none: every tensor keeps its shape."
    entries = manifest.tensors
    vocab = [c for c in changed if c["tensor"] in entries and isinstance(entries[c["tensor"]].partition, Vocab)]
    parts = [f"`{c['tensor']}` {_shapes(c['old'])} -> {_shapes(c['new'])}" for c in vocab[:SHOWN]]
    if len(vocab) > SHOWN:
        parts.append(f"{len(vocab) - SHOWN} more vocab tensors")
    others = len(changed) - len(vocab)
    if others:
        source, target = manifest.source.get("tp"), manifest.target.get("tp")
        parts.append(f"{others} other tensor(s) re-sliced from tp={source} to tp={target}, their values unchanged")
    return "; ".join(parts) + "."


def _shapes(shapes: Any) -> str:
    """``[1024, 64]``, or ``2 x [512, 64]`` for rank shapes."""
    if shapes and isinstance(shapes[0], list):
        if len(shapes) > 1 and all(s == shapes[0] for s in shapes):
            return f"{len(shapes)} x {shapes[0]}"
        return ", ".join(str(s) for s in shapes) if len(shapes) > 1 else str(shapes[0])
    return str(shapes)


__all__ = ["model_card"]
