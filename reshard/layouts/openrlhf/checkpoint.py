"""The ``openrlhf`` layout: an OpenRLHF checkpoint (``--ckpt.path`` with ``_actor/``), read as the ``deepspeed``
layout reads DeepSpeed ZeRO (the fp32 master weights), with the config and tokenizer of the tag's
``<tag>_hf/`` folder (``--ckpt.save_hf``) when it was saved; that folder's own weights, the module's bf16 copy, are
not read."""

from __future__ import annotations

from pathlib import Path

from reshard.config import find_config
from reshard.layouts.base import SourceCheckpoint
from reshard.layouts.deepspeed import checkpoint as deepspeed
from reshard.layouts.hf.folder import TENSOR_SUFFIXES, side_files
from reshard.layouts.openrlhf.folder import locate
from reshard.options import ReadOptions
from reshard.ranks import listed

NAME = "openrlhf"


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Open an OpenRLHF ``--ckpt.path``, ``_actor/`` or ``_critic/`` as its model.

    Raises:
        ReshardError: an entry OpenRLHF does not write, or what the DeepSpeed reader refuses.
    """
    found = locate(path)
    source = deepspeed.discover(found.model, options)
    source.path, source.layout = path, NAME
    notes = list(found.notes)
    if found.side is not None:
        source.config = find_config(found.side, options.config)
        source.side_files = side_files(found.side)
        held = sorted(p.name for p in found.side.iterdir())
        weights = [name for name in held if Path(name).suffix in TENSOR_SUFFIXES]
        taken = [name for name in held if name not in weights]
        notes.append(f"{found.side.name}/: config, tokenizer and generation config taken ({', '.join(taken)})")
        if weights:
            notes.append(
                f"{found.side.name}/ holds full weights too ({listed(weights[:3], len(weights))}): not read, the "
                "DeepSpeed checkpoint's fp32 master weights are"
            )
    else:
        notes.append("no <tag>_hf/ folder (--ckpt.save_hf): no config.json or tokenizer beside the weights")
    source.notes[:0] = notes
    return source
