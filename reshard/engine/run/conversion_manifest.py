"""The ``reshard.json`` a conversion writes: the source, the target, the vocab and every tensor's facts."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from reshard.dtypes import name_of
from reshard.engine.plan.target import TargetPlan
from reshard.geometry import at_tp
from reshard.hub.source import source_record
from reshard.manifest import Manifest, TensorEntry, VocabRecord


def conversion_manifest(
    ckpt: Path,
    target: TargetPlan,
    *,
    tp: int,
    hashes: Mapping[str, str],
    finite: Mapping[str, bool | None],
    divergent: AbstractSet[str],
    resumable: dict[str, Any] | None = None,
) -> Manifest:
    """The manifest of ``target`` converted from ``ckpt``, every target tensor with its digest, whether it is finite
    and whether its source replicas differed; partitions are recorded at ``tp``, the tp asked for; ``resumable``:
    what a later ``--resume`` checks the output against (the manifest's ``conversion``)."""
    conversion = target.conversion
    source, vocab = conversion.source, conversion.vocab
    targets = sorted((t for plan in conversion.tensors for t in plan.targets), key=lambda t: t.name)
    return Manifest(
        source={**source_record(ckpt), "layout": source.layout, "tp": source.tp},
        target={"layout": target.layout.name, "tp": conversion.target_tp},
        vocab=VocabRecord(
            vocab.original,
            vocab.target_padded,
            vocab.pad_multiple,
            source_padded=_if_differs(vocab.source_padded, vocab.original),
            source_config=_if_differs(source.config.vocab_size if source.config else None, vocab.original),
        ),
        tensors={
            t.name: TensorEntry(
                t.shape,
                name_of(t.code),
                at_tp(t.partition, t.shape, tp),
                hashes[t.name],
                finite[t.name],
                divergent=t.name in divergent,
            )
            for t in targets
        },
        mapping=_mapping_record(target),
        conversion=resumable,
    )


def _if_differs(size: int | None, original: int | None) -> int | None:
    """A source vocab size worth recording: one that is not the true size."""
    return size if size != original else None


def _mapping_record(target: TargetPlan) -> dict[str, Any] | None:
    """What the manifest says of a mapping: the namings, every source name's target names, what was dropped."""
    if target.mapping is None:
        return None
    mapped = {
        source.name: [t.name for t in plan.targets] for plan in target.conversion.tensors for source in plan.sources
    }
    return {
        "from": target.mapping.mapping.source_family,
        "to": target.mapping.mapping.target_family,
        "tensors": dict(sorted(mapped.items())),
        "dropped": sorted(target.dropped),
    }
