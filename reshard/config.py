"""The model's dimensions, read from ``config.json`` (or built by a layout from its own metadata).

Plans and inference ask this object for sizes by name (``hidden_size``, ``head_dim``, ...) so that no
part size is a literal in the code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError

CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class ModelConfig:
    """A model config: the raw mapping plus the derived sizes reshard needs.

    Multimodal configs keep the language model under ``text_config``; sizes are looked up there first.
    """

    raw: dict[str, Any] = field(repr=False)
    path: Path | None = None

    def get(self, key: str, default: Any = None) -> Any:
        """A value from ``text_config`` if present there, else from the top level."""
        text = self.raw.get("text_config")
        if isinstance(text, dict) and key in text:
            return text[key]
        return self.raw.get(key, default)

    @property
    def model_type(self) -> str | None:
        return self.raw.get("model_type")

    @property
    def architectures(self) -> list[str]:
        return list(self.raw.get("architectures") or [])

    @property
    def vocab_size(self) -> int | None:
        return self.get("vocab_size")

    @property
    def hidden_size(self) -> int | None:
        return self.get("hidden_size")

    @property
    def num_attention_heads(self) -> int | None:
        return self.get("num_attention_heads")

    @property
    def num_key_value_heads(self) -> int | None:
        return self.get("num_key_value_heads") or self.num_attention_heads

    @property
    def head_dim(self) -> int | None:
        explicit = self.get("head_dim")
        if explicit:
            return explicit
        if self.hidden_size and self.num_attention_heads:
            return self.hidden_size // self.num_attention_heads
        return None

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.get("tie_word_embeddings", False))

    def named_sizes(self) -> dict[str, int]:
        """Sizes a tensor dim may legitimately add up to, by a readable name (for inference)."""
        sizes: dict[str, int] = {}
        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size"):
            value = self.get(key)
            if isinstance(value, int) and value > 0:
                sizes[key] = value
        heads, kv_heads, head_dim = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        if heads and head_dim:
            sizes["num_attention_heads*head_dim"] = heads * head_dim
        if kv_heads and head_dim:
            sizes["num_key_value_heads*head_dim"] = kv_heads * head_dim
        if heads and kv_heads and head_dim:
            sizes["(num_attention_heads+2*num_key_value_heads)*head_dim"] = (heads + 2 * kv_heads) * head_dim
        if "intermediate_size" in sizes:
            sizes["2*intermediate_size"] = 2 * sizes["intermediate_size"]
        return sizes

    def with_vocab_size(self, vocab_size: int) -> dict[str, Any]:
        """A copy of the raw config with ``vocab_size`` set wherever the config keeps it."""
        raw = json.loads(json.dumps(self.raw))
        text = raw.get("text_config")
        if isinstance(text, dict) and "vocab_size" in text:
            text["vocab_size"] = vocab_size
        if "vocab_size" in raw or not isinstance(text, dict):
            raw["vocab_size"] = vocab_size
        return raw


def load_config(path: Path) -> ModelConfig:
    """Read a ``config.json`` (or a ``.toml`` job config: torchtitan's, whose ``[model]`` describes the model);
    a file that is not a JSON object / TOML table is a :class:`CorruptFileError`."""
    try:
        text = path.read_text()
        raw = _toml_loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as err:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise CorruptFileError(f"cannot read the config: {err}", path=path) from err
    if not isinstance(raw, dict):
        raise CorruptFileError("the config is not a JSON object", path=path)
    return ModelConfig(raw, path)


def _toml_loads(text: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def find_config(ckpt: Path, explicit: Path | None = None, *, levels: int = 3) -> ModelConfig | None:
    """``explicit`` if given, else the first ``config.json`` in ``ckpt`` or up to ``levels`` folders above."""
    if explicit is not None:
        return load_config(explicit)
    folder = ckpt if ckpt.is_dir() else ckpt.parent
    for candidate in [folder, *folder.parents][: levels + 1]:
        if (candidate / CONFIG_NAME).is_file():
            return load_config(candidate / CONFIG_NAME)
    return None
