"""``reshard.json``: the manifest written beside every output (DESIGN.md section 4).

Shapes and digests (BLAKE3; sha256 in manifests older than it) are of the canonical (full, unpadded) tensors,
so any two layouts of one model can be compared by their manifests, and a later command can recover the original
vocab size.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError
from reshard.geometry import Partition, partition_from_dict, partition_to_dict
from reshard.schema import DIGESTS, check_manifest_data
from reshard.version import __version__

MANIFEST_NAME = "reshard.json"
FORMAT = "reshard/1"
VOCAB_FIELDS = ("original", "padded", "pad_multiple", "source_padded", "source_config")


@dataclass(frozen=True)
class TensorEntry:
    """One canonical tensor: shape, dtype name, how it is split at the target, and the digest of its bytes.

    ``digest`` is ``"<algorithm>:<hex>"`` (:mod:`reshard.engine.move.digest`); ``reshard.json`` spells it as a field
    named after the algorithm (``"blake3": "<hex>"``, or ``"sha256"`` in manifests older than BLAKE3).

    ``finite`` says whether every value was finite (no NaN/Inf) when it was written, so ``verify`` can
    tell a NaN that appeared later from one that was always there; None in manifests older than it.
    ``divergent`` marks a replicated tensor whose ranks differed, of which rank 0's copy was taken
    (``--allow-divergent-replicas``).
    """

    shape: tuple[int, ...]
    dtype: str
    partition: Partition
    digest: str
    finite: bool | None = None
    divergent: bool = False

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "partition": partition_to_dict(self.partition),
        }
        algorithm, _, hexdigest = self.digest.partition(":")
        data[algorithm] = hexdigest
        if self.finite is not None:
            data["finite"] = self.finite
        if self.divergent:
            data["divergent"] = True
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorEntry:
        finite = data.get("finite")
        (algorithm,) = (key for key in DIGESTS if key in data)
        return cls(
            tuple(data["shape"]),
            data["dtype"],
            partition_from_dict(data["partition"]),
            f"{algorithm}:{data[algorithm]}",
            None if finite is None else bool(finite),
            bool(data.get("divergent", False)),
        )


@dataclass(frozen=True)
class VocabRecord:
    """The true vocab size, the padded size at the target tp, and the multiple it was padded to.

    ``source_padded`` (rows of the vocab tensors in the source) and ``source_config`` (``vocab_size`` in the
    source's config.json) record what the input said when it differs from ``original`` (a padded size
    repaired by ``fix``); they are None, and left out of ``reshard.json``, otherwise.
    """

    original: int | None
    padded: int | None
    pad_multiple: int | None
    source_padded: int | None = None
    source_config: int | None = None


@dataclass
class Manifest:
    """The whole ``reshard.json``."""

    source: dict[str, Any]
    target: dict[str, Any]
    vocab: VocabRecord
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    mapping: dict[str, Any] | None = None
    conversion: dict[str, Any] | None = None
    reshard_version: str = ""
    created: str = ""
    format: str = FORMAT

    def to_dict(self) -> dict[str, Any]:
        return (
            {
                "format": self.format,
                "reshard_version": self.reshard_version,
                "created": self.created,
                "source": self.source,
                "target": self.target,
                "vocab": {k: v for k, v in asdict(self.vocab).items() if k in VOCAB_FIELDS[:3] or v is not None},
                "tensors": {name: entry.to_dict() for name, entry in self.tensors.items()},
            }
            | ({"mapping": self.mapping} if self.mapping is not None else {})
            | ({"conversion": self.conversion} if self.conversion is not None else {})
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        return cls(
            source=dict(data.get("source", {})),
            target=dict(data.get("target", {})),
            vocab=VocabRecord(**{k: data.get("vocab", {}).get(k) for k in VOCAB_FIELDS}),
            tensors={name: TensorEntry.from_dict(entry) for name, entry in data.get("tensors", {}).items()},
            mapping=data.get("mapping"),
            conversion=data.get("conversion"),
            reshard_version=data.get("reshard_version", ""),
            created=data.get("created", ""),
            format=data.get("format", FORMAT),
        )


def written_uneven(manifest: Manifest | None) -> bool:
    """Whether reshard wrote the checkpoint with ``--uneven`` (its manifest has a vocab but no pad multiple).

    Such a checkpoint is read back with the same ``torch.chunk`` convention without being told.
    """
    return manifest is not None and manifest.vocab.padded is not None and manifest.vocab.pad_multiple is None


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """Write ``reshard.json`` into ``folder``, stamping the version and time."""
    manifest.reshard_version = __version__
    manifest.created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    path = folder / MANIFEST_NAME
    path.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    return path


def read_manifest(path: Path) -> Manifest:
    """Read a manifest file.

    Raises:
        CorruptFileError: not JSON, or not a ``reshard/1`` manifest.
    """
    try:
        data = json.loads(path.read_text())
        check_manifest_data(data, path)
        if data.get("format") != FORMAT:
            raise ValueError(f"format is {data.get('format')!r}, expected {FORMAT!r}")
        return Manifest.from_dict(data)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise CorruptFileError(f"not a reshard manifest: {str(err) or type(err).__name__}", path=path) from err


def find_manifest(ckpt: Path) -> Manifest | None:
    """The manifest beside a checkpoint (in the folder, or beside a single file), if there is one."""
    folder = ckpt if ckpt.is_dir() else ckpt.parent
    path = folder / MANIFEST_NAME
    return read_manifest(path) if path.is_file() else None
