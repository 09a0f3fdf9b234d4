"""The writer of a PEFT adapter folder: one ``adapter_model.safetensors`` (PEFT loads no shards) and its
``adapter_config.json``, from the :class:`~reshard.formats.adapter_config.AdapterFacts` the source carries."""

from __future__ import annotations

from pathlib import Path

from reshard.errors import ReshardError
from reshard.formats.adapter_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from reshard.formats.safetensors.writer import ShardPlan, ordered
from reshard.layouts.base import TargetSpec
from reshard.layouts.hf.folder import HFWriter, SafetensorsFilePlan

NAME = "peft"


class PeftWriter(HFWriter):
    """Writes ``adapter_model.safetensors`` (byte parts welcome, as :class:`HFWriter`) and ``adapter_config.json``."""

    @classmethod
    def file_plan(cls, spec: TargetSpec) -> SafetensorsFilePlan:
        """One file of the whole adapter (planned at tp 1: the layout holds global tensors)."""
        if spec.source.adapter is None:
            raise ReshardError(
                "the peft layout holds a LoRA adapter, and this checkpoint has none", path=spec.source.path
            )
        (headers,) = spec.rank_headers
        shards = ShardPlan({ADAPTER_WEIGHTS: tuple(ordered(headers))})
        return SafetensorsFilePlan({ADAPTER_WEIGHTS: frozenset(headers)}, (("", shards),))

    def close(self) -> list[Path]:
        (writer,) = self.rank_writers
        writer.close(index=False)
        written = [Path(ADAPTER_WEIGHTS)]
        adapter = self.spec.source.adapter
        if adapter is not None and self.run.writes_shared:
            (self.out_dir / ADAPTER_CONFIG).write_text(adapter.config_json())
            written.append(Path(ADAPTER_CONFIG))
        return written
