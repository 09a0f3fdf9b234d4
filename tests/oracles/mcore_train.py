"""Megatron-Core trains on CPU as an oracle of the training state: its distributed optimizer writes ``torch_dist``
with the optimizer in model space (``fully_reshardable``) and resumes from a checkpoint at another tp.

Run under ``torchrun`` (gloo) with the Megatron-Core 0.19.2 venv (``tests/layouts/dcp/test_torch_dist_mcore19.py``)::

    torchrun --standalone --nproc-per-node 2 tests/oracles/mcore_train.py jobs jobs.json

Jobs (a JSON list; model parallelism re-initialized between them):

- ``{"command": "train", "spec", "out", "steps", "more", "sharding", "bf16", "bucket_size"}``: the ``spec``'s model
  (``mcore_gpt.build``, fp32; ``bf16``: in bf16 behind ``Float16Module``, the optimizer's fp32 masters apart, as
  Megatron-LM's ``--bf16``; a ``pp`` > 1 takes :func:`synthetic_step`s, without a pipeline schedule) wrapped in
  Megatron-Core's ``DistributedDataParallel`` (``bucket_size``: with
  ``--overlap-grad-reduce --ddp-bucket-size``, else one bucket; the args record it as Megatron-LM's do), the optimizer
  ``get_megatron_optimizer`` builds (Adam, the distributed optimizer: torch's ``Adam`` with ``decoupled_weight_decay``
  without Apex / Transformer Engine), trained ``steps`` steps on fixed batches (one per step), then saved as
  Megatron-LM's ``save_checkpoint`` does with ``--dist-ckpt-optim-fully-reshardable`` (``sharding``
  ``dp_reshardable``: without, Megatron-LM's default; ``none``: without ``--use-distributed-optimizer``,
  Megatron-Core's ``FP32Optimizer``):
  ``dist_checkpointing.save({args, iteration, checkpoint_version, model, optimizer:
  optimizer.sharded_state_dict(model, metadata), opt_param_scheduler, rng_state, ...})`` in
  ``OUT/ckpt/iter_{steps:07d}``, with its ``content_metadata``. Then ``more`` steps: ``OUT/reference.pt`` holds their
  losses and ``OUT/saved_rank{r}.pt`` this rank's state as the optimizer held it at the save (:func:`held_state`).
- ``{"command": "resume", "spec", "ckpt", "out", "steps", "optimizer": bool, "bf16"}``: a model built from another
  seed, its optimizer configured with other hyper-parameters (``OTHER``: the saved ones must win), loaded as
  Megatron-LM's ``load_checkpoint`` does (``load_content_metadata``, the sharded state dict with ``is_loading``,
  ``load_state_dict`` of model and optimizer; ``optimizer: false`` loads the model alone: a fresh optimizer, as
  after a weights-only conversion), then ``steps`` steps on the batches that follow the save. ``OUT`` (per rank
  ``OUT.rank{r}``) gets ``{'losses', 'state' (held_state right after the load), 'groups', 'iteration',
  'metadata'}``.

CPU workarounds beyond ``mcore_gpt.cpu_workarounds`` (each one fails without it):

1. factories called with ``device='cuda'`` (``MixedPrecisionOptimizer``'s overflow buffer ``torch.tensor([0],
   device='cuda')``) get the CPU: a ``TorchFunctionMode`` rewrites the device;
2. ``Tensor.type()`` names CPU tensors as CUDA ones: the distributed optimizer accepts only
   ``torch.cuda.FloatTensor`` / ``HalfTensor`` / ``BFloat16Tensor`` parameters ("Wrapped parameters must be one of
   ...");
3. ``torch.cuda.current_stream`` returns a stream that waits for nothing (the gradient sync asks for it);
4. before a load, the fresh optimizer's state is allocated as Megatron-Core's ``init_state_fn`` does, with torch
   Adam's ``step`` (0): without Apex or Transformer Engine, ``DistributedOptimizer.state_dict()`` (which
   ``sharded_state_dict(is_loading=True)`` calls first) reads the step from every parameter's state and asserts
   one (``assert len(steps) == 1``), which a never-stepped torch Adam does not have;
5. ``DistributedOptimizer._set_main_param_and_optimizer_states`` is given ``step: None`` beside the loaded tensors:
   it looks up every tensor of the parameter's optimizer state in them, torch Adam's ``step`` too, which the
   ``fully_reshardable`` load never passes (the step comes from the param groups): ``KeyError: 'step'``;
6. after the optimizer's load, each parameter's ``step`` is its own tensor: without Apex or Transformer Engine,
   ``DistributedOptimizer.load_state_dict`` puts one ``torch.tensor(step)`` in every parameter's state, which torch
   keeps shared, so Adam's in-place ``step += 1`` advances it once per parameter and every bias correction after
   the resume is wrong (the second resumed loss moves by ~5e-4 at the same tp).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import mcore_gpt
import megatron_lm
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from variants import BATCH, BATCH_SEED, SEED, SEQ, Spec, Variant

LR, MIN_LR = 1e-3, 1e-4
ADAM_STATE = ("exp_avg", "exp_avg_sq")
# The hyper-parameters the run that saves is configured with; a resume configures others (``OTHER``), which the
# checkpoint's param groups overwrite. ``lr`` stays: Megatron-Core matches groups by ``max_lr`` (among its
# ``param_group_identifier_keys``), so a run configured with another refuses the checkpoint's groups (KeyError); and
# so does the weight decay: the LR scheduler's ``load_state_dict`` steps (setting every group's weight decay from
# the run's configured ``start_wd``) before it restores the saved one, so the first resumed step would take the run's.
HYPER = {"weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8}
OTHER = {"weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.999, "adam_eps": 1e-6}


def cpu_training_workarounds() -> None:
    """Workarounds 1-3 and 5 of the module docstring."""

    def cpu(device):
        if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
            return "cpu"
        return torch.device("cpu") if isinstance(device, torch.device) and device.type == "cuda" else device

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            return func(*args, **kwargs)

    CudaToCpu().__enter__()
    typed = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        out = typed(self, *args, **kwargs)
        plain = not args and not kwargs and isinstance(out, str) and ".cuda." not in out
        return out.replace("torch.", "torch.cuda.", 1) if plain else out

    torch.Tensor.type = cuda_type

    class Stream:
        def wait_event(self, *args, **kwargs) -> None:
            pass

        def wait_stream(self, *args, **kwargs) -> None:
            pass

    torch.cuda.current_stream = lambda *args, **kwargs: Stream()
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def with_step(self, model_param, tensors):
        return set_states(self, model_param, {"step": None, **tensors})

    DistributedOptimizer._set_main_param_and_optimizer_states = with_step


def content_metadata(sharding: str = "fully_reshardable") -> dict:
    """``_build_sharded_state_dict_metadata`` with ``--use-distributed-optimizer`` and
    ``--dist-ckpt-optim-fully-reshardable`` (``sharding`` ``dp_reshardable``: without it)."""
    return {
        "distrib_optim_sharding_type": sharding,
        "distrib_optim_fully_reshardable_mem_efficient": False,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }


def plain_metadata() -> dict:
    """``_build_sharded_state_dict_metadata`` without a distributed optimizer."""
    return {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def setup(
    variant: Variant,
    spec: Spec,
    *,
    seed: int,
    hyper: dict,
    distributed: bool = True,
    bf16: bool = False,
    bucket_size: int | None = None,
):
    """The DDP-wrapped model, its optimizer (``distributed``, else Megatron-Core's ``FP32Optimizer``) and LR scheduler,
    as Megatron-LM's ``setup_model_and_optimizer`` builds them (constant LR: the scheduler's state is saved, but does
    not change the steps). ``bucket_size``: Megatron-LM's ``--overlap-grad-reduce --ddp-bucket-size`` (buckets of
    about that many elements), else one bucket."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    (model,) = mcore_gpt.build(variant, spec, seed=seed)
    if hasattr(model, "output_layer"):  # the last pipeline stage
        model.output_layer.gather_output = False  # the vocab-parallel loss takes this rank's logits, as in training
    model.train()
    if bf16:  # Megatron-LM's --bf16: the model in bf16 behind Float16Module, fp32 masters in the optimizer
        model.config.bf16, model.config.params_dtype = True, torch.bfloat16
        model = Float16Module(model.config, model)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size,
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        min_lr=MIN_LR,
        **hyper,
        clip_grad=1.0,
        use_distributed_optimizer=distributed,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    optimizer = get_megatron_optimizer(config, [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=100,
        lr_decay_style="constant", start_wd=hyper["weight_decay"], end_wd=hyper["weight_decay"], wd_incr_steps=100,
        wd_incr_style="constant",
    )  # fmt: skip
    return ddp, optimizer, scheduler


def ddp_args(args, ddp_config, bucket_size: int | None) -> None:
    """The args Megatron-LM records of the DDP config it built (``get_megatron_ddp_config``,
    ``resolve_ddp_bucket_size``), and the data-parallel size of the run."""
    from megatron.core import parallel_state as ps

    args.data_parallel_size = ps.get_data_parallel_world_size()
    args.overlap_grad_reduce = ddp_config.overlap_grad_reduce
    args.overlap_param_gather_with_optimizer_step = False
    args.ddp_bucket_size, args.ddp_num_buckets = bucket_size, None
    args.ddp_pad_buckets_for_high_nccl_busbw = ddp_config.pad_buckets_for_high_nccl_busbw
    args.num_distributed_optimizer_instances = ddp_config.num_distributed_optimizer_instances
    args.accumulate_allreduce_grads_in_fp32 = ddp_config.grad_reduce_in_fp32


def step_batch(variant: Variant, step: int) -> torch.Tensor:
    """Step ``step``'s batch (the same on every rank: data-parallel replicas see the whole batch)."""
    gen = torch.Generator().manual_seed(BATCH_SEED + 1000 * (step + 1))
    return torch.randint(0, variant.vocab, (BATCH, SEQ + 1), generator=gen)


def train_step(ddp, optimizer, variant: Variant, step: int) -> float:
    """One step of ``pretrain``'s ``train_step``: forward/backward, the gradient sync, the optimizer step."""
    ids = step_batch(variant, step)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(tokens, positions, mask, labels=labels).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok, "the optimizer skipped a step"
    return loss.item()


def synthetic_step(ddp, optimizer, variant: Variant, step: int) -> float:
    """A step of a pipeline-parallel run without the pipeline schedule: every stage's grad buffer filled with
    fixed pseudo-random gradients (by step and stage), then the gradient sync and the optimizer's step as after a
    backward pass; the loss is not computed (NaN)."""
    from megatron.core import parallel_state as ps

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    gen = torch.Generator().manual_seed(BATCH_SEED + 1000 * (step + 1) + ps.get_pipeline_model_parallel_rank())
    for buffer in ddp.buffers:
        buffer.grad_data.copy_(1e-2 * torch.randn(buffer.grad_data.shape, generator=gen))
    ddp.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok, "the optimizer skipped a step"
    return float("nan")


def global_names(ddp) -> dict:
    """Each parameter's name with its layer's global index (a pipeline stage numbers its layers from 0)."""
    model = getattr(ddp.module, "module", ddp.module)  # Float16Module
    names = {}
    for name, param in model.named_parameters():
        match = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
        if match:
            name = f"decoder.layers.{model.decoder.layers[int(match[1])].layer_number - 1}.{match[2]}"
        names[param] = name
    return names


def held_state(ddp, optimizer) -> dict:
    """Each parameter's (this tp rank's slice) fp32 master and moments as the distributed optimizer holds them, its
    data-parallel shards gathered by Megatron-Core's own ``get_parameter_state_dp_zero``, by parameter name."""
    (inner,) = optimizer.chained_optimizers
    names = global_names(ddp)
    if not hasattr(inner, "get_parameter_state_dp_zero"):  # FP32Optimizer: the weights are the masters
        state = inner.optimizer.state
        return {
            names[param]: {"param": param.detach().clone()} | {k: state[param][k].clone() for k in ADAM_STATE}
            for group in inner.optimizer.param_groups
            for param in group["params"]
        }
    world = inner.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
    out = {}
    for gbuf_idx, buffer in enumerate(inner.buffers):
        ((_, tensors),) = world[gbuf_idx].items()
        # the buckets coalesced: each one's unpadded elements after the ones before it
        begins = [sum(b.numel_unpadded for b in buffer.buckets[:i]) - b.offset for i, b in enumerate(buffer.buckets)]
        for param, (start, end, bucket) in buffer.param_index_map.items():
            start, end = start + begins[bucket], end + begins[bucket]
            out[names[param]] = {
                key: tensors[key][start:end].reshape(param.shape).clone()
                for key in ("param", *inner.optimizer_state_keys)
            }
    return out


def allocate_state(optimizer) -> None:
    """Workaround 4: the state a fresh torch Adam has after its first step, zeros and step 0, as the target of a
    load."""
    (inner,) = optimizer.chained_optimizers
    for group in inner.optimizer.param_groups:
        for param in group["params"]:
            state = inner.optimizer.state[param]
            state.update(exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param), step=torch.tensor(0.0))


def unshare_steps(optimizer) -> None:
    """Workaround 6: one step tensor per parameter, as torch Adam keeps it."""
    (inner,) = optimizer.chained_optimizers
    for state in inner.optimizer.state.values():
        state["step"] = state["step"].clone()


def groups(optimizer) -> list[dict]:
    """The torch optimizer's param groups' hyper-parameters (no params), as ``state_dict`` saves them."""
    (inner,) = optimizer.chained_optimizers
    plain = (int, float, bool, str, type(None))
    return [{k: v for k, v in g.items() if isinstance(v, plain) or k == "betas"} for g in inner.optimizer.param_groups]


def generate_state_dict(ddp, optimizer, scheduler, args, metadata: dict, *, iteration: int, loading: bool) -> dict:
    """``training/checkpointing.py`` ``generate_state_dict`` for ``torch_dist`` with the optimizer, ``metadata`` the
    checkpoint's content metadata (what ``sharded_state_dict`` builds the state for)."""
    from megatron.core import parallel_state as ps

    metadata = metadata | {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    state = megatron_lm.dist_state(
        [ddp.module],
        args,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )
    state["iteration"] = iteration
    state["model"] = ddp.module.sharded_state_dict(metadata=metadata)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def train(job: dict) -> None:
    from megatron.core import dist_checkpointing

    spec = Spec.from_json(job["spec"])
    variant, out, steps = spec.model(), Path(job["out"]), job["steps"]
    distributed = job.get("sharding", "fully_reshardable") != "none"  # none: Megatron-Core's FP32Optimizer
    bf16 = job.get("bf16", False)
    bucket_size = job.get("bucket_size")
    ddp, optimizer, scheduler = setup(
        variant, spec, seed=SEED, hyper=HYPER, distributed=distributed, bf16=bf16, bucket_size=bucket_size
    )
    step_fn = synthetic_step if spec.pp > 1 else train_step  # no pipeline schedule here
    before = [step_fn(ddp, optimizer, variant, step) for step in range(steps)]
    iter_dir = megatron_lm.iter_dir(out / "ckpt", steps)
    if dist.get_rank() == 0:
        iter_dir.mkdir(parents=True)
    dist.barrier()
    args = megatron_lm.megatron_args(variant, spec, ckpt_format="torch_dist")
    args.use_distributed_optimizer = distributed
    args.iteration, args.lr, args.weight_decay = steps, LR, HYPER["weight_decay"]
    ddp_args(args, ddp.ddp_config, bucket_size)
    metadata = content_metadata(job.get("sharding", "fully_reshardable")) if distributed else plain_metadata()
    args.dist_ckpt_optim_fully_reshardable = metadata.get("distrib_optim_sharding_type") == "fully_reshardable"
    state = generate_state_dict(ddp, optimizer, scheduler, args, metadata, iteration=steps, loading=False)
    dist_checkpointing.save(state, str(iter_dir), content_metadata=metadata)
    dist.barrier()
    if dist.get_rank() == 0:
        megatron_lm.write_tracker(out / "ckpt", steps)
    torch.save(
        {"state": held_state(ddp, optimizer), "groups": groups(optimizer)}, out / f"saved_rank{dist.get_rank()}.pt"
    )
    after = [step_fn(ddp, optimizer, variant, step) for step in range(steps, steps + job["more"])]
    if dist.get_rank() == 0:
        torch.save({"before": before, "losses": after, "tp": spec.tp, "steps": steps}, out / "reference.pt")


def resume(job: dict) -> None:
    from megatron.core import dist_checkpointing

    spec = Spec.from_json(job["spec"])
    variant = spec.model()
    iter_dir = megatron_lm.resolve_iteration_dir(Path(job["ckpt"]))
    ddp, optimizer, scheduler = setup(variant, spec, seed=SEED + 1, hyper=OTHER, bf16=job.get("bf16", False))
    common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    with_optimizer = job["optimizer"]
    if with_optimizer:
        allocate_state(optimizer)
    request = generate_state_dict(
        ddp, optimizer if with_optimizer else None, scheduler, common["args"], metadata, iteration=0, loading=True
    )
    request.pop("rng_state")  # a run at another tp ignores it (load_checkpoint: "RNG state will be ignored")
    loaded = dist_checkpointing.load(request, str(iter_dir), strict="assume_ok_unexpected")
    ddp.module.load_state_dict(loaded["model"], strict=True)
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        unshare_steps(optimizer)
        scheduler.load_state_dict(loaded["opt_param_scheduler"])  # load_checkpoint: a KeyError without it
    state = held_state(ddp, optimizer) if with_optimizer else None  # a fresh optimizer holds nothing yet
    held_groups = groups(optimizer)
    start = int(common["iteration"])
    losses = [train_step(ddp, optimizer, variant, step) for step in range(start, start + job["steps"])]
    result = {"losses": losses, "state": state, "groups": held_groups, "iteration": common["iteration"]}
    result["metadata"] = metadata
    torch.save(result, f"{job['out']}.rank{dist.get_rank()}")


def run(jobs: list[dict]) -> None:
    from megatron.core import parallel_state as ps

    for job in jobs:
        spec = Spec.from_json(job["spec"])
        ps.initialize_model_parallel(tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp)
        {"train": train, "resume": resume}[job["command"]](job)
        dist.barrier()
        ps.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["jobs"])
    parser.add_argument("jobs_file", type=Path)
    opts = parser.parse_args()
    jobs = json.loads(opts.jobs_file.read_text())
    mcore_gpt.cpu_workarounds()
    cpu_training_workarounds()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    try:
        run(jobs)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
