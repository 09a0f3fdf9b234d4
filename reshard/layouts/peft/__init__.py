"""PEFT adapter folders: ``adapter_config.json`` and ``adapter_model.safetensors`` holding only a LoRA adapter's
A and B, under the names PEFT's ``get_peft_model_state_dict`` saves, which ``PeftModel.from_pretrained`` loads.

Written only: a conversion into it is opened with the source's chosen adapter alone (``lora_adapter``:
:func:`reshard.engine.plan.lora_adapter.adapter_source`), gathered whole (PEFT gathers at save, so adapter files
are whole whatever the tp that trained them). An adapter folder is read as an ``hf`` file.
"""

from __future__ import annotations

from pathlib import Path

from reshard.errors import ReshardError
from reshard.layouts.base import SourceCheckpoint
from reshard.layouts.peft.writer import NAME, PeftWriter
from reshard.layouts.spec import LayoutSpec
from reshard.options import ReadOptions


def _never(folder: Path) -> bool:
    return False


def _written_only(path: Path, options: ReadOptions) -> SourceCheckpoint:
    raise ReshardError("the peft layout is written, not read", path=path, hint="read an adapter folder as hf")


PEFT = LayoutSpec(
    name=NAME,
    looked_for="(written only)",
    detect=_never,
    open=_written_only,
    writer=PeftWriter,
    library="peft",
    global_tensors=True,
    loaded_at_any_size="PEFT loads the adapter onto its base model at any tp (asked: tp={tp})",
    lora_adapter=True,
)

__all__ = ["PEFT"]
