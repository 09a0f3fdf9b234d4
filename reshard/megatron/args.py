"""Every Megatron-LM argument, classified: carried into transformers' config, irrelevant to inference, or refused.

A Megatron-LM checkpoint's ``args`` hold hundreds of fields. Converting to transformers is right only when each
one that changes the forward pass is either written into the target's ``config.json`` (:data:`CARRIED`: which
field) or refused by name (:data:`REFUSED`: the values transformers' Llama-like families compute, and why the
others are not). The rest change how a model is trained, logged, stored or split over devices, never what it
computes (:data:`IRRELEVANT`, with the reason per group). The world is closed: an argument none of the three
tables knows is refused unless it is at its default: the value Megatron-LM's parser gives it in one of the
releases :data:`~reshard.megatron.defaults.DEFAULTS` records (generated from Megatron-LM's source by
``scripts/megatron_defaults.py``), or ``None`` for an argument with no recorded default. A newer Megatron's
argument is never dropped silently, nor a flag that defaults to True found False.

The table follows Megatron-Core 0.16.1's ``TransformerConfig`` / ``ModelParallelConfig`` and Megatron-LM's
``arguments.py`` names (NeMo 2's ``model.yaml`` is read under the same names, see ``layouts/dcp/nemo.py``).

DeepSeek-V3's arguments (multi-latent attention, YaRN, the sigmoid router with its expert bias, group-limited
routing, scaled top-k: :data:`DEEPSEEK_V3`) are carried into transformers' ``deepseek_v3`` family, the one family
that computes them, which a model with ``multi_latent_attention`` becomes; any other model refuses them by value,
as :data:`REFUSED` does (:mod:`reshard.megatron.config` refuses the DeepSeek-V3 settings transformers cannot express).
"""

from __future__ import annotations

import re
from typing import Any

from reshard.errors import MappingError
from reshard.megatron.defaults import DEFAULTS, RELEASES

__all__ = ["CARRIED", "DEEPSEEK_V3", "IRRELEVANT", "REFUSED", "RELEASES", "args_problems", "check_args", "classify"]

# Argument -> where it goes in the transformers config (read by ``config.gpt_shape_from_args``, which
# also refuses the values the families cannot compute: LayerNorm, GeLU, learned positions, ...).
CARRIED: dict[str, str] = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size (the dense MLPs')",
    "num_attention_heads": "num_attention_heads",
    "group_query_attention": "num_key_value_heads (num_query_groups when on, else the heads)",
    "num_query_groups": "num_key_value_heads",
    "kv_channels": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
    "seq_length": "max_position_embeddings (when max_position_embeddings is unset)",
    "norm_epsilon": "rms_norm_eps",
    "layernorm_epsilon": "rms_norm_eps (older Megatron-LM)",
    "normalization": "RMSNorm, the families' norm (else refused)",
    "swiglu": "hidden_act silu, gated MLP (else refused)",
    "quick_geglu": "hidden_act quick_gelu, gated MLP (its glu_linear_offset and clamp refused)",
    "position_embedding_type": "rope (else refused)",
    "use_rotary_position_embeddings": "rope (older Megatron-LM's flag for position_embedding_type rope)",
    "add_position_embedding": "learned absolute positions: none with rope",
    "rotary_base": "rope_parameters.rope_theta",
    "rotary_percent": "rope_parameters.partial_rotary_factor (glm4_moe, the family that rotates the first channels)",
    "rotary_interleaved": "glm (GLM-4), the family that rotates interleaved pairs (2i, 2i + 1)",
    "rotary_seq_len_interpolation_factor": "rope_parameters rope_type linear, factor",
    "window_size": "sliding_window = left + 1, a causal window only (smollm3)",
    "window_attn_skip_freq": "layer_types: the sliding_attention layers (smollm3)",
    "no_rope_freq": "no_rope_layers: 0 for the layers without RoPE (smollm3; granite_swa's layer_rope_theta 0)",
    "softmax_type": "granite_swa's sinks (learnable: the softmax_offset per head; off-by-one: zeros)",
    "softmax_scale": "granite_swa's attention_multiplier",
    "use_rope_scaling": "rope_parameters rope_type llama3",
    "rope_scaling_factor": "rope_parameters.factor (llama3)",
    "add_bias_linear": "attention_bias, mlp_bias (Llama), the family",
    "add_qkv_bias": "qkv biases: Qwen2 / Qwen2-MoE, or Llama attention_bias",
    "qk_layernorm": "Qwen3 / Qwen3-MoE q_norm, k_norm",
    "untie_embeddings_and_output_weights": "tie_word_embeddings",
    "vocab_size": "vocab_size (the true size)",
    "padded_vocab_size": "the pad rows cut to vocab_size",
    "make_vocab_size_divisible_by": "the pad rows cut to vocab_size",
    "true_vocab_size": "vocab_size",
    "num_experts": "num_experts / num_local_experts",
    "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size (Qwen2-MoE)",
    "moe_shared_expert_gate": "shared_expert_gate (Qwen2-MoE)",
    "moe_router_pre_softmax": "norm_topk_prob false",
    "moe_router_score_function": "softmax (else refused)",
    "moe_layer_freq": "mlp_only_layers (Qwen2/3-MoE: the dense layers); first_k_dense_replace (DeepSeek-V3)",
    "q_lora_rank": "q_lora_rank (DeepSeek-V3; read only with multi_latent_attention)",
    "kv_lora_rank": "kv_lora_rank (DeepSeek-V3; read only with multi_latent_attention)",
    "qk_head_dim": "qk_nope_head_dim (DeepSeek-V3; read only with multi_latent_attention)",
    "qk_pos_emb_head_dim": "qk_rope_head_dim (DeepSeek-V3; read only with multi_latent_attention)",
    "v_head_dim": "v_head_dim (DeepSeek-V3; read only with multi_latent_attention)",
    "rotary_scaling_factor": "rope_parameters.factor (YaRN) and the softmax scale (read only by MLA)",
    "original_max_position_embeddings": "rope_parameters.original_max_position_embeddings (YaRN, MLA)",
    "beta_fast": "rope_parameters.beta_fast (YaRN, MLA)",
    "beta_slow": "rope_parameters.beta_slow (YaRN, MLA)",
    "mscale": "rope_parameters.mscale (YaRN, MLA)",
    "mscale_all_dim": "rope_parameters.mscale_all_dim (YaRN) and the softmax scale (MLA)",
}

_OFF = (None, False)
# Argument -> (values any family but DeepSeek-V3 computes, what another value does): carried into deepseek_v3
# (``config.hf_config``) when ``multi_latent_attention`` is on, refused by value otherwise.
DEEPSEEK_V3: dict[str, tuple[tuple[Any, ...], str]] = {
    "multi_latent_attention": (_OFF, "multi-latent attention (DeepSeek-V3's q_lora_rank, kv_lora_rank)"),
    "rope_type": ((None, "rope"), "YaRN RoPE (DeepSeek-V3's rope_parameters yarn, with multi-latent attention)"),
    "moe_router_topk_scaling_factor": (
        (None, 1, 1.0),
        "scales the routing weights (DeepSeek-V3's routed_scaling_factor, with multi-latent attention)",
    ),
    "moe_router_num_groups": ((None, 1), "group-limited routing (DeepSeek-V3's n_group, with multi-latent attention)"),
    "moe_router_group_topk": (
        (None,),
        "group-limited routing (DeepSeek-V3's topk_group, with multi-latent attention)",
    ),
    "moe_router_enable_expert_bias": (
        _OFF,
        "an expert bias choosing the experts (DeepSeek-V3's e_score_correction_bias, with multi-latent attention)",
    ),
}

# Argument -> (values transformers' Llama / Qwen / Mixtral families compute, what any other value does).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "moe_router_topk_limited_devices": ((None,), "device-limited routing"),
    "moe_router_load_balancing_type": (
        ("aux_loss", "seq_aux_loss", "global_aux_loss", "none", None),
        "sinkhorn routing",
    ),
    "moe_router_force_load_balancing": (_OFF, "random routing for benchmarks"),
    "moe_expert_capacity_factor": ((None,), "drops the tokens over an expert's capacity"),
    "moe_input_jitter_eps": ((None,), "noise on the router's input"),
    "moe_apply_probs_on_input": (_OFF, "the routing weights applied before the experts"),
    "moe_token_dropping": (_OFF, "token dropping"),
    "moe_latent_size": ((None,), "experts in a latent space"),
    "apply_layernorm_1p": (_OFF, "zero-centered norm weights (the norm multiplies by weight + 1)"),
    "layernorm_zero_centered_gamma": (_OFF, "zero-centered norm weights (the norm multiplies by weight + 1)"),
    "squared_relu": (_OFF, "a squared-ReLU MLP"),
    "openai_gelu": (_OFF, "a GeLU MLP"),
    "glu_linear_offset": ((None, 0, 0.0), "an offset on the GLU's linear half"),
    "activation_func_clamp_value": ((None,), "clamped activations"),
    "apply_residual_connection_post_layernorm": (
        _OFF,
        "residuals taken after the norm (Megatron-LM's legacy models; Megatron-Core reads it nowhere, but the args do "
        "not say which code ran, and no transformers family takes the residual after the norm)",
    ),
    "mrope_section": ((None,), "multimodal RoPE"),
    "mtp_num_layers": ((None, 0), "multi-token-prediction layers"),
    "qk_l2_norm": (_OFF, "L2-normalized queries and keys"),
    "attention_output_gate": (_OFF, "a gate on the attention output"),
    "experimental_attention_variant": ((None,), "an experimental attention"),
    "linear_attention_freq": ((None,), "linear-attention layers"),
    "is_hybrid_model": (_OFF, "a hybrid Mamba model"),
    "hybrid_override_pattern": ((None,), "a hybrid Mamba model"),
    "heterogeneous_layers_config_path": ((None,), "heterogeneous layers"),
    "heterogeneous_layers_config_encoded_json": ((None,), "heterogeneous layers"),
    "spec": ((None,), "a custom layer spec"),
    "heterogeneous_block_specs": (_OFF, "heterogeneous layers"),
    "use_mup": (_OFF, "muP multipliers"),
}

# (pattern of argument names, why they do not change what the model computes). Matched with ``re.match``.
IRRELEVANT: tuple[tuple[str, str], ...] = (
    (
        r"(tensor|pipeline|expert|context|data|encoder_tensor|encoder_pipeline|virtual_pipeline)_model_parallel"
        r"|.*_parallel_size$|.*_parallel_comm|sequence_parallel$|world_size$|rank$|local_rank$|tp_comm|overlap_"
        r"|use_distributed_optimizer|distributed_|num_distributed_optimizer|decoder_first_pipeline"
        r"|decoder_last_pipeline|num_layers_in_(first|last)_pipeline|pipeline_model_parallel_layout"
        r"|num_layers_per_virtual|account_for_|microbatch_|use_ring_exchange|hierarchical_context|cp_comm_type"
        r"|ddp_|nccl_|use_sharp|use_torch_fsdp|use_megatron_fsdp|use_custom_fsdp|fsdp_|moe_extended_tp"
        r"|expert_tensor_parallel|async_tensor_model|batch_p2p|deallocate_pipeline|variable_seq_lengths"
        r"|defer_embedding_wgrad|delay_wgrad|wgrad_deferral|align_param_gather|align_grad_reduce"
        r"|hybrid_context_parallel|max_seqlen_per_dp_cp|moe_shared_expert_overlap|ep_overlap|mtp_standalone"
        r"|encoder_num_layers$|decoder_num_layers$",
        "parallelism: how the model is split over devices",
    ),
    (
        r"optimizer|lr|.*_lr$|min_lr|weight_decay|start_weight_decay|end_weight_decay|adam_|sgd_|muon_|clip_grad"
        r"|loss_scale|initial_loss_scale|min_loss_scale|hysteresis|train_|global_batch|micro_batch|rampup"
        r"|exit_|skip_train|consumed_|iteration|curr_iteration|do_train|do_valid|do_test|decoupled_"
        r"|override_opt|use_checkpoint_opt|no_load_optim|accumulate_allreduce|grad_|use_precision_aware"
        r"|main_grads_dtype|main_params_dtype|exp_avg|optimizer_cpu|overlap_cpu|use_torch_optimizer"
        r"|check_for_|calculate_per_token_loss|moe_aux_loss|moe_z_loss|moe_router_bias_update_rate|mtp_loss"
        r"|dsa_indexer_loss|dsa_indexer_use_sparse_loss|qk_clip|moe_enable_routing_replay|moe_per_layer_logging"
        r"|moe_token_drop_policy|moe_pad_expert_input|num_floating_point|manual_gc|empty_unused_memory"
        r"|head_lr_mult|lr_|warmup|cosine_|wsd_|decay_|use_ft_|enable_ft|ft_",
        "training: optimizer, schedule, losses, batch sizes",
    ),
    (
        r"log|tensorboard|wandb|timing|profile|record_memory|one_logger|enable_one_logger|app_tag|straggler"
        r"|memory_snapshot|use_pytorch_profiler|barrier_with|config_logger|result_rejected|rerun_"
        r"|error_injection|inprocess|run_workload|enable_gloo_process_groups|timers$|test_mode$",
        "logging and monitoring",
    ),
    (
        r"save|load$|load_|ckpt_|dist_ckpt|use_dist_ckpt|auto_detect_ckpt|async_save|use_persistent"
        r"|non_persistent|pretrained_checkpoint|finetune|no_save|no_load|use_checkpoint_args|use_mp_args"
        r"|persistent_|checkpoint_|use_tokenizer_model_from_checkpoint_args|adlr_autoresume|yaml_cfg"
        r"|hetereogenous_dist_checkpoint|retro_|use_legacy_models$|legacy_tokenizer|model_type$",
        "checkpointing and the run's bookkeeping (names are the mapping's business)",
    ),
    (
        r"data_|train_data|valid_data|test_data|split$|mock_data|num_workers|encoder_seq_length"
        r"|decoder_seq_length|reset_position_ids|reset_attention_mask|eod_mask_loss|create_attention_mask"
        r"|num_dataset_builder|per_split|dataloader|sft|object_storage|s3_|msc|mmap_|short_seq_prob|mask_prob"
        r"|full_validation|multiple_validation|eval_|phase_transition|dataset|blend|index_mapping",
        "data: the inputs of training runs",
    ),
    (
        r"ict_|biencoder|retriever|titles_data|query_in_block|use_one_sent|evidence_data|block_data"
        r"|embedding_path|indexer_|bert_|img_h|img_w|num_channels|patch_dim|classes_fraction"
        r"|data_per_class_fraction|dino_|iter_per_epoch|vision_|num_classes|max_tokens_to_oom"
        r"|output_bert_embeddings|mask_factor|mask_type|sample_rate|valid_|epochs$|lazy_mpu_init"
        r"|standalone_embedding_stage|use_tp_pp_dp_mapping|enable_experimental|deprecated_use_mcore_models",
        "other tasks' and tools' options (BERT, retrieval, vision, inference servers, start-up)",
    ),
    (
        r"tokenizer|vocab_file|merge_file|vocab_extra_ids|tiktoken|special_tokens|trust_remote_code",
        "the tokenizer (the true vocab size is read separately)",
    ),
    (
        r"fp16|bf16|fp8|fp4|fp32_residual_connection|params_dtype|pipeline_dtype|autocast_dtype|enable_autocast"
        r"|attention_softmax_in_fp32|apply_query_key_layer_scaling|disable_bf16|first_last_layers_bf16"
        r"|num_layers_at_(start|end)_in_bf16|moe_router_dtype|moe_router_padding_for|tp_only_amax_red"
        r"|use_kitchen|kitchen_|quant_recipe|moe_router_fusion|moe_permute_fusion",
        "precision: the dtypes of the computation (fp32 residuals and router, scaled softmax give the same function)",
    ),
    (
        r"apply_rope_fusion|masked_softmax_fusion|bias_gelu_fusion|bias_swiglu_fusion|bias_dropout_fusion"
        r"|bias_activation_fusion|persist_layer_norm|gradient_accumulation_fusion|cross_entropy|use_flash_attn"
        r"|attention_backend|transformer_impl|te_|use_te|memory_efficient_layer_norm|fused_|moe_grouped_gemm"
        r"|moe_use_legacy_grouped_gemm|moe_token_dispatcher_type|moe_enable_deepep|moe_flex|moe_deepep"
        r"|moe_hybridep|enable_cuda_graph|cuda_graph|external_cuda_graph|deterministic_mode|inference_"
        r"|flash_decode|symmetric_ar|batch_invariant|use_inference|mlp_chunks_for_prefill"
        r"|disable_parameter_transpose|clone_scatter|no_persist_layer_norm|no_masked_softmax"
        r"|no_bias_|no_gradient_accumulation|no_rope_fusion|use_fused_|activation_func_fp8|moe_router_padding",
        "kernels and fusions: the same function computed faster",
    ),
    (
        r".*dropout$|init_method|embedding_init|perform_initialization|seed$|data_parallel_random_init"
        r"|init_model_with_meta|use_cpu_initialization|recompute|distribute_saved|cpu_offloading|offload"
        r"|fine_grained_activation|min_offloaded|moe_layer_recompute|num_microbatches|output_layer_init_method"
        r"|finalize_model_grads_func|no_sync_func|param_sync_func|_cpu_offloading_context",
        "dropout (off at inference), initialization, recomputation and offloading",
    ),
    (
        r"cache_mla_latents$|mla_down_proj_fusion$|mla_latent_cp$",
        "multi-latent attention's inference cache and kernels: the same function computed faster",
    ),
    (
        r"dsa_indexer_|linear_conv_kernel_dim|linear_key_head_dim|linear_value_head_dim|linear_num_key_heads"
        r"|linear_num_value_heads|mamba_|use_mamba_mem_eff_path",
        "read only by the refused attention variants and hybrid models",
    ),
)
_IRRELEVANT = [(re.compile(f"(?:{pattern})"), reason) for pattern, reason in IRRELEVANT]


def classify(name: str) -> str:
    """``carried``, ``refused`` (checked by value), ``irrelevant`` or ``unknown``, for one argument name."""
    if name in CARRIED or name in DEEPSEEK_V3:
        return "carried"
    if name in REFUSED:
        return "refused"
    if any(pattern.match(name) for pattern, _ in _IRRELEVANT):
        return "irrelevant"
    return "unknown"


def _accepted(value: Any, accepted: tuple[Any, ...]) -> bool:
    if isinstance(value, (list, tuple)):  # e.g. moe_router_load_balancing_type, one per stage of the run
        return all(_accepted(item, accepted) for item in value)
    return any(value is a if a is None or isinstance(a, bool) else _equal(value, a) for a in accepted)


def _equal(value: Any, wanted: Any) -> bool:
    if isinstance(value, bool) or isinstance(wanted, bool):
        return value is wanted
    return value == wanted


def _at_default(name: str, value: Any) -> bool:
    """Whether an argument the tables do not know holds its default in a release ``DEFAULTS`` records."""
    if value is None:
        return True
    if name not in DEFAULTS:
        return False
    if isinstance(value, tuple):  # a list default saved as a tuple (yaml, older pickles)
        value = list(value)
    return any(_equal(value, wanted) for wanted in DEFAULTS[name])


def _items(args: Any) -> list[tuple[str, Any]]:
    return sorted((args if isinstance(args, dict) else vars(args)).items())


def args_problems(args: Any) -> list[str]:
    """One line per argument whose value transformers' families cannot compute, or that the table does not know."""
    problems = []
    items = _items(args)
    deepseek = any(name == "multi_latent_attention" and value for name, value in items)
    for name, value in items:
        kind = classify(name)
        if name in DEEPSEEK_V3 and not deepseek and not _accepted(value, DEEPSEEK_V3[name][0]):
            problems.append(f"{name}={value!r} ({DEEPSEEK_V3[name][1]})")
        elif kind == "refused" and not _accepted(value, REFUSED[name][0]):
            problems.append(f"{name}={value!r} ({REFUSED[name][1]})")
        elif kind == "unknown" and not _at_default(name, value):
            problems.append(f"{name}={value!r} (an argument reshard does not know: it may change the model)")
    return problems


def check_args(args: Any) -> None:
    """Refuse a Megatron model whose ``args`` set what the target config cannot carry, naming each argument.

    Raises:
        MappingError: one line listing every such argument and its value.
    """
    problems = args_problems(args)
    if problems:
        raise MappingError(
            "Megatron arguments transformers' families do not compute: " + "; ".join(problems),
            hint="keep Megatron's names with --keep-names, or convert to --layout megatron",
        )
