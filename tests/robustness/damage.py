"""Ways to damage a copy of a good checkpoint, one thing at a time (used by the corpus and the unseen fuzzer)."""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class Payload:
    """Unpickling this calls ``call(*args)``: what a hostile checkpoint does (here: create the marker file)."""

    def __init__(self, call: Callable[..., Any], *args: Any) -> None:
        self.call, self.args = call, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.call, self.args


def payload(marker: Path, kind: str = "system") -> Payload:
    if kind == "system":
        return Payload(os.system, f"touch {marker}")
    if kind == "exec":
        return Payload(exec, f"open({str(marker)!r}, 'w').close()")
    return Payload(open, str(marker), "w")


# ---------------------------------------------------------------- safetensors


def split_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def rewrite_header(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """Replace the header by ``change(header)`` (a dict, or the header bytes as they should be); data kept."""
    header, data = split_safetensors(path)
    new = change(header)
    text = new if isinstance(new, bytes) else json.dumps(header if new is None else new).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def tensors_of(header: dict[str, Any]) -> list[str]:
    """Tensor names in the order of their bytes."""
    names = [k for k in header if k != "__metadata__"]
    return sorted(names, key=lambda k: header[k]["data_offsets"])


def truncate(path: Path, keep: int | float) -> None:
    """Keep the first ``keep`` bytes (a fraction of the file when a float)."""
    size = path.stat().st_size
    os.truncate(path, int(size * keep) if isinstance(keep, float) else keep)


def deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def edit_json(path: Path, change: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text())
    new = change(data)
    path.write_text(json.dumps(data if new is None else new))


# ---------------------------------------------------------------- torch files


def torch_edit(path: Path, change: Callable[[Any], Any], *, megatron: bool = False, **save: Any) -> None:
    """Load a (trusted, test-made) torch file fully, let ``change`` edit it, save it back with torch.save.

    ``megatron``: its args pickle Megatron's enums, read through reshard's stand-ins and written back as the
    same globals (Megatron is kept out of the tests' process).
    """
    if megatron:
        from reshard.formats.readers import load_torch_file
        from reshard.layouts.megatron.args import PICKLE_MODULE, SAFE_GLOBALS

        obj = load_torch_file(path, trust_pickle=True, notes=[], allowed=SAFE_GLOBALS)
        save = {"pickle_module": PICKLE_MODULE, **save}
    else:
        obj = torch.load(path, weights_only=False)
    new = change(obj)
    fresh = path.with_name(path.name + ".new")  # never rewrite a file its own tensors may map
    torch.save(obj if new is None else new, fresh, **save)
    os.replace(fresh, path)


def rezip(path: Path, *, pickled: Callable[[bytes], bytes] | None = None, compress: bool = False) -> None:
    """Rewrite a torch zip archive record by record (Python's zipfile), changing ``data.pkl`` or compressing."""
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in records:
            if name.endswith("data.pkl") and pickled is not None:
                data = pickled(data)
            method = zipfile.ZIP_DEFLATED if compress and "/data/" in name else zipfile.ZIP_STORED
            archive.writestr(name, data, compress_type=method)
    path.write_bytes(out.getvalue())


def patch_first_numel(data: bytes, change: Callable[[int], int]) -> bytes:
    """``data.pkl`` with the element count of its first storage (``('storage', type, key, 'cpu', numel)``) changed."""
    ops = list(pickletools.genops(data))
    for index, (op, arg, _) in enumerate(ops):
        if op.name in ("BINUNICODE", "SHORT_BINUNICODE") and arg == "cpu":
            at = index + 1
            while ops[at][0].name in ("BINPUT", "LONG_BINPUT", "MEMOIZE"):
                at += 1
            _, numel, start = ops[at]
            stop = ops[at + 1][2]
            return data[:start] + b"J" + struct.pack("<i", change(numel)) + data[stop:]
    raise ValueError("no storage in this pickle")


def zip_with_pickle(root: str, pickled: bytes, records: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr(f"{root}/data.pkl", pickled)
        archive.writestr(f"{root}/byteorder", "little")
        for name, data in records.items():
            archive.writestr(f"{root}/data/{name}", data)
    return out.getvalue()


# ---------------------------------------------------------------- DCP metadata


class _TorchClasses(pickle.Unpickler):
    """Megatron-Core's ``MCoreMetadata`` read as DCP's ``Metadata`` (Megatron is kept out of the tests' process)."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("megatron.") and name == "MCoreMetadata":
            from torch.distributed.checkpoint.metadata import Metadata

            return Metadata
        return super().find_class(module, name)


def rewrite_metadata(folder: Path, change: Callable[[Any], Any]) -> None:
    """Load ``.metadata`` with torch's own classes, let ``change`` damage it, and pickle it back."""
    import torch.distributed.checkpoint  # noqa: F401  (the pickled classes)

    path = folder / ".metadata"
    metadata = _TorchClasses(io.BytesIO(path.read_bytes())).load()
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def storage_of(metadata: Any, fqn: str) -> tuple[Any, Any]:
    """``(key, info)`` of the (single) storage entry of ``fqn``."""
    return next((k, v) for k, v in metadata.storage_data.items() if k.fqn == fqn)


def move_chunk(metadata: Any, fqn: str, offsets: tuple[int, ...]) -> None:
    """Move the first chunk of ``fqn`` to ``offsets``, its storage key with it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    key, info = storage_of(metadata, fqn)
    del metadata.storage_data[key]
    metadata.state_dict_metadata[fqn].chunks[0].offsets = torch.Size(offsets)
    metadata.storage_data[MetadataIndex(fqn, torch.Size(offsets), key.index)] = info
