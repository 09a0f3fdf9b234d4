"""Run under ``torchrun --nproc-per-node N``: load models with transformers' own TP loader and write what each
rank holds (``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`` on CPU, gloo).

    torchrun --nproc-per-node 4 tests/oracles/tp_loader_worker.py OUT MODEL_DIR=ModelClass [MODEL_DIR=ModelClass ...]

For each model, rank r writes ``OUT/<model dir name>/rank_XX.safetensors``: every parameter as the rank holds
it (a DTensor's local tensor, a replicated one whole), under the names ``save_pretrained`` writes (transformers'
own ``revert_weight_conversion`` applied to the local tensors: a fused ``experts.gate_up_proj`` slice becomes
the rank's per-expert ``gate_proj`` / ``up_proj`` slices), so they compare with reshard's rank files; and
``memory_rank_XX.safetensors``: the same under the names of the model in memory (fused experts stay fused).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import revert_weight_conversion
from transformers.distributed import DistributedConfig


def main(out: Path, models: list[str]) -> None:
    for spec in models:
        folder, class_name = spec.split("=")
        model = getattr(transformers, class_name).from_pretrained(
            folder, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32
        )
        local = {}
        for name, tensor in model.state_dict().items():
            if isinstance(tensor, DTensor):
                tensor = tensor.to_local()
            local[name] = tensor.detach().clone().contiguous()
        target = out / Path(folder).name
        target.mkdir(parents=True, exist_ok=True)
        rank = torch.distributed.get_rank()
        save_file(local, target / f"memory_rank_{rank:02d}.safetensors")
        saved = {name: t.contiguous() for name, t in revert_weight_conversion(model, local).items()}
        save_file(saved, target / f"rank_{rank:02d}.safetensors")
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
