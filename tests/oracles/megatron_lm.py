"""What Megatron-LM's ``megatron/training/checkpointing.py`` adds around a model (``megatron.training`` is not in the
megatron-core wheel, so the oracle writes it the same way; read at NVIDIA/Megatron-LM d98e8a64dd).

- ``get_checkpoint_name``: ``<root>/iter_{:07d}/mp_rank_{tp:02d}/model_optim_rng.pt``, with ``_{pp:03d}`` added
  when pipeline-parallel (and ``_{ep:03d}`` for expert-parallel, not used here).
- ``generate_state_dict``: ``{'args': Namespace, 'checkpoint_version': 3.0, 'iteration', 'model' (or
  'model0', 'model1', ... with virtual pipeline), 'rng_state', 'num_floating_point_operations_so_far'}``;
  ``model`` is ``state_dict_for_save_checkpoint()`` for ``torch`` and ``sharded_state_dict()`` for ``torch_dist``.
- ``get_rng_state``: a one-element list (one data-parallel rank) of ``{'random_rng_state', 'np_rng_state',
  'torch_rng_state', 'cuda_rng_state', 'rng_tracker_states'}``; ``np_rng_state`` holds a numpy array. For
  ``torch_dist`` it is wrapped in ``ShardedObject('rng_state', ..., (pp, tp), (pp_rank, tp_rank))``.
- ``latest_checkpointed_iteration.txt`` holds the iteration, written by rank 0 after a barrier.
- ``_build_sharded_state_dict_metadata``: ``singleton_local_shards=False``, ``chained_optim_avoid_prefix=True``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import torch
from variants import ITERATION, SEED, SEQ, Spec, Variant

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


def iter_dir(root: Path, iteration: int = ITERATION) -> Path:
    return root / f"iter_{iteration:07d}"


def rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    """``get_checkpoint_name``'s directory for one rank (no expert parallelism)."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def rank_file(root: Path, tp_rank: int, pp_rank: int, pp: int, iteration: int = ITERATION) -> Path:
    """``get_checkpoint_name`` for one rank."""
    return iter_dir(root, iteration) / rank_dir(tp_rank, pp_rank, pp) / "model_optim_rng.pt"


def write_tracker(root: Path, iteration: int = ITERATION) -> None:
    (root / TRACKER).write_text(str(iteration))


def resolve_iteration_dir(path: Path) -> Path:
    """A checkpoint root (with the tracker) or an ``iter_*`` directory -> the ``iter_*`` directory."""
    tracker = path / TRACKER
    if tracker.exists():
        text = tracker.read_text().strip()
        return path / ("release" if text == "release" else f"iter_{int(text):07d}")
    return path


def megatron_args(variant: Variant, spec: Spec, *, ckpt_format: str) -> argparse.Namespace:
    """The model-defining part of Megatron-LM's ``args`` for this run, under Megatron-LM's own names.

    ``attention_backend`` is the real ``AttnBackend`` enum, as in real files: unpickling ``args`` needs megatron
    importable (or a stub unpickler).
    """
    from megatron.core.transformer.enums import AttnBackend

    moe, tp, pp = variant.experts > 0, spec.tp, spec.pp
    vpp = spec.vpp if spec.vpp > 1 else None
    return argparse.Namespace(
        num_layers=variant.layers,
        hidden_size=variant.hidden,
        ffn_hidden_size=variant.ffn,
        num_attention_heads=variant.heads,
        group_query_attention=variant.groups != variant.heads,
        num_query_groups=variant.groups,
        kv_channels=variant.head_dim,
        seq_length=SEQ,
        max_position_embeddings=variant.max_seq,
        position_embedding_type=variant.pos,
        add_position_embedding=variant.pos == "learned_absolute",
        use_rotary_position_embeddings=variant.pos == "rope",
        rotary_base=variant.rotary_base,
        rotary_percent=variant.rotary_percent,
        rotary_interleaved=variant.interleaved,
        normalization=variant.norm,
        norm_epsilon=variant.norm_eps,
        apply_layernorm_1p=False,
        swiglu=variant.act == "swiglu",
        quick_geglu=variant.act == "quick_geglu",
        squared_relu=variant.act == "squared_relu",
        bias_gelu_fusion=False,  # the oracle builds unfused: exact (erf) GeLU
        add_bias_linear=variant.bias,
        add_qkv_bias=variant.qkv_bias or variant.bias,  # validate_args sets it from add_bias_linear
        softmax_scale=variant.softmax_scale or None,
        fp32_residual_connection=variant.fp32_residual,
        untie_embeddings_and_output_weights=not variant.tied,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        apply_query_key_layer_scaling=False,
        attention_backend=AttnBackend.auto,
        transformer_impl="transformer_engine" if variant.te_names else "local",
        spec=None,
        vocab_size=variant.vocab,
        padded_vocab_size=variant.padded_vocab(tp),
        make_vocab_size_divisible_by=variant.divisible_by,
        tokenizer_type="NullTokenizer",
        vocab_file=None,
        num_experts=variant.experts or None,
        moe_router_topk=variant.topk,
        moe_ffn_hidden_size=variant.moe_ffn if moe else None,
        moe_shared_expert_intermediate_size=variant.shared_ffn or None,
        moe_shared_expert_gate=variant.shared_gate,
        qk_layernorm=variant.qk_norm,
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type="allgather",
        moe_layer_freq=variant.moe_layer_freq,
        rotary_seq_len_interpolation_factor=variant.interpolation or None,
        window_size=variant.window_size,
        window_attn_skip_freq=variant.window_skip or None,
        no_rope_freq=variant.no_rope or None,
        softmax_type=variant.softmax,
        # Megatron-LM records these for every model; MLA (and its YaRN) reads them.
        multi_latent_attention=variant.mla,
        q_lora_rank=variant.q_lora or None,
        kv_lora_rank=variant.kv_lora if variant.mla else 32,
        qk_head_dim=variant.qk_dim if variant.mla else 128,
        qk_pos_emb_head_dim=variant.pos_dim if variant.mla else 64,
        v_head_dim=variant.head_dim if variant.mla else 128,
        rope_type="yarn" if variant.mla else None,
        rotary_scaling_factor=variant.yarn_factor if variant.mla else 1.0,
        original_max_position_embeddings=variant.yarn_original if variant.mla else None,
        mscale=variant.mscale,
        mscale_all_dim=variant.mscale_all_dim,
        moe_router_score_function="sigmoid" if variant.sigmoid else "softmax",
        moe_router_enable_expert_bias=variant.sigmoid and variant.expert_bias,
        moe_router_topk_scaling_factor=variant.topk_scale or None,
        moe_router_num_groups=variant.router_groups or None,
        moe_router_group_topk=variant.group_topk or None,
        moe_router_pre_softmax=variant.pre_softmax,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_per_virtual_pipeline_stage=variant.layers // (pp * spec.vpp) if vpp else None,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=tp,
        sequence_parallel=False,
        context_parallel_size=1,
        data_parallel_size=1,
        world_size=tp * pp,
        params_dtype=torch.float32,
        fp16=False,
        bf16=False,
        ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format != "torch",
        use_distributed_optimizer=False,
        seed=SEED,
        iteration=ITERATION,
        consumed_train_samples=0,
        consumed_valid_samples=0,
    )


def rng_state(seed: int = SEED) -> list[dict]:
    """``get_rng_state`` for one data-parallel rank, from real generators seeded with ``seed``.

    There is no CUDA generator on CPU: ``cuda_rng_state`` and the tracker's ``model-parallel-rng`` are uint8
    tensors with the CUDA (philox) state's size and dtype, 16 bytes, as ``torch.cuda.get_rng_state()`` returns.
    """
    random.seed(seed)
    np.random.seed(seed)
    cuda_like = torch.tensor(list(seed.to_bytes(8, "little")) + [0] * 8, dtype=torch.uint8)
    return [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": cuda_like,
            "rng_tracker_states": {"model-parallel-rng": cuda_like.clone()},
        }
    ]


def model_keys(chunks: int) -> list[str]:
    """``model`` for one chunk, ``model0``, ``model1``, ... with virtual pipeline stages."""
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def legacy_state(chunks: list[torch.nn.Module], args: argparse.Namespace) -> dict:
    """``generate_state_dict`` for the ``torch`` format."""
    models = {
        key: chunk.state_dict_for_save_checkpoint() for key, chunk in zip(model_keys(len(chunks)), chunks, strict=True)
    }
    return {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": ITERATION,
        **models,
        "rng_state": rng_state(),
        "num_floating_point_operations_so_far": 0,
    }


def dist_state(
    chunks: list[torch.nn.Module], args: argparse.Namespace, *, tp_rank: int, pp_rank: int, dp_rank: int
) -> dict:
    """``generate_state_dict`` for ``torch_dist``: the sharded model, the rng state as a ShardedObject.

    As in ``get_rng_state``, the data-parallel rank is the replica id, so only dp rank 0's state is written.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = (args.pipeline_model_parallel_size, args.tensor_model_parallel_size)
    keys = model_keys(len(chunks))
    models = {
        key: chunk.sharded_state_dict(metadata=content_metadata()) for key, chunk in zip(keys, chunks, strict=True)
    }
    return {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": ITERATION,
        **models,
        "rng_state": ShardedObject("rng_state", rng_state(), shape, (pp_rank, tp_rank), replica_id=dp_rank),
        "num_floating_point_operations_so_far": 0,
    }


def content_metadata() -> dict:
    """``_build_sharded_state_dict_metadata`` without a distributed optimizer, after the process group is dropped."""
    return {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
