"""Hugging Face weight folders: ``hf`` (one folder or file), ``hf-ranks`` (reshard's ``rank_NN/`` folders) and loose
rank files (``*rank{r}*``), read and written as safetensors (``.bin`` and ``.pt`` read too)."""

from __future__ import annotations

from reshard.layouts.hf import folder, loose, ranks
from reshard.layouts.spec import LayoutSpec

HF = LayoutSpec(
    name=folder.NAME,
    looked_for="model.safetensors, pytorch_model.bin, *.safetensors",
    detect=folder.is_hf_folder,
    open=folder.discover,
    writer=folder.HFWriter,
    library="transformers",
    carries_tokenizer=True,
    naming="hf",
    missing_rank_files=loose.missing_rank_files,  # a single file whose name numbers rank 0
    check_files=folder.check_folder,
)
HF_RANKS = LayoutSpec(
    name=ranks.NAME,
    looked_for="rank_NN/ folders",
    detect=ranks.detect,
    open=ranks.discover,
    writer=ranks.HFRanksWriter,
    carries_tokenizer=True,  # at the top, beside config.json: one tokenizer for the model, not one per rank
    naming="hf",
    rank_folder=ranks.RANK_DIR,
    missing_rank_files=ranks.missing_rank_files,
    check_files=ranks.check_rank_folders,
)
LOOSE = LayoutSpec(
    name=loose.NAME,
    looked_for="*rank{r}* files",
    detect=loose.detect,
    open=loose.discover,
    rank_folder=loose.RANK_TOKEN,
    missing_rank_files=loose.missing_rank_files,
)

__all__ = ["HF", "HF_RANKS", "LOOSE"]
