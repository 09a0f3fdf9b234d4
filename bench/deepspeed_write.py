"""Write a ZeRO-2 or ZeRO-3 checkpoint with DeepSpeed itself, for comparing ``reshard convert`` with DeepSpeed's own
``zero_to_fp32.py`` (the measured figures: bench/RESULTS.md, "DeepSpeed ZeRO").

Run in a venv with deepspeed (the tests' one: ``tests/fixtures/deepspeed.py``), on CPU with gloo::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 bench/deepspeed_write.py OUT 3

A random Llama (hidden 512, 8 layers, vocab 32000, untied: 58.5M parameters) in bf16 with two parameter groups,
one AdamW step, saved to OUT (``latest``, ``global_step1/``, ``config.json``). A third argument ``large``: hidden 1024,
16 layers (268M parameters, 3.8 GB with the optimizer state).
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

stage = int(sys.argv[2])
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
SIZES = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8}
if sys.argv[3:] == ["large"]:  # 268M parameters: a 3.8 GB checkpoint, optimizer state included
    SIZES = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16}
cfg = LlamaConfig(vocab_size=32000, num_key_value_heads=8, tie_word_embeddings=False, **SIZES)
model = LlamaForCausalLM(cfg)
if dist.get_rank() == 0:
    cfg.save_pretrained(sys.argv[1])
named = list(model.named_parameters())
groups = [
    {"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1},
    {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0},
]
config = {
    "train_batch_size": dist.get_world_size(),
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": stage},
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_allow_untested_optimizer": True,
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
ids = torch.randint(0, 32000, (1, 8))
loss = engine(input_ids=ids, labels=ids).loss
engine.backward(loss)
engine.step()
engine.save_checkpoint(sys.argv[1])
