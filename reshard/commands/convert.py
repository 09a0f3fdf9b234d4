"""``convert``: any layout and tp in, any layout and tp out (the run itself is
:mod:`reshard.engine.run.conversion`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.engine.plan.planner import ConversionPlan
from reshard.engine.plan.target import TargetPlan
from reshard.engine.plan.tokenizer import no_tokenizer_warning
from reshard.engine.run.conversion import open_for_conversion, run_conversion
from reshard.engine.run.route import Route
from reshard.options import ConvertOptions

logger = logging.getLogger(__name__)


@dataclass
class ConvertReport(Route):
    """What a conversion did: where from, where to, the vocab handling, and what changed shape."""

    tensors: int = 0
    bytes: int = 0
    vocab: dict[str, Any] = field(default_factory=dict)
    manifest: str = ""
    files: list[str] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    mapping: dict[str, Any] | None = None
    already_complete: bool = False


def convert(ckpt: Path, out: Path, options: ConvertOptions) -> ConvertReport:
    """Re-slice ``ckpt`` for ``options.tp`` ranks into ``out`` in ``options.layout``.

    The output is written under a temporary name beside ``out`` and renamed into place when
    complete; ``reshard.json`` records the original vocab size, every tensor's partition and the
    digest (BLAKE3) of every canonical tensor.

    Raises:
        ReshardError: any problem with the input or the output path, before or during writing
            (nothing is left at ``out`` then).

    Example:
        >>> convert(Path("ckpt"), Path("ckpt-tp4"), ConvertOptions(tp=4))  # doctest: +SKIP
    """
    ckpt, out = Path(ckpt), Path(out)
    run = run_conversion(open_for_conversion(ckpt, out, options), out, options)
    if int(os.environ.get("RANK", "0") or 0) == 0 and not run.already_complete:  # rank 0 reports, under torchrun
        no_tokenizer_warning(out, run.target.layout, run.files)
    conversion = run.target.conversion
    return ConvertReport(
        **run.route.to_dict(),
        tensors=sum(len(plan.targets) for plan in conversion.tensors),
        bytes=sum(t.nbytes for t in conversion.tensors),
        vocab=run.vocab,
        manifest=str(run.manifest),
        files=list(run.files),
        changed=_changed_shapes(conversion),
        notes=list(run.notes),
        mapping=_mapping_summary(run.target),
        already_complete=run.already_complete,
    )


def _mapping_summary(target: TargetPlan) -> dict[str, Any] | None:
    """The report's view of a mapping: the namings, and how many tensors went in and came out."""
    if target.mapping is None:
        return None
    plans = target.conversion.tensors
    return {
        "from": target.mapping.mapping.source_family,
        "to": target.mapping.mapping.target_family,
        "sources": sum(len(p.sources) for p in plans),
        "targets": sum(len(p.targets) for p in plans),
        "dropped": len(target.dropped),
    }


def _changed_shapes(conversion: ConversionPlan) -> list[dict[str, Any]]:
    """Tensors kept under their name whose shape on disk changed, comparing source rank 0 with target rank 0."""
    changed = []
    for plan in sorted(conversion.tensors, key=lambda t: t.name):
        if plan.transform is not None:
            continue
        before, after = plan.sources[0].refs[0].shape, plan.targets[0].rank_shapes[0]
        if before != after:
            changed.append({"tensor": plan.name, "old": list(before), "new": list(after)})
    return changed
