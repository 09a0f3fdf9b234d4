"""One Megatron-LM ``model_optim_rng.pt`` as a reader: its model chunk(s) by dotted name, the rest kept aside.

A module of its own so that both the layout's reader (which opens the files) and the stage merge (which numbers
their tensors globally) can name it without importing each other.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.errors import CorruptFileError
from reshard.formats.readers import DirectReader, TensorHeader, load_torch_file, offsets_in_file, torch_header
from reshard.layouts.megatron.args import SAFE_GLOBALS

if TYPE_CHECKING:
    import torch

CHUNK_KEY = re.compile(r"^model(\d+)$")


@dataclass
class MegatronFile(DirectReader):
    """One ``model_optim_rng.pt``: its model chunk(s) flattened to dotted names, the rest kept aside; tensors are
    read from their places in the file (:class:`~reshard.formats.readers.DirectReader`).

    ``_extra_state`` entries (Transformer Engine's per-rank FP8 metadata: BytesIO, None, or a byte
    tensor that may differ between ranks) are never resharded, only carried: they go to ``extras``
    with the other non-tensor entries. ``paths`` maps every flat name (tensor or not) to its key path
    in the nested dict, so the writer can rebuild the legacy ``language_model -> embedding -> ...``
    nesting exactly.
    """

    path: Path
    trust_pickle: bool = False
    headers: dict[str, TensorHeader] = field(init=False, default_factory=dict)
    extras: dict[str, Any] = field(init=False, default_factory=dict)
    top_level: dict[str, Any] = field(init=False, default_factory=dict)
    paths: dict[str, tuple[str, ...]] = field(init=False, default_factory=dict)
    chunks: int = field(init=False, default=1)
    chunk_of: dict[str, int] = field(init=False, default_factory=dict)
    notes: list[str] = field(init=False, default_factory=list)
    _tensors: dict[str, torch.Tensor] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        import torch

        obj = load_torch_file(self.path, trust_pickle=self.trust_pickle, notes=self.notes, allowed=SAFE_GLOBALS)
        if not isinstance(obj, Mapping):
            raise CorruptFileError(f"holds a {type(obj).__name__}, not a Megatron checkpoint dict", path=self.path)
        if isinstance(obj.get("model"), Mapping):
            keys = ["model"]
        else:
            keys = sorted((k for k in obj if CHUNK_KEY.match(str(k))), key=lambda k: int(k[5:]))
        if not keys:
            raise CorruptFileError("no 'model' state dict in this Megatron file", path=self.path)
        self.chunks = len(keys)
        self.top_level = {k: v for k, v in obj.items() if k not in keys}
        for chunk, key in enumerate(keys):
            chunk_prefix = f"{key}." if len(keys) > 1 else ""
            for path, value in _walk(obj[key]):
                name = chunk_prefix + ".".join(path)
                self.paths[name] = path
                self.chunk_of[name] = chunk
                if isinstance(value, torch.Tensor) and not name.endswith("_extra_state"):
                    self._tensors[name] = value
                    self.headers[name] = torch_header(value, path=self.path, key=name)
                else:
                    self.extras[name] = value
        self._offsets = offsets_in_file(self.path, self._tensors)

    def get(self, key: str) -> torch.Tensor:
        return self._tensors[key]


def _walk(state: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in state.items():
        if isinstance(value, Mapping):
            yield from _walk(value, (*prefix, str(key)))
        else:
            yield (*prefix, str(key)), value
