"""``reshard.vocab``: where the true vocab comes from, padded sizes, the pad cut, and the short-slice diagnosis."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.tp import arange

from reshard.config import ModelConfig
from reshard.errors import ShapeMismatchError
from reshard.geometry import cut_pad_rows, is_padded_vocab, padded_size
from reshard.manifest import Manifest, VocabRecord
from reshard.vocab import VocabPlan, explain, finish_vocab, resolve_vocab


def test_explain_the_colossalai_6108_shape():
    """Llama-3.1-70B at tp 8: one padded slice of 16064 rows saved as the whole embedding."""
    assert explain(16064, 1, 128256) == {8: [64]}
    assert explain(32768, 1, 65535) == {2: [1, 2, 4, 8, 16, 32, 64, 128]}
    assert explain(1000, 1, 65535) == {}


def test_the_true_vocab_comes_from_the_flag_then_the_manifest_then_the_config():
    config = ModelConfig({"model_type": "llama", "vocab_size": 65536}, Path("ckpt/config.json"))
    manifest = Manifest(source={}, target={}, vocab=VocabRecord(original=65535, padded=65536, pad_multiple=128))

    def told(*sources) -> tuple[int | None, str]:
        plan = resolve_vocab(*sources)
        return plan.original, plan.origin

    assert told(1000, manifest, config) == (1000, "--vocab")
    assert told(None, manifest, config) == (65535, "reshard.json")
    assert told(None, None, config) == (65536, "config.json")
    assert told(None, None, None) == (None, "unknown")


def test_padded_sizes():
    assert padded_size(65535, 2) == 65536 and padded_size(65535, 2, uneven=True) == 65535
    assert is_padded_vocab(65536, 65535, 2) and is_padded_vocab(65535, 65535, 1)
    assert not is_padded_vocab(65534, 65535, 2) and not is_padded_vocab(65535 + 2048, 65535, 2)
    assert not is_padded_vocab(65536, None, 2)


@pytest.mark.parametrize("dim", [0, 1])
def test_cut_pad_rows_keeps_the_first_rows(dim: int):
    table = arange((7, 3) if dim == 0 else (3, 7))
    assert torch.equal(cut_pad_rows(table, dim, 5), table.narrow(dim, 0, 5))
    with pytest.raises(ShapeMismatchError, match=f"cannot unpad dim {dim} of size 7 up to 8"):
        cut_pad_rows(table, dim, 8)


def test_the_vocab_is_finished_in_one_place():
    """``finish_vocab``: a size a mapping knows fills only an unknown one; the target pads the true size (not the
    source's rows) to the multiple, or not at all uneven; rows tp does not divide are a problem, not a plan."""
    unknown = VocabPlan(None, "unknown")
    mapped = (1000, "torchtitan")
    done, problem = finish_vocab(unknown, known=mapped, source_padded=1008, multiple=8, tp=8, uneven=False)
    assert (done.original, done.origin, done.source_padded, done.target_padded, done.pad_multiple) == (
        1000,
        "torchtitan",
        1008,
        1000,
        8,
    )
    assert problem is None
    said = VocabPlan(999, "--vocab")
    done, _ = finish_vocab(said, known=(1000, "torchtitan"), source_padded=1008, multiple=4, tp=4, uneven=False)
    assert (done.original, done.origin, done.target_padded) == (999, "--vocab", 1000)
    done, _ = finish_vocab(said, known=None, source_padded=1008, multiple=4, tp=4, uneven=True)
    assert (done.target_padded, done.pad_multiple) == (999, None)
    _, problem = finish_vocab(said, known=None, source_padded=1008, multiple=3, tp=2, uneven=False)
    assert problem is not None and "vocab padded to 999 does not divide by tp=2" in problem.detail
    done, problem = finish_vocab(said, known=None, source_padded=None, multiple=4, tp=4, uneven=False)
    assert (done.target_padded, done.pad_multiple, problem) == (None, None, None)
