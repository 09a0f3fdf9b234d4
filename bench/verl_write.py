"""Write a verl FSDP2 actor as verl writes it, for comparing ``reshard convert`` with verl's own merger
(``bench/verl_merge.py``; the measured figures: bench/RESULTS.md, "verl actors").

Run on CPU with gloo (``tests/`` on the path, for ``fixtures.verl_writer``)::

    OMP_NUM_THREADS=1 PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/verl_write.py OUT [large]

A random Llama (hidden 512, 8 layers, vocab 32000, untied: 58.5M parameters; ``large``: hidden 1024, 16 layers,
268M) in fp32, wrapped as verl's ``apply_fsdp2`` wraps it with verl's placement function, one AdamW step, saved as
``FSDPCheckpointManager.save_checkpoint`` saves it into ``OUT/actor`` (``fixtures.verl_writer``).
"""

import sys
from pathlib import Path

import torch.distributed as dist
from fixtures.tokenizer import tiny_tokenizer
from fixtures.verl_writer import save_checkpoint, trained
from torch.distributed.device_mesh import init_device_mesh
from transformers import GenerationConfig, LlamaConfig

out = Path(sys.argv[1])
dist.init_process_group("gloo")
SIZES = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8}
if sys.argv[2:] == ["large"]:
    SIZES = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16}
source = out / "source"
if dist.get_rank() == 0:
    LlamaConfig(vocab_size=32000, num_key_value_heads=8, tie_word_embeddings=False, **SIZES).save_pretrained(source)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(source)
    tiny_tokenizer(source)
dist.barrier()
config = LlamaConfig.from_pretrained(source)
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
model, optimizer, scheduler = trained(config, mesh)
save_checkpoint(out / "actor", model, optimizer, scheduler, source)
dist.destroy_process_group()
