"""torchtitan's Llama 3 flavors: the model arguments ``--model.flavor`` (a job TOML's ``[model] flavor``) names.

Copied from pytorch/torchtitan at b5bcd76c (2026-08-21), ``torchtitan/models/llama3/__init__.py``
(``llama3_configs``: ``_debugmodel``, ``_1b``, ``_3b``, ``_8b``, ``_70b``, ``_405b``); the numbers are those of
``llama3_args`` in v0.2.2 too (``torchtitan/models/llama3/__init__.py``), which had no 1B/3B and named the
attention variants ``debugmodel_flex_attn``, ``debugmodel_varlen_attn``, ``8B_flex``, ``8B_varlen``.

Every flavor: ``norm_eps`` 1e-5 (``RMSNorm``'s default), ``rope_theta`` 500000, RoPE scaled the Llama 3.1 way
(factor 8, low 1, high 4, original context 8192; since 5bbda42c, 2025-10-08, v0.2.0: torchtitan v0.1 and earlier
did not scale), ``head_dim = dim // n_heads``, ``n_kv_heads = n_heads`` unless stated, and the FFN size
``compute_ffn_hidden_dim(dim, multiple_of, ffn_dim_multiplier)``. The vocab size is not checked against the
flavor's: before 177b295d (2025-07-22) torchtitan took it from the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE_COMMIT = "b5bcd76c"
ROPE_THETA = 500000.0
NORM_EPS = 1e-5
MAX_SEQ_LEN = 131072


@dataclass(frozen=True)
class Flavor:
    """One entry of ``llama3_configs``."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int
    ffn_dim_multiplier: float | None = None
    tied: bool = False  # enable_weight_tying

    @property
    def hidden_dim(self) -> int:
        return compute_ffn_hidden_dim(
            self.dim, multiple_of=self.multiple_of, ffn_dim_multiplier=self.ffn_dim_multiplier
        )


def compute_ffn_hidden_dim(dim: int, *, multiple_of: int = 1, ffn_dim_multiplier: float | None = None) -> int:
    """torchtitan's SwiGLU size (``torchtitan/models/common/feed_forward.py``): 2/3 of 4 * dim, times the
    multiplier, rounded up to ``multiple_of``."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


FLAVORS: dict[str, Flavor] = {
    "debugmodel": Flavor(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, multiple_of=256),
    "1B": Flavor(2048, 16, 32, 8, 128256, multiple_of=1024, ffn_dim_multiplier=1.5, tied=True),
    "3B": Flavor(3072, 28, 24, 8, 128256, multiple_of=1024, ffn_dim_multiplier=1.0, tied=True),
    "8B": Flavor(4096, 32, 32, 8, 128256, multiple_of=1024, ffn_dim_multiplier=1.3),
    "70B": Flavor(8192, 80, 64, 8, 128256, multiple_of=4096, ffn_dim_multiplier=1.3),
    "405B": Flavor(16384, 126, 128, 8, 128256, multiple_of=4096, ffn_dim_multiplier=1.2),
}
# Older flavor names of the same models (attention backends, v0.2.x).
ALIASES = {
    "debugmodel_flex_attn": "debugmodel",
    "debugmodel_varlen_attn": "debugmodel",
    "8B_flex": "8B",
    "8B_varlen": "8B",
}


def flavor(name: str) -> Flavor | None:
    """The flavor ``name`` (or an older alias of it), or None."""
    return FLAVORS.get(ALIASES.get(name, name))
