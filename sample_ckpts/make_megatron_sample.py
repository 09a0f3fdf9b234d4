"""Regenerate ``tiny-megatron-tp8/``, deterministically (fixed seed, written the way Megatron-LM lays it out).

    python sample_ckpts/make_megatron_sample.py

A tiny mcore GPT (hidden 64, 8 heads in 2 query groups, SwiGLU, 2 layers, true vocab 500, float32)
saved at TP=8 in Megatron's ``torch`` format: ``latest_checkpointed_iteration.txt`` and
``iter_0000100/mp_rank_XX/model_optim_rng.pt`` holding ``args`` (an ``argparse.Namespace``),
``checkpoint_version``, ``iteration``, ``model`` and a stand-in ``optimizer``. The vocab tables are
padded to 512 rows (``make_vocab_size_divisible_by`` 64 x tp 8); the args do not record the true vocab.
"""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the checkpoint builders shared with the tests and bench/

from fixtures.megatron import Sizes, full_model, megatron_args, write_megatron  # noqa: E402

TP, ITERATION = 8, 100
SIZES = Sizes(hidden=64, heads=8, groups=2, head_dim=8, ffn=128, layers=2, vocab=500, multiple=64)


def model() -> dict:
    """Canonical tensors by part, random from seed 0; the vocab tables hold their 512 padded rows (trained too)."""
    return full_model(SIZES, seed=0, vocab_rows=SIZES.padded_vocab(TP))


def fp8_meta(layer: int, rank: int, tp: int) -> dict[str, object]:
    """Transformer Engine's ``_extra_state`` of the fused QKV (a BytesIO blob)."""
    return {"self_attention.linear_qkv": io.BytesIO(f"fp8 meta l{layer} r{rank}".encode())}


def main(out: Path = HERE) -> None:
    """Write ``tiny-megatron-tp8/`` into ``out`` (by default beside this script, replacing it)."""
    target = out / "tiny-megatron-tp8"
    shutil.rmtree(target, ignore_errors=True)
    write_megatron(
        target,
        model(),
        TP,
        sizes=SIZES,
        iteration=ITERATION,
        args=megatron_args(SIZES, TP),
        model_type=False,
        extra_state=fp8_meta,
        training_state={"optimizer": {"param_groups": [{"lr": 1e-4}]}},
    )


if __name__ == "__main__":
    main()
