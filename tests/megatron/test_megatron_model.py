"""``reshard.megatron.model``: the model's shape read from Megatron's pickled ``args``."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from fixtures.megatron import TINY, megatron_args

from reshard.megatron.model import config_from_args

ARGS = megatron_args(replace(TINY, multiple=128), 8)  # hidden 32, 8 heads of 4 in 2 groups, ffn 48, vocab 50
CONFIG = config_from_args(ARGS, Path("model_optim_rng.pt"))


def test_config_from_args() -> None:
    assert CONFIG.model_type == "megatron" and CONFIG.vocab_size is None  # no true vocab in these args
    assert CONFIG.num_key_value_heads == 2 and CONFIG.head_dim == 4 and CONFIG.get("intermediate_size") == 48
    with_vocab = config_from_args(argparse.Namespace(**{**vars(ARGS), "vocab_size": 1000}), None)
    assert with_vocab.vocab_size == 1000
    assert config_from_args(megatron_args(TINY, 2, record_vocab=True), None).vocab_size == 50
    assert config_from_args(argparse.Namespace(hidden_size=32), None) is None  # no heads: not a model's args
