"""Megatron-LM's ``torch`` checkpoint format: ``iter_XXXXXXX/mp_rank_XX[_PPP][_EEE]/model_optim_rng.pt``, read with
its pipeline stages and expert ranks merged, and written for any tp and pp."""

from __future__ import annotations

from reshard.layouts.megatron import reader, writer
from reshard.layouts.spec import LayoutSpec

MEGATRON = LayoutSpec(
    name=reader.NAME,
    looked_for="Megatron iter_*/mp_rank_*",
    detect=reader.detect,
    open=reader.discover,
    writer=writer.MegatronWriter,
    naming="megatron",
    kept=True,
    pipeline_stages=True,
    trackers=((reader.TRACKER, reader.tracked_folder),),
    rank_folder=reader.RANK_DIR,
)

__all__ = ["MEGATRON"]
