"""verl's own merge of an FSDP actor, as its source runs it, for comparing with ``reshard convert`` (figures:
bench/RESULTS.md, "verl actors"): ``python bench/verl_merge.py ACTOR OUT``.

``FSDPModelMerger._load_and_merge_state_dicts`` of ``verl/model_merger/fsdp_model_merger.py`` (verl
b178a3cd56f58b2d502255daba591e92833930a7), copied with its logic unchanged (verl's package does not install beside
this project's pins): every rank file loaded at once on a thread pool with ``weights_only=False``, every local
tensor cast to bfloat16, DTensors concatenated on their placement's dim, other tensors on dim 0; then the merged
state dict saved as safetensors (verl's ``save_hf_model_and_tokenizer`` saves it with ``save_pretrained``).
"""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

actor, out = Path(sys.argv[1]), Path(sys.argv[2])
world_size = json.loads((actor / "fsdp_config.json").read_text())["world_size"]
model_state_dict_lst = [None] * world_size


def process_one_shard(rank, model_state_dict_lst):
    model_path = actor / f"model_world_size_{world_size}_rank_{rank}.pt"
    state_dict = torch.load(model_path, map_location="cpu", weights_only=False)
    model_state_dict_lst[rank] = state_dict
    return state_dict


with ThreadPoolExecutor(max_workers=min(32, os.cpu_count())) as executor:
    for future in [executor.submit(process_one_shard, rank, model_state_dict_lst) for rank in range(world_size)]:
        future.result()
state_dict, param_placements = {}, {}
for key in set(model_state_dict_lst[0].keys()):
    state_dict[key] = []
    for model_state_shard in model_state_dict_lst:
        tensor = model_state_shard.pop(key)
        if isinstance(tensor, DTensor):
            state_dict[key].append(tensor._local_tensor.bfloat16())
            param_placements.setdefault(key, tuple(tensor.placements))
        else:
            state_dict[key].append(tensor.bfloat16())
del model_state_dict_lst
for key in sorted(state_dict):
    if key in param_placements:
        placement = param_placements[key][0]
        shards = state_dict[key]
        state_dict[key] = shards[0] if placement.is_replicate() else torch.cat(shards, dim=placement.dim).contiguous()
    else:
        state_dict[key] = torch.cat(state_dict[key], dim=0)
out.mkdir(parents=True, exist_ok=True)
save_file(state_dict, out / "model.safetensors")
