"""Per-rank checkpoints written the way a TP trainer with vocab padding writes them (independent of reshard).

The vocab tensors are padded to a multiple of ``pad_multiple * tp`` rows (ColossalAI's default
``make_vocab_size_divisible_by`` is 64) with non-zero junk, so a fix that kept a pad row would show.
Other tensors follow the Llama TP plan: q/k/v/gate/up column-parallel (dim 0), o/down row-parallel
(dim 1), norms replicated. Every slice is cloned, as each rank owns its parameters.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from helpers import tiny_llama
from safetensors.torch import load_file, save_file

COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$")
ROW = re.compile(r"(o_proj|down_proj)\.weight$")
VOCAB = re.compile(r"(embed_tokens|lm_head)\.weight$")


def padded_rows(vocab: int, tp: int, pad_multiple: int = 64) -> int:
    step = pad_multiple * tp
    return -(-vocab // step) * step


def rank_states(state: dict[str, torch.Tensor], tp: int, *, pad_multiple: int = 64, seed: int = 7):
    """The ``tp`` rank state dicts of a full Llama state dict, vocab padded with junk rows."""
    junk = torch.Generator().manual_seed(seed)
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, tensor in state.items():
        if VOCAB.search(name):
            rows = padded_rows(tensor.shape[0], tp, pad_multiple)
            pad = torch.rand(rows - tensor.shape[0], *tensor.shape[1:], generator=junk).to(tensor.dtype) + 3
            pieces = torch.cat([tensor, pad]).chunk(tp, dim=0)
        elif COLUMN.search(name):
            pieces = tensor.chunk(tp, dim=0)
        elif ROW.search(name):
            pieces = tensor.chunk(tp, dim=1)
        else:
            pieces = [tensor] * tp
        for r, piece in enumerate(pieces):
            ranks[r][name] = piece.clone().contiguous()
    return ranks


def write_ranks(
    model_dir: Path,
    out: Path,
    tp: int,
    *,
    name: str = "pytorch_model_rank{r}.bin",
    ranks: list[int] | None = None,
    config: dict | None = None,
    pad_multiple: int = 64,
) -> Path:
    """Write ranks of the HF model in ``model_dir`` to ``out`` as files named ``name`` (may hold a folder).

    ``ranks`` limits which rank files are written (to simulate missing ones); ``config`` replaces config.json.
    """
    state = load_file(model_dir / "model.safetensors")
    out.mkdir(parents=True)
    for r, rank_state in enumerate(rank_states(state, tp, pad_multiple=pad_multiple)):
        if ranks is not None and r not in ranks:
            continue
        path = out / name.format(r=r)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            save_file(rank_state, path, metadata={"format": "pt"})
        else:
            torch.save(rank_state, path)
    if config is None:
        shutil.copy(model_dir / "config.json", out / "config.json")
    else:
        (out / "config.json").write_text(json.dumps(config))
    return out


def llama_65535(path: Path, *, vocab: int = 65535, seed: int = 0):
    """A random ``LlamaForCausalLM`` with a 65535 vocab, hidden 16, 8 heads (splits 8 ways), one layer."""
    return tiny_llama(
        path,
        vocab=vocab,
        seed=seed,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        max_position_embeddings=32,
    )
