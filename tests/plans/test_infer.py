"""``reshard.plans.infer``: the partition of a name no rule covers, inferred from rank shapes and the config
sizes they add up to, and refused where it would be a guess."""

from __future__ import annotations

import pytest
from fixtures.shapes import llama_config

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Replicate, Shard, Vocab
from reshard.plans import infer_partition

CONFIG = ModelConfig(llama_config(num_key_value_heads=2))  # hidden 64, 8 heads of 8, 2 KV heads, vocab 1001


def infer(shapes, *, equal, target_tp=1, vocab=1001):
    return infer_partition(shapes, CONFIG, vocab_size=vocab, target_tp=target_tp, replicas_equal=lambda: equal)


def test_inference_rules():
    assert infer([(5, 32)] * 2, equal=False)[0] == Shard(1)  # 32 + 32 = hidden_size
    assert infer([(64, 5)] * 2, equal=False)[0] == Shard(0)  # rows add up to intermediate_size
    assert infer([(504, 3)] * 2, equal=False)[0] == Vocab(0)  # 1008 rows: the vocab padded
    assert infer([(64,)] * 2, equal=True)[0] == Replicate()
    assert infer([(1008, 64)], equal=True)[0] == Vocab(0)  # a full padded table
    assert infer([(7, 5)], equal=True)[0] == Replicate()  # tp 1 -> 1: kept whole
    partition, reason = infer([(66, 64), (62, 64)], equal=False)
    assert partition == Shard(0) and "uneven" in reason


@pytest.mark.parametrize(
    ("shapes", "equal", "target_tp", "message"),
    [
        ([(3, 5)] * 2, False, 1, "no dim of [3, 5] adds up to a config size"),
        ([(7, 5)], True, 2, "a full tensor of shape [7, 5] with no rule cannot be split"),
        ([(3, 5), (4, 6)], False, 1, "differ in more than one dim"),
        ([(64, 32)] * 2, False, 1, "config sizes along several dims"),
    ],
)
def test_inference_refuses_to_guess(shapes, equal, target_tp, message):
    with pytest.raises(AmbiguousPartitionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        infer(shapes, equal=equal, target_tp=target_tp)
