"""Write DCP checkpoints with the real writer: ``torchrun --standalone --nproc-per-node 4 dcp_writer.py SRC OUT``.

SRC is a tiny Llama saved by transformers (``model.safetensors`` with HF names). Every variant is saved by
``torch.distributed.checkpoint`` from DTensors on a CPU gloo mesh of 4 ranks, and rank 0 saves the
tensors each variant must read back as, in ``OUT/<variant>.expected.pt``:

* ``tp2``: TP over 2 (a 2x2 mesh, replicated over dp), fp32, vocab 1001 split 501/500, torchtitan's
  layout: the model at the top level beside ``optimizer.*``, ``lr_scheduler``, ``dataloader``,
  ``train_state``; plus a non-tensor model entry;
* ``fsdp_tp_bf16``: bf16, ``parallelize_module`` (TP 2) then FSDP2 ``fully_shard`` (dp 2): the weights
  are ``_StridedShard`` DTensors; nested as in the DCP tutorial, ``{"model": ..., "optim": ...}``;
* ``tp4_bf16_nocoll``: bf16, TP over 4 (1001 -> 251/251/251/248), ``use_collectives=False``: one
  ``__{rank}.metadata`` per rank, replicated norms stored by every rank;
* ``safetensors``: ``tp2``'s model with ``SerializationFormat.SAFETENSORS`` (a pickled value before the blob);
* ``hf_sharded``: ``HuggingFaceStorageWriter(save_distributed=True)`` into two file indices, no metadata;
* ``misc``: a 2-D box grid, a stored transposed (strided) tensor, a 3-D tensor with an empty chunk,
  a 0-d tensor, int64 and fp16 tensors split unevenly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

COLUMN = ("embed_tokens", "lm_head", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # Shard(0)
ROW = ("o_proj", "down_proj")  # Shard(1)


def split_dim(name: str) -> int | None:
    if any(part in name for part in COLUMN):
        return 0
    if any(part in name for part in ROW):
        return 1
    return None


def tp(state: dict[str, torch.Tensor], mesh, lead: list) -> dict[str, torch.Tensor]:
    """Each tensor as a DTensor: ``lead`` placements, then Shard(dim) of the TP plan, or Replicate."""
    out = {}
    for name, tensor in state.items():
        dim = split_dim(name)
        out[name] = distribute_tensor(tensor, mesh, [*lead, Replicate() if dim is None else Shard(dim)])
    return out


class Llama(nn.Module):
    """The tiny Llama's parameters under their HF names, as modules TP and FSDP can be applied to."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(*state["model.embed_tokens.weight"].shape)
        self.model.layers = nn.ModuleList()
        layers = len({n.split(".")[2] for n in state if n.startswith("model.layers.")})
        for i in range(layers):
            layer, attn, mlp = nn.Module(), nn.Module(), nn.Module()
            for part, owner in (("q_proj", attn), ("k_proj", attn), ("v_proj", attn), ("o_proj", attn)):
                w = state[f"model.layers.{i}.self_attn.{part}.weight"]
                setattr(owner, part, nn.Linear(w.shape[1], w.shape[0], bias=False))
            for part in ("gate_proj", "up_proj", "down_proj"):
                w = state[f"model.layers.{i}.mlp.{part}.weight"]
                setattr(mlp, part, nn.Linear(w.shape[1], w.shape[0], bias=False))
            layer.self_attn, layer.mlp = attn, mlp
            for norm in ("input_layernorm", "post_attention_layernorm"):
                holder = nn.Module()
                holder.weight = nn.Parameter(torch.empty_like(state[f"model.layers.{i}.{norm}.weight"]))
                setattr(layer, norm, holder)
            self.model.layers.append(layer)
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.empty_like(state["model.norm.weight"]))
        self.lm_head = nn.Linear(*reversed(state["lm_head.weight"].shape), bias=False)
        self.load_state_dict(state)


def optimizer_state(model: dict[str, torch.Tensor]) -> dict:
    """An Adam-like state beside every weight (same placements), as torch's get_optimizer_state_dict nests it."""
    state = {
        name: {"exp_avg": t * 0.5 + 1, "exp_avg_sq": t * t, "step": torch.tensor(3.0)} for name, t in model.items()
    }
    return {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": sorted(model)}]}


def save(rank: int, out: Path, name: str, state: dict, expected: dict[str, torch.Tensor], **kwargs) -> None:
    if "storage_writer" not in kwargs:
        kwargs["checkpoint_id"] = out / name
    dcp.save(state, **kwargs)
    if rank == 0:
        torch.save(expected, out / f"{name}.expected.pt")


def main(source: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh4 = init_device_mesh("cpu", (4,))
    hf = load_file(source / "model.safetensors")

    model = tp(hf, mesh2, [Replicate()])
    extras = {
        "optimizer": optimizer_state(model),
        "lr_scheduler": {"last_epoch": 3},
        "dataloader": {f"dp_rank_{rank // 2}": b"position=1234"},
        "train_state": {"step": 3, "ntokens_seen": 4096},
        "model_version": "tiny-llama-1",
    }
    save(rank, out, "tp2", {**model, **extras}, hf)

    bf16 = {name: t.to(torch.bfloat16) for name, t in hf.items()}
    module = Llama(bf16).to(torch.bfloat16)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()), "lm_head": ColwiseParallel()}
    for i in range(len(module.model.layers)):
        plan |= {f"model.layers.{i}.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan |= {f"model.layers.{i}.mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")}
        plan |= {f"model.layers.{i}.self_attn.o_proj": RowwiseParallel()}
        plan |= {f"model.layers.{i}.mlp.down_proj": RowwiseParallel()}
    parallelize_module(module, mesh2["tp"], plan)
    fully_shard(module, mesh=mesh2["dp"])
    sharded = module.state_dict()
    optim = {"state": {n: {"exp_avg": t * 2} for n, t in sharded.items()}}
    save(rank, out, "fsdp_tp_bf16", {"model": sharded, "optim": optim}, bf16)

    save(rank, out, "tp4_bf16_nocoll", tp(bf16, mesh4, []), bf16, use_collectives=False)

    model_only = {**model, "model_version": "tiny-llama-1"}
    writer = FileSystemWriter(out / "safetensors", serialization_format=SerializationFormat.SAFETENSORS)
    save(rank, out, "safetensors", model_only, hf, storage_writer=writer)

    files = {name: 1 if name.startswith(("model.embed_tokens", "model.layers.0.")) else 2 for name in model}
    writer = HuggingFaceStorageWriter(str(out / "hf_sharded"), fqn_to_index_mapping=files, save_distributed=True)
    save(rank, out, "hf_sharded", model, hf, storage_writer=writer)

    misc = {
        "grid": torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12),
        "transposed": torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4).t(),
        "stacked": torch.arange(3 * 6 * 40, dtype=torch.float32).reshape(3, 6, 40) - 100,
        "scalar": torch.tensor(3.5),
        "ids": torch.arange(10, dtype=torch.int64) * 7,
        "half": (torch.arange(5 * 7, dtype=torch.float16) / 8).reshape(5, 7),
    }
    placed = {
        "grid": distribute_tensor(misc["grid"], mesh2, [Shard(0), Shard(1)]),
        "transposed": misc["transposed"],
        "stacked": distribute_tensor(misc["stacked"], mesh4, [Shard(1)]),
        "scalar": misc["scalar"],
        "ids": distribute_tensor(misc["ids"], mesh4, [Shard(0)]),
        "half": distribute_tensor(misc["half"], mesh4, [Shard(1)]),
    }
    save(rank, out, "misc", placed, misc)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
