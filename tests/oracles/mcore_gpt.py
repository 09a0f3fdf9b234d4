"""Megatron-Core 0.16.1 on CPU as an oracle: it writes real checkpoints and loads them back at another tp/pp.

It runs unchanged under Megatron-Core 0.19.2 too (its own venv: ``tests/layouts/dcp/test_torch_dist_mcore19.py``),
whose ``torch_dist`` save writes no ``common.pt``: ``args`` and the counters go into the data files.

Run by hand from the repository root, in the venv ``make install`` builds (``--nproc-per-node`` = tp * pp, or a
multiple of it: the extra ranks are data-parallel replicas and only data-parallel rank 0 writes)::

    torchrun --standalone --nproc-per-node 2 tests/oracles/mcore_gpt.py save --variant llama --tp 2 --out /tmp/o
    torchrun --standalone --nproc-per-node 4 tests/oracles/mcore_gpt.py load --variant llama --tp 4 \\
        --ckpt /tmp/o/torch_dist --out /tmp/o/logits-tp4.pt
    torchrun --standalone --nproc-per-node 2 tests/oracles/mcore_gpt.py load --variant llama --tp 2 \\
        --ckpt /tmp/o/torch --format torch --out /tmp/o/logits-legacy.pt
    torchrun --standalone --nproc-per-node 2 tests/oracles/mcore_gpt.py jobs jobs.json   # many in one start

``save`` builds the variant from a fixed seed at ``--tp``/``--pp`` (``--vpp`` chunks per stage) and writes:

- ``OUT/torch/``: the legacy format as Megatron-LM's ``training/checkpointing.py`` lays it out
  (``latest_checkpointed_iteration.txt``, ``iter_0000010/mp_rank_XX[_PPP]/model_optim_rng.pt`` holding ``args``,
  ``checkpoint_version`` 3.0, ``iteration``, ``model`` or ``model0``/``model1``, ``rng_state`` with numpy arrays,
  ``num_floating_point_operations_so_far``; see ``megatron_lm.py``);
- ``OUT/torch_dist/``: ``dist_checkpointing.save`` of the same state, the model as ``sharded_state_dict()``, in
  ``iter_0000010/`` (``metadata.json``, ``common.pt`` with ``args``, ``.metadata``, ``__R_I.distcp``);
- ``OUT/reference.pt``: ``{'input_ids' [2, 12], 'logits' [2, 12, padded vocab] fp32 gathered over tp, 'variant',
  'spec', 'padded_vocab'}`` from the model that wrote both.

``load`` builds the variant at ``--tp``/``--pp`` from another seed (a load that does nothing cannot match), loads
``--ckpt`` (a root with the tracker, or an ``iter_*``/``release`` directory) as Megatron-LM would without rng and
optimizer: ``torch_dist`` with ``dist_checkpointing.load`` at any layout, ``torch`` at its own layout; then
``load_state_dict(strict=True)`` and the forward pass on the same batch. ``--out`` gets ``{'input_ids', 'logits',
'args' (its plain values), 'iteration', 'checkpoint_version'}``. ``jobs FILE`` runs a JSON list of such jobs
(``{"command": "save"|"load", "spec": Spec.to_json(), "out", "ckpt", "format", "strict"}``), re-initializing
model parallelism between layouts: one start (~8-10 s) instead of one per job.

Variants (``variants.py``; ``--set field=value`` overrides a size, e.g. ``--set divisible_by=8``): ``llama`` (GQA:
8 heads of 8 in 2 query groups, hidden 64, 4 layers, SwiGLU ffn 96, RMSNorm, RoPE, no biases, untied, true vocab
1000 padded to 1024), ``llama-tied``, ``moe`` (2 layers, 4 experts of ffn 32, top-2 router, SequentialMLP),
``moe-shared`` (plus a shared expert of ffn 48). No sequence parallelism: the local spec's torch norms refuse it,
and MoE at tp > 1 asks for it only when training.

CPU workarounds (each one fails without it; see ``/work/shared/reference/megatron-core-cpu.md``):

1. ``CudaRNGStatesTracker.fork`` is a no-op: attention dropout enters it even in eval, and without a GPU the
   tracker has no state ("cuda rng state model-parallel-rng is not added").
2. ``torch.cuda.current_device`` returns ``"cpu"``: rotary embeddings and gather buffers allocate on it.
3. ``torch.cuda.synchronize`` is a no-op: every ``torch_dist`` save calls it.
4. ``Tensor.cuda`` returns the tensor: tied embeddings with pp > 1 all-reduce ``weight.data.cuda()``
   ("Torch not compiled with CUDA enabled").
5. ``moe_utils.te_general_gemm = None``: 0.16.1 defines it only when Transformer Engine imports, but the router
   tests it unguarded (``NameError: name 'te_general_gemm' is not defined``).
5a. Multi-latent attention (``dsv3`` variants): ``multi_latent_attention.HAVE_TE = False`` (an importable stub of
   Transformer Engine's module makes it take TE's paths), and the local ``DotProductAttention`` wrapped to take the
   ``k_channels`` / ``v_channels`` MLA passes (its output is heads x ``v_channels`` wide).
5b. ``fused_softmax.get_sliding_window_causal_mask`` builds the same mask on the CPU: Megatron-Core's (0.19) makes
   it on ``"cuda"`` (sliding-window variants).
6. The causal ``attention_mask`` (bool ``[b, 1, s, s]``, True = masked) is passed: the default one is built on
   ``"cuda"``.
7. ``TorchDistSaveShardedStrategy("torch_dist", 1)`` gets its positional arguments (0.16.1).
8. ``psutil`` must be installed, or the forked ``torch_dist`` writer dies and the save hangs forever; the runner
   in ``__init__.py`` always puts a timeout.

The pipeline runs by hand, one microbatch: each stage receives hidden states ``[s, b, h]`` from the previous rank
with ``torch.distributed.recv`` and sends its own to the next; the last stage's last chunk returns the logits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import zlib
from pathlib import Path

import megatron_lm
import torch
import torch.distributed as dist
from variants import BATCH, BATCH_SEED, SEED, SEQ, VARIANTS, Spec, Variant, parse_overrides


def cpu_workarounds() -> None:
    """Let Megatron-Core's GPU-minded code paths run on CPU (workarounds 1-5 of the module docstring)."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        yield

    mrandom.CudaRNGStatesTracker.fork = fork
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    moe_utils.te_general_gemm = None
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False
    from megatron.core.fusions import fused_softmax

    def sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
        ones = torch.ones(sq, skv, dtype=torch.bool)  # Megatron-Core's get_sliding_window_causal_mask, on the CPU
        return ~torch.tril(torch.triu(ones, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = sliding_window_mask


def mla_core_attention():
    """The local spec's attention, taking MLA's ``k_channels`` / ``v_channels`` (workaround 5a)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # Attention builds one without, MLA's own has them
                width = v_channels * self.config.num_attention_heads
                self.hidden_size_per_partition = divide(width, self.tp_group.size())

    return MLADotProductAttention


def build(variant: Variant, spec: Spec, *, seed: int) -> list:
    """This rank's model chunks (one per virtual stage): GPTModel, local (non-TE) spec, fp32, eval mode."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.activations import quick_gelu, squared_relu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = variant.experts > 0
    mla = {}
    if variant.mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig as TransformerConfig  # noqa: N814

        mla = dict(
            q_lora_rank=variant.q_lora or None,
            kv_lora_rank=variant.kv_lora,
            qk_head_dim=variant.qk_dim,
            qk_pos_emb_head_dim=variant.pos_dim,
            v_head_dim=variant.head_dim,
            rope_type="yarn",
            rotary_base=variant.rotary_base,
            rotary_scaling_factor=variant.yarn_factor,
            original_max_position_embeddings=variant.yarn_original,
            mscale=variant.mscale,
            mscale_all_dim=variant.mscale_all_dim,
            transformer_impl="local",  # 0.19 builds MLA's projections from this backend, not only from the spec
        )
    router = {}
    if variant.sigmoid:
        router = dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=variant.expert_bias,
            moe_router_topk_scaling_factor=variant.topk_scale or None,
            moe_router_num_groups=variant.router_groups or None,
            moe_router_group_topk=variant.group_topk or None,
        )
    config = TransformerConfig(
        num_layers=variant.layers,
        hidden_size=variant.hidden,
        num_attention_heads=variant.heads,
        num_query_groups=variant.groups,
        kv_channels=variant.head_dim,
        ffn_hidden_size=variant.ffn,
        normalization=variant.norm,
        layernorm_epsilon=variant.norm_eps,
        gated_linear_unit=variant.act in ("swiglu", "quick_geglu"),
        activation_func={"swiglu": F.silu, "gelu": F.gelu, "squared_relu": squared_relu, "quick_geglu": quick_gelu}[
            variant.act
        ],
        add_bias_linear=variant.bias,
        softmax_scale=variant.softmax_scale or None,
        moe_router_pre_softmax=variant.pre_softmax,
        fp32_residual_connection=variant.fp32_residual,
        add_qkv_bias=variant.qkv_bias,
        num_moe_experts=variant.experts or None,
        moe_router_topk=variant.topk,
        moe_ffn_hidden_size=variant.moe_ffn if moe else None,
        moe_shared_expert_intermediate_size=variant.shared_ffn or None,
        moe_shared_expert_gate=variant.shared_gate,
        qk_layernorm=variant.qk_norm,
        moe_layer_freq=variant.moe_layer_freq,
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp if spec.vpp > 1 else None,
        sequence_parallel=False,  # the local spec's torch norms refuse it; MoE needs it only to train
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        init_method_std=variant.init_std,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **mla,
        **router,
        window_size=variant.window_size,
        window_attn_skip_freq=variant.window_skip or None,
        no_rope_freq=variant.no_rope or None,
        softmax_type=variant.softmax,
        rotary_interleaved=variant.interleaved,
    )
    if variant.dense_first or variant.mla:  # dense and MoE layers: one spec per layer, from moe_layer_freq
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=variant.norm)
        for layer in layer_spec.layer_specs if variant.mla else ():
            attention = layer.submodules.self_attention.submodules
            attention.core_attention = mla_core_attention()
            if not variant.q_lora:  # no query latent, no query norm (0.19 refuses an unused one)
                from megatron.core.transformer.identity_op import IdentityOp

                attention.q_layernorm = IdentityOp
    else:
        layer_spec = get_gpt_layer_local_spec(
            num_experts=variant.experts or None, normalization=variant.norm, qk_layernorm=variant.qk_norm
        )
    torch.manual_seed(seed)
    chunks = []
    for vp_stage in range(spec.vpp):
        vp = vp_stage if spec.vpp > 1 else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=variant.padded_vocab(spec.tp),
            max_sequence_length=variant.max_seq,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            parallel_output=False,
            share_embeddings_and_output_weights=variant.tied,
            position_embedding_type=variant.pos,
            rotary_base=variant.rotary_base,
            rotary_percent=variant.rotary_percent,
            seq_len_interpolation_factor=variant.interpolation or None,
            vp_stage=vp,
        )
        _randomize_constants(model, f"{seed}/{ps.get_pipeline_model_parallel_rank()}/{vp_stage}")
        chunks.append(model.eval())
    return chunks


def _randomize_constants(model, where: str) -> None:
    """Norms start as ones and biases as zeros (learnable softmax offsets uninitialized): make them random so that a
    misplaced one shows.

    The values depend on the parameter's name and stage (``where``), and on the tp rank for tp-sharded ones, so
    replicas agree across tp ranks and no two stages or shards hold the same values.
    """
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" not in name and not name.endswith((".bias", ".expert_bias", ".softmax_offset")):
                continue
            # the learnable softmax offset holds this rank's heads, though Megatron-Core does not mark it tp-sharded
            sharded = getattr(param, "tensor_model_parallel", False) or name.endswith(".softmax_offset")
            shard = ps.get_tensor_model_parallel_rank() if sharded else -1
            gen = torch.Generator().manual_seed(zlib.crc32(f"{where}/{shard}/{name}".encode()))
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + 0.2 * torch.randn(param.shape, generator=gen, dtype=param.dtype))


def te_name(name: str, variant: Variant, *, back: bool = False, dist: bool = False) -> str:
    """A local-spec name as the Transformer Engine spec stores it (``back``: the other way), for ``te_names``
    variants: MLA's latent norms fused into the up projections, a dense layer's MLP norm into its ``linear_fc1``.

    Without MLA the local spec's ``sharded_state_dict`` already stores its norms under TE's fused names (``dist``:
    a ``torch_dist`` key), even an MoE layer's ``pre_mlp_layernorm``, which TE keeps apart; its legacy files keep
    ``input_layernorm``, which TE fuses into ``linear_qkv``."""
    if not variant.te_names:
        return name
    pairs = [
        ("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_"),
        ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_"),
    ]
    pairs += [
        (f"layers.{i}.pre_mlp_layernorm.", f"layers.{i}.mlp.linear_fc1.layer_norm_")
        for i in range(variant.dense_first)
    ]
    if not variant.mla and dist:
        moe_layers = range(variant.dense_first, variant.layers) if variant.experts else ()
        pairs += [(f"layers.{i}.mlp.linear_fc1.layer_norm_", f"layers.{i}.pre_mlp_layernorm.") for i in moe_layers]
    elif not variant.mla:
        pairs.append(("input_layernorm.", "self_attention.linear_qkv.layer_norm_"))
    for local, te in pairs:
        old, new = (te, local) if back else (local, te)
        if old in name:
            return name.replace(old, new)
    return name


_DOWN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def te_legacy(state: dict, variant: Variant, *, back: bool = False) -> dict:
    """A rank's legacy model state as the Transformer Engine spec saves it (``back``: as the local spec loads it):
    :func:`te_name`'s names, and MLA's down projections whole on every tp rank (TE duplicates them, the local spec
    splits them on dim 0), for ``te_names`` variants."""
    from megatron.core import parallel_state as ps

    if not variant.te_names:
        return state
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    group = ps.get_tensor_model_parallel_group()
    out = {}
    for name, value in state.items():
        if name.endswith(_DOWN) and tp > 1:
            if back:
                value = value.chunk(tp)[rank].clone()
            else:
                parts = [torch.empty_like(value) for _ in range(tp)]
                dist.all_gather(parts, value.contiguous(), group=group)
                value = torch.cat(parts)
        out[te_name(name, variant, back=back)] = value
    return out


def te_keys(tree: dict, variant: Variant) -> dict:
    """A sharded state dict whose tensors are stored under :func:`te_name`'s keys (as a TE model's would be)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for value in tree.values():
        if isinstance(value, dict):
            te_keys(value, variant)
        elif isinstance(value, ShardedTensor):
            value.key = te_name(value.key, variant, dist=True)
    return tree


def batch(variant: Variant) -> torch.Tensor:
    return torch.randint(0, variant.vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(BATCH_SEED))


def forward(chunks: list, variant: Variant, ids: torch.Tensor) -> torch.Tensor | None:
    """Logits ``[b, s, padded vocab]`` on the last stage (None elsewhere).

    The stages pass hidden states by hand: chunk c of pipeline rank p feeds chunk c of rank p + 1, and the last
    rank's chunk c feeds the first rank's chunk c + 1 (Megatron's interleaved order, one microbatch).
    """
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    for c, model in enumerate(chunks):
        if not (first and c == 0):
            hidden = torch.empty(s, b, variant.hidden)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        with torch.no_grad():
            out = model(ids, positions, mask)
        if last and c == len(chunks) - 1:
            return out.float()
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return None


def save(chunks: list, variant: Variant, spec: Spec, out: Path) -> None:
    """Both formats and the reference logits; legacy files and the reference come from data-parallel rank 0."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    writer = ps.get_data_parallel_rank() == 0
    logits = forward(chunks, variant, batch(variant))

    legacy_root = out / "torch"
    if writer:
        path = megatron_lm.rank_file(legacy_root, tp_rank, pp_rank, spec.pp)
        path.parent.mkdir(parents=True, exist_ok=True)
        args = megatron_lm.megatron_args(variant, spec, ckpt_format="torch")
        state = megatron_lm.legacy_state(chunks, args)
        for key in megatron_lm.model_keys(len(chunks)):
            state[key] = te_legacy(state[key], variant)
        torch.save(state, path)

    dist_root = out / "torch_dist"
    iter_dir = megatron_lm.iter_dir(dist_root)
    if dist.get_rank() == 0:
        iter_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    args = megatron_lm.megatron_args(variant, spec, ckpt_format="torch_dist")
    state = megatron_lm.dist_state(chunks, args, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=ps.get_data_parallel_rank())
    te_keys(state, variant)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    dist_checkpointing.save(state, str(iter_dir), strategy, content_metadata=megatron_lm.content_metadata())
    dist.barrier()
    if dist.get_rank() == 0:
        megatron_lm.write_tracker(legacy_root)
        megatron_lm.write_tracker(dist_root)
    if logits is not None and tp_rank == 0 and writer:
        reference = dict(input_ids=batch(variant), logits=logits, variant=variant.__dict__, spec=spec.to_json())
        torch.save(reference | {"padded_vocab": variant.padded_vocab(spec.tp)}, out / "reference.pt")


def load(chunks: list, variant: Variant, spec: Spec, ckpt: Path, fmt: str, out: Path, *, strict: str) -> None:
    """Load as Megatron-LM's ``load_checkpoint`` does (model only, no rng/optimizer), then the forward pass.

    ``torch_dist``: ``common.pt`` through ``load_common_state_dict`` (its ``args``, ``iteration``,
    ``checkpoint_version`` are reported in the output), the model through ``dist_checkpointing.load`` with
    ``strict`` (Megatron-LM's ``--dist-ckpt-strictness``). Both formats then ``load_state_dict(strict=True)``
    (Megatron-LM falls back to ``strict=False`` on error; the oracle does not).
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    iter_dir = megatron_lm.resolve_iteration_dir(ckpt)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    keys = megatron_lm.model_keys(len(chunks))
    if fmt == "torch_dist":
        common = dist_checkpointing.load_common_state_dict(str(iter_dir))
        request = {key: te_keys(chunk.sharded_state_dict(), variant) for key, chunk in zip(keys, chunks, strict=True)}
        common |= dist_checkpointing.load(request, str(iter_dir), strict=strict)
    else:
        path = iter_dir / megatron_lm.rank_dir(tp_rank, pp_rank, spec.pp) / "model_optim_rng.pt"
        common = torch.load(path, map_location="cpu", weights_only=False)
        for key in keys:
            common[key] = te_legacy(common[key], variant, back=True)
    for key, chunk in zip(keys, chunks, strict=True):
        chunk.load_state_dict(common.pop(key), strict=True)
    ids = batch(variant)
    logits = forward(chunks, variant, ids)
    if logits is not None and tp_rank == 0 and ps.get_data_parallel_rank() == 0:
        args = common.get("args")
        plain = (int, float, str, bool, type(None))
        args = None if args is None else {k: v for k, v in vars(args).items() if isinstance(v, plain)}
        found = {k: common.get(k) for k in ("iteration", "checkpoint_version")}
        torch.save({"input_ids": ids, "logits": logits, "args": args} | found, out)


def run(jobs: list[dict]) -> None:
    """Run jobs in order in this process group, re-initializing model parallelism when tp/pp/vpp change."""
    from megatron.core import parallel_state as ps

    current = None
    for job in jobs:
        spec = Spec.from_json(job["spec"])
        if (spec.tp, spec.pp, spec.vpp) != current:
            if current is not None:
                ps.destroy_model_parallel()
            ps.initialize_model_parallel(
                tensor_model_parallel_size=spec.tp,
                pipeline_model_parallel_size=spec.pp,
                virtual_pipeline_model_parallel_size=spec.vpp if spec.vpp > 1 else None,
            )
            current = (spec.tp, spec.pp, spec.vpp)
        variant, out = spec.model(), Path(job["out"])
        if job["command"] == "save":
            save(build(variant, spec, seed=SEED), variant, spec, out)
        else:
            chunks = build(variant, spec, seed=SEED + 1)
            strict = job.get("strict", "assume_ok_unexpected")
            load(chunks, variant, spec, Path(job["ckpt"]), job.get("format", "torch_dist"), out, strict=strict)
        dist.barrier()
    if current is not None:
        ps.destroy_model_parallel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["save", "load", "jobs"])
    parser.add_argument("jobs_file", nargs="?", type=Path, help="jobs: a JSON list of jobs (see oracles/__init__.py)")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="llama")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a size")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages (model chunks) per pp rank")
    parser.add_argument("--out", type=Path, help="save: a directory; load: the logits file")
    parser.add_argument("--ckpt", type=Path, help="load: a checkpoint root or iter_* directory")
    parser.add_argument("--format", choices=["torch_dist", "torch"], default="torch_dist")
    parser.add_argument("--strict", default="assume_ok_unexpected", help="load: dist_checkpointing strictness")
    opts = parser.parse_args(argv)
    if opts.command == "jobs":
        jobs = json.loads(opts.jobs_file.read_text())
        if [job["command"] for job in jobs] == ["hang"]:  # for the runner's timeout test: a worker that never ends
            Path(jobs[0]["out"], f"hanging-{os.environ.get('RANK', '0')}").touch()
            time.sleep(3600)
    else:
        if opts.out is None or (opts.command == "load" and opts.ckpt is None):
            parser.error("save needs --out; load needs --ckpt and --out")
        try:  # unknown fields fail here, before torch.distributed starts
            spec = Spec(opts.variant, opts.tp, opts.pp, tuple(sorted(parse_overrides(opts.set).items())), opts.vpp)
            spec.model()
        except ValueError as err:
            parser.error(str(err))
        job = {"command": opts.command, "spec": spec.to_json(), "out": str(opts.out)}
        jobs = [job | {"ckpt": str(opts.ckpt), "format": opts.format, "strict": opts.strict}]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for job in jobs:
        spec = Spec.from_json(job["spec"])
        if world % (spec.tp * spec.pp):
            parser.error(f"{spec.slug}: run under torchrun with --nproc-per-node a multiple of tp * pp, not {world}")

    cpu_workarounds()
    dist.init_process_group("gloo")
    try:
        run(jobs)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
