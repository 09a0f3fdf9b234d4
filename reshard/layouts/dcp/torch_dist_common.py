"""Megatron-Core's "common" state of a ``torch_dist`` checkpoint (``args``, ``iteration``, ``checkpoint_version``),
read from wherever the writer put it.

* ``common.pt`` beside the data files: a ``torch.save`` of the dict (Megatron-Core up to 0.18, NeMo 2, and
  reshard's own ``torch_dist`` writer, which every version reads);
* the ``common_state/shard_0_1`` entry of the data files (Megatron-Core 0.19 on, "deprecate common strategy"):
  a ``ShardedObject`` of global shape ``(1,)`` written by rank 0, stored as DCP's BYTE_IO, i.e. the
  ``torch.save`` archive of ``[dict]`` at the byte range ``.metadata`` gives. Megatron-Core reads it back with
  ``torch.load(weights_only=True)`` (``dist_checkpointing.serialization.load_common_state_dict``).

Megatron-Core reads ``common.pt`` when both exist, and so does reshard. Both forms are unpickled under the same
allow-list (``argparse.Namespace``, stand-ins for Megatron's enums: :mod:`reshard.layouts.megatron.args`); the
entry's byte range alone is read, after its length is checked against the file and a bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError, ReshardError
from reshard.formats.dcp_metadata.read import DcpIndex, StoredValue
from reshard.formats.readers import load_torch_file
from reshard.layouts.megatron.args import SAFE_GLOBALS
from reshard.options import ReadOptions
from reshard.sizes import human_bytes

COMMON = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key
MAX_COMMON_STATE = 64 << 20  # args and counters take kilobytes; more is not Megatron's common state


def read_common(folder: Path, index: DcpIndex, options: ReadOptions) -> tuple[dict[str, Any], list[str], Path]:
    """The common state dict, notes about where it came from, and the file to name in errors about it.

    Raises:
        UnsafePickleError: it pickles a type outside the allow-list and ``--trust-pickle`` is off.
        CorruptFileError: unreadable, not a dict (``[dict]`` in the data files), or an entry whose byte range
            lies outside its file or past :data:`MAX_COMMON_STATE`.
        ReshardError: the entry is stored compressed.
    """
    path = folder / COMMON
    notes: list[str] = []
    if path.is_file():
        common = load_torch_file(path, trust_pickle=options.trust_pickle, notes=notes, allowed=SAFE_GLOBALS)
        if not isinstance(common, dict):
            raise CorruptFileError(f"holds a {type(common).__name__}, not a dict", path=path)
        return common, notes, path
    stored = index.stored_values.get(COMMON_STATE)
    if stored is None:
        notes.append(f"no Megatron args: neither {COMMON} nor a {COMMON_STATE} entry in the data files")
        return {}, notes, path
    obj = read_object(stored, COMMON_STATE, options, notes)
    if not (isinstance(obj, list) and len(obj) == 1 and isinstance(obj[0], dict)):
        what = f"a list of {len(obj)}" if isinstance(obj, list) else f"a {type(obj).__name__}"
        raise CorruptFileError(f"holds {what}, not [dict]", path=stored.file, tensor=COMMON_STATE)
    notes.append(f"Megatron args, iteration and checkpoint version read from {COMMON_STATE} in {stored.file.name}")
    return obj[0], notes, stored.file


def read_object(stored: StoredValue, key: str, options: ReadOptions, notes: list[str]) -> Any:
    """A ``ShardedObject`` entry ``key`` of the data files, unpickled under the allow-list.

    Raises:
        UnsafePickleError: it pickles a type outside the allow-list and ``--trust-pickle`` is off.
        CorruptFileError: unreadable, or a byte range outside its file or past :data:`MAX_COMMON_STATE`.
        ReshardError: the entry is stored compressed.
    """
    data = _read(stored, key)
    try:
        return load_torch_file(
            stored.file, trust_pickle=options.trust_pickle, notes=notes, allowed=SAFE_GLOBALS, data=data
        )
    except ReshardError as err:  # named by the file alone: add the entry
        err.tensor = err.tensor or key
        raise


def _read(stored: StoredValue, key: str) -> bytes:
    """The entry's bytes: exactly its byte range, refused before reading when it cannot be right."""
    if stored.transforms:
        raise ReshardError(
            f"stored compressed ({', '.join(stored.transforms)}): not supported", path=stored.file, tensor=key
        )
    if stored.length > MAX_COMMON_STATE:
        raise CorruptFileError(
            f"{human_bytes(stored.length)} claimed, more than the {human_bytes(MAX_COMMON_STATE)} "
            "Megatron's common state can take",
            path=stored.file,
            tensor=key,
        )
    try:
        with stored.file.open("rb") as file:
            size = file.seek(0, 2)
            if stored.position + stored.length > size:
                raise CorruptFileError(
                    f"bytes {stored.position}-{stored.position + stored.length} claimed in a file of {size} bytes",
                    path=stored.file,
                    tensor=key,
                )
            file.seek(stored.position)
            return file.read(stored.length)
    except OSError as err:
        raise CorruptFileError(
            f"unreadable: {err.strerror or type(err).__name__}", path=stored.file, tensor=key
        ) from err
