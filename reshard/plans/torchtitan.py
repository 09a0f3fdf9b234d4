"""torchtitan's Llama 3 under its own names, split as its tensor-parallel plan splits it (``parallelize_llama``,
pytorch/torchtitan ``torchtitan/models/llama3/parallelize.py`` and ``sharding.py``).

* Vocab-parallel (dim 0): ``tok_embeddings`` (``RowwiseParallel`` on an embedding splits its rows) and the
  output layer (``output``, ``lm_head`` since 2026-04).
* Column-parallel (dim 0): ``wq``/``wk``/``wv`` (also under ``qkv_linear.``; in whole heads when the config says
  the head size), the fused ``qkv_linear.wqkv`` (``ColwiseParallel`` on it: contiguous rows, whole KV groups when
  the tp divides the KV heads, as torchtitan requires), ``w1`` and ``w3``.
* Row-parallel (dim 1): ``wo`` and ``w2``.
* Replicated (``SequenceParallel``): the norms, and the ``freqs_cis`` buffer of early versions.

torchtitan's names are its own, so a ``config.json`` beside them (the transformers model they map to) does not
select another plan for them (``Family.own_names``).
"""

from __future__ import annotations

from reshard.geometry import Replicate, Shard, Vocab
from reshard.plans.base import Plan, Rule
from reshard.plans.llama import by_heads

MODEL_TYPES = ("torchtitan",)
SIGNATURE = r"^layers\.\d+\.attention\.(qkv_linear\.)?(wq|wqkv)\.weight$"

TORCHTITAN_PLAN = Plan(
    "torchtitan",
    (
        Rule(r"^tok_embeddings\.weight$", Vocab(0)),
        Rule(r"^(output|lm_head)\.weight$", Vocab(0)),
        Rule(r"\.attention\.(qkv_linear\.)?w[qkv]\.weight$", by_heads(0)),
        Rule(r"\.attention\.qkv_linear\.wqkv\.weight$", Shard(0)),
        Rule(r"\.attention\.wo\.weight$", by_heads(1)),
        Rule(r"\.feed_forward\.w[13]\.weight$", Shard(0)),
        Rule(r"\.feed_forward\.w2\.weight$", Shard(1)),
        Rule(r"(^|\.)(attention_norm|ffn_norm|norm)\.weight$", Replicate()),
        Rule(r"^freqs_cis$", Replicate()),
    ),
)
