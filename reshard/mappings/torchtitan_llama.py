"""torchtitan's Llama 3 <-> transformers' Llama, as torchtitan's own ``Llama3StateDictAdapter`` maps it
(pytorch/torchtitan ``torchtitan/models/llama3/state_dict_adapter.py``, b5bcd76c 2026-08-21, and its history).

What the table does (and why each row is not a plain rename):

* ``wq`` and ``wk`` are laid out for Meta's RoPE (consecutive pairs of a head rotate together); transformers'
  ``rotate_half`` pairs row ``i`` with row ``i + head_dim / 2``. On the way to transformers each head's rows are
  permuted (:class:`~reshard.mappings.transforms.RopePermute` over ``n_heads`` for ``wq``, ``n_kv_heads`` for
  ``wk``: torchtitan's ``_permute``), and undone on the way back (``_reverse_permute``). ``wv`` is not rotated.
  Without the permutation the model loads and writes garbage (torchtitan#1291, #1903).
* The names changed between torchtitan versions; all are read, the newest is written on the way back:

  ====================================================  ==========================  =========================
  torchtitan                                            since                       transformers
  ====================================================  ==========================  =========================
  ``layers.{L}.attention.wq/wk/wv.weight``              first releases (v0.1, v0.2) ``self_attn.q/k/v_proj``
  ``layers.{L}.attention.qkv_linear.wqkv.weight``       ad7a8653 (2026-04-16)       split per KV group, then
                                                                                    q and k permuted
  ``layers.{L}.attention.qkv_linear.wq/wk/wv.weight``   70dd9455 (2026-06-19, HEAD) ``self_attn.q/k/v_proj``
  ``output.weight``                                     until 786e26f8 (2026-04-27) ``lm_head.weight``
  ``lm_head.weight``                                    786e26f8 (HEAD)             ``lm_head.weight``
  ====================================================  ==========================  =========================

  The fused ``wqkv`` holds, per KV group, its query heads, its key head, its value head (``[n_kv_heads,
  n_heads / n_kv_heads + 2, head_dim]`` rows): Megatron's grouped layout, split with the same transform.
* ``feed_forward.w1`` is the gate, ``w3`` the up projection, ``w2`` the down projection; ``attention_norm`` and
  ``ffn_norm`` are the input and post-attention norms; ``tok_embeddings`` and ``norm`` are renamed.
* Dropped on purpose: ``freqs_cis``, the RoPE table torchtitan saved as a persistent buffer until 9874e84d
  (2025-08-19); with tied embeddings (the 1B and 3B flavors) the output layer, which torchtitan saves as a second
  name of the embedding (its ``to_hf`` drops it too).

The head counts are not in a torchtitan checkpoint: the table is built for given counts
(:mod:`reshard.mappings.torchtitan_config` decides them, or refuses).
"""

from __future__ import annotations

from reshard.mappings.base import Entry, Mapping, rename
from reshard.mappings.transforms import Chain, Parallel, Rename, RopePermute, SplitGroupedQKV

TORCHTITAN = "torchtitan"
# Some tensor of every torchtitan Llama 3 checkpoint (names at the top level of its DCP state dict).
SIGNATURE = r"^layers\.\d+\.attention\.(qkv_linear\.)?(wq|wqkv)\.weight$"

_L = "layers.{L}."
_HF = "model.layers.{L}."


def torchtitan_to_hf(n_heads: int, n_kv_heads: int, head_dim: int, *, tied: bool = False) -> Mapping:
    """The torchtitan Llama 3 -> transformers ``llama`` table for a model with these head counts.

    ``inverse()`` maps transformers' names to torchtitan's current ones (``qkv_linear.wq``, ``lm_head``).
    """
    q, k = RopePermute(n_heads), RopePermute(n_kv_heads)
    hf_qkv = tuple(f"{_HF}self_attn.{p}_proj.weight" for p in "qkv")
    fused = Chain((SplitGroupedQKV(n_kv_heads, n_heads // n_kv_heads, head_dim), Parallel((q, k, Rename()))))
    attention = []
    for prefix, alternative in ((_L + "attention.qkv_linear.", False), (_L + "attention.", True)):
        attention += [
            Entry((f"{prefix}wq.weight",), hf_qkv[:1], q, alternative),
            Entry((f"{prefix}wk.weight",), hf_qkv[1:2], k, alternative),
            rename(f"{prefix}wv.weight", hf_qkv[2], alternative=alternative),
        ]
    head = (
        ()
        if tied
        else (rename("lm_head.weight", "lm_head.weight"), rename("output.weight", "lm_head.weight", alternative=True))
    )
    return Mapping(
        TORCHTITAN,
        "llama",
        (
            rename("tok_embeddings.weight", "model.embed_tokens.weight"),
            *attention,
            Entry((_L + "attention.qkv_linear.wqkv.weight",), hf_qkv, fused, alternative=True),
            rename(_L + "attention.wo.weight", _HF + "self_attn.o_proj.weight"),
            rename(_L + "feed_forward.w1.weight", _HF + "mlp.gate_proj.weight"),
            rename(_L + "feed_forward.w3.weight", _HF + "mlp.up_proj.weight"),
            rename(_L + "feed_forward.w2.weight", _HF + "mlp.down_proj.weight"),
            rename(_L + "attention_norm.weight", _HF + "input_layernorm.weight"),
            rename(_L + "ffn_norm.weight", _HF + "post_attention_layernorm.weight"),
            rename("norm.weight", "model.norm.weight"),
            *head,
        ),
        dropped=(r"^freqs_cis$", *((r"^(lm_head|output)\.weight$",) if tied else ())),
        dropped_in_target=(r"rotary_emb\.inv_freq$",),
    )
