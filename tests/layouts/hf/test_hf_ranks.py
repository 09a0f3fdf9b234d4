"""``reshard.layouts.hf.ranks``: reshard's own layout, one HF folder per rank (``rank_NN/``) and a ``reshard.json``."""

from __future__ import annotations

import torch
from fixtures import SAMPLES
from safetensors.torch import save_file

from reshard.layouts import discover
from reshard.options import ReadOptions


def test_hf_ranks_folders(tmp_path):
    for rank in range(2):
        (tmp_path / f"rank_{rank:02d}").mkdir()
        save_file({"w": torch.full((2, 3), float(rank + 1))}, tmp_path / f"rank_{rank:02d}" / "model.safetensors")
    source = discover(tmp_path, ReadOptions())
    assert (source.layout, source.tp) == ("hf-ranks", 2)
    assert [source.ranks[r]["w"].read()[0, 0].item() for r in range(2)] == [1.0, 2.0]


def test_the_sample_is_two_rank_folders() -> None:
    source = discover(SAMPLES / "tiny-llama-tp2")
    assert (source.layout, source.tp, len(source.files)) == ("hf-ranks", 2, 2)
    assert [str(f.relative_to(SAMPLES)) for f in sorted(source.files)] == [
        f"tiny-llama-tp2/rank_0{r}/model.safetensors" for r in range(2)
    ]
    assert source.ranks[1]["model.embed_tokens.weight"].shape == (501, 64)
