"""The model's dimensions, read from ``config.json`` (or built by a layout from its own metadata), the base of the
typed facts a layout reads beside it (:class:`SourceFacts`), and the tokenizer a source names
(:class:`NamedTokenizer`; its files are read by :mod:`reshard.formats.tokenizer`).

Plans and inference ask this object for sizes by name (``hidden_size``, ``head_dim``, ...) so that no
part size is a literal in the code.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError
from reshard.schema import check_config_sizes

CONFIG_NAME = "config.json"


TEXT = "text_config"
# Module names under which composite models keep a sub-model, and the config keys that size it (besides
# ``<name>_config``, which is tried first: ``thinker`` -> ``thinker_config``).
SUB_MODELS: dict[str, tuple[str, ...]] = {
    "language_model": (TEXT,),
    "text_model": (TEXT,),
    "llm": (TEXT,),
    "visual": ("vision_config",),
    "vision_tower": ("vision_config",),
    "vision_model": ("vision_config",),
    "vision_encoder": ("vision_config",),
    "audio_tower": ("audio_config",),
    "audio_model": ("audio_config",),
    "audio_encoder": ("audio_config",),
    "code2wav_dit_model": ("dit_config",),
    "code2wav_bigvgan_model": ("bigvgan_config",),
    "encoder": ("encoder",),  # an encoder-decoder's halves, each a config (T5Gemma 2)
    "decoder": ("decoder",),
}


@dataclass(frozen=True)
class ModelConfig:
    """A model config: the raw mapping plus the derived sizes reshard needs.

    Composite (multimodal) configs nest one config per sub-model (``text_config``, ``vision_config``,
    ``thinker_config.text_config``, ...): :meth:`for_tensor` gives the one that sizes a tensor, chosen by the
    sub-model names in its path. Sizes asked of the whole config come from the language model's.

    Attributes:
        raw: the mapping (for a sub-config, that sub-config's).
        path: the ``config.json`` it came from.
        scope: where ``raw`` sits in the file, e.g. ``thinker_config.text_config`` ("" for the whole file).
        parents: the enclosing mappings a language-model scope falls back to (published configs repeat
            some text sizes at the top level, older ones keep them only there).
    """

    raw: dict[str, Any] = field(repr=False)
    path: Path | None = None
    scope: str = ""
    parents: tuple[dict[str, Any], ...] = field(default=(), repr=False)
    _scopes: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def get(self, key: str, default: Any = None) -> Any:
        """A value from the language model's config if it has one (``text_config``, ``thinker_config.
        text_config``), else from this mapping, else from the enclosing ones of a language-model scope."""
        for mapping in (*_text_chain(self.raw), self.raw, *self.parents):
            if key in mapping:
                return mapping[key]
        return default

    def for_tensor(self, name: str) -> ModelConfig:
        """The sub-config that sizes tensor ``name``: each sub-model name in its path (``thinker``, ``visual``,
        ``audio_tower``, ``language_model``, ...) enters that sub-model's config; what is under none of them
        belongs to the language model (``lm_head``, ``model.layers``).

        Example:
            >>> config = ModelConfig({"text_config": {"hidden_size": 8}, "vision_config": {"hidden_size": 4}})
            >>> config.for_tensor("model.visual.blocks.0.attn.qkv.weight").scope
            'vision_config'
            >>> config.for_tensor("lm_head.weight").get("hidden_size")
            8
        """
        if self.scope:
            return self
        module = name.rpartition(".")[0]  # a parameter's own name is no sub-model; checks ask for thousands
        if module not in self._scopes:
            self._scopes[module] = self._scope_of(module)
        return self.sub_config(self._scopes[module])

    def _scope_of(self, module: str) -> str:
        raw, keys = self.raw, []
        for segment in module.split("."):
            for key in (f"{segment}_config", *SUB_MODELS.get(segment, ())):
                if isinstance(raw.get(key), dict):
                    raw = raw[key]
                    keys.append(key)
                    break
        while isinstance(raw.get(TEXT), dict):
            raw = raw[TEXT]
            keys.append(TEXT)
        return ".".join(keys)

    def sub_config(self, scope: str) -> ModelConfig:
        """The sub-config at ``scope`` (a :attr:`scope` that :meth:`for_tensor` gave); the whole one for ""."""
        if not scope or self.scope:
            return self
        raw = self.raw
        parents: list[dict[str, Any]] = []
        for key in scope.split("."):
            parents.insert(0, raw)
            raw = raw[key]
        return ModelConfig(raw, self.path, scope, tuple(parents) if scope.endswith(TEXT) else ())

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
        chain = _text_chain(raw)
        text = next((mapping for mapping in chain if "vocab_size" in mapping), None)
        if text is not None:
            text["vocab_size"] = vocab_size
        if "vocab_size" in raw or not chain:
            raw["vocab_size"] = vocab_size
        return raw


def _text_chain(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The language model's configs inside ``raw``, innermost first (``thinker_config.text_config``, then
    ``thinker_config``), for a whole composite config; empty when ``raw`` holds no ``text_config``."""
    chain: list[dict[str, Any]] = []
    if isinstance(raw.get("thinker_config"), dict):
        raw = raw["thinker_config"]
        chain.insert(0, raw)
    if isinstance(raw.get(TEXT), dict):
        chain.insert(0, raw[TEXT])
    return chain


def load_config(path: Path) -> ModelConfig:
    """Read a ``config.json`` (or a ``.toml`` job config: torchtitan's, whose ``[model]`` describes the model);
    a file that is not a JSON object / TOML table is a :class:`CorruptFileError`."""
    try:
        text = path.read_text()
        raw = _toml_loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:  # JSON/TOML decode errors are ValueErrors
        raise CorruptFileError(f"cannot read the config: {str(err) or type(err).__name__}", path=path) from err
    if not isinstance(raw, dict):
        raise CorruptFileError("the config is not a JSON object", path=path)
    check_config_sizes(raw, path=path)
    return ModelConfig(raw, path)


def _toml_loads(text: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
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


@dataclass(frozen=True, kw_only=True)
class SourceFacts:
    """What a layout read beside the tensors and the config that a writer or a mapping uses; each layout that
    reads more (an iteration, a tracker, rank file names, a framework's arguments) subclasses it. It lives in the
    domain, not with the layouts, so that a family's facts (:class:`reshard.megatron.facts.MegatronFacts`) can be
    read and made by the mappings and the engine, which import no layout package."""


# NamedTokenizer.kind of a Hugging Face tokenizer folder (Megatron's HuggingFaceTokenizer, NeMo's context).
HF_TOKENIZER = "HuggingFaceTokenizer"


@dataclass(frozen=True)
class NamedTokenizer:
    """The tokenizer a source names (Megatron's args, NeMo's context).

    Attributes:
        name: as the source names it (a path, a Hub id, a Megatron tokenizer's files), for messages; "" when the
            args name a Megatron tokenizer's type but not its files.
        origin: which field names it (``the args' tokenizer_model``).
        folder: a Hugging Face tokenizer's folder, when it is on this machine.
        kind: :data:`HF_TOKENIZER`, or the Megatron-LM tokenizer whose ids a transformers tokenizer made from
            ``files`` gives (see :mod:`reshard.mappings.megatron.tokenizer`).
        files: a Megatron tokenizer's files, when they are on this machine (``vocab_file`` and ``merge_file``, or
            ``tokenizer_model``).
        refused: why no transformers tokenizer gives this one's ids (None: it can be carried).
        extra_ids: Megatron's ``vocab_extra_ids`` (``<extra_id_N>`` tokens its SentencePieceTokenizer appends).
        core: Megatron-Core's tokenizer system made the ids, not Megatron-LM's legacy tokenizers.
    """

    name: str
    origin: str
    folder: Path | None = None
    kind: str = HF_TOKENIZER
    files: tuple[Path, ...] = ()
    refused: str | None = None
    extra_ids: int = 0
    core: bool = False
