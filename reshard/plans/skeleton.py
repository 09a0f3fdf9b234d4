"""The model transformers builds for a config, on the ``meta`` device: its parameters, its TP plan, which
of its sub-models (vision tower, audio encoder, talker, ...) the plan leaves out, the checkpoint names it renames
on load and the attention layers built with heads of their own. No memory, no data.

The class is the one ``architectures`` names, else the auto class for the config: image-text-to-text and
multimodal first (a composite config builds its whole model, towers included), then causal LM, then the
bare model. A model without a plan (``_tp_plan`` None, as Qwen2.5-Omni had) has an empty one.

Importing transformers and building costs seconds of CPU and 100 MB or more (measured: docs/performance.md), the
same every time for the same config and the same code, so the answer is kept in reshard's cache
(``io/user_cache.py``) under a key of everything it depends on (``plans/skeleton_key.py``); an entry is checked field
by field before it is trusted.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.io import user_cache
from reshard.plans.skeleton_key import skeleton_key

AUTO_CLASSES = ("AutoModelForImageTextToText", "AutoModelForMultimodalLM", "AutoModelForCausalLM", "AutoModel")
KIND = "skeletons"  # the cache's folder for them
# a cache entry's, in this order
FIELDS = ("tp_plan", "shapes", "model_class", "sub_models", "tied", "loaded_as", "heads")


@dataclass(frozen=True)
class SubModel:
    """A sub-model of a composite model (a module with a config of its own): its module path, class, and
    whether transformers' TP plan covers it."""

    prefix: str
    model_class: str
    has_plan: bool


@dataclass(frozen=True)
class ModelSkeleton:
    """The model transformers would build for a config: its TP plan and parameter shapes (no data).

    ``tp_plan`` is None when the model has no plan at all; ``sub_models`` lists the sub-models the plan
    leaves out (outermost first: a sub-model without a plan hides its own sub-models); ``tied`` names the tensors
    tied to another (``lm_head.weight`` with ``tie_word_embeddings``), which a checkpoint may leave out;
    ``loaded_as`` maps a checkpoint name that transformers renames on load to the model's name it loads as
    (GPT-NeoX's ``embed_out.weight`` -> ``lm_head.weight``), which is the name its TP plan is matched against;
    ``heads`` gives the attention modules whose own head count (``num_heads``) is not the config's
    ``num_attention_heads`` (dots3's sliding-window layers: 64 heads, the others 128).
    """

    tp_plan: dict[str, str] | None
    shapes: dict[str, tuple[int, ...]]
    model_class: str
    sub_models: tuple[SubModel, ...] = ()
    tied: frozenset[str] = frozenset()
    loaded_as: dict[str, str] = field(default_factory=dict)
    heads: dict[str, int] = field(default_factory=dict)

    def without_plan(self) -> list[SubModel]:
        return [s for s in self.sub_models if not s.has_plan]

    def sub_model_of(self, name: str) -> SubModel | None:
        """The innermost listed sub-model whose path ``name`` is under."""
        found = [s for s in self.sub_models if name.startswith(s.prefix + ".")]
        return max(found, key=lambda s: len(s.prefix), default=None)


def build_skeleton(config: ModelConfig | None) -> ModelSkeleton:
    """Instantiate the config's model on the ``meta`` device for its plan, shapes and sub-models; the answer (or
    transformers' refusal) comes from reshard's cache when this config was built before with the same code
    (:func:`cached_skeleton`), and is stored there when not.

    Raises:
        ReshardError: transformers is missing, does not know the model type, or cannot build the model
            from this config (the message gives transformers' own reason).
    """
    if config is None or not config.model_type:
        raise ReshardError("the transformers plan needs a config.json with a model_type", hint="pass --config FILE")
    key = skeleton_key(config.raw)
    known = _cached(key, config)
    if isinstance(known, ReshardError):
        raise known
    if known is not None:
        return known
    try:
        with _torch_cache_in_a_temporary_folder():
            skeleton = _build(config)
    except ReshardError as err:
        # a refusal of the config itself is as lasting as an answer; a missing module, a file or the network is not
        if key is not None and not isinstance(err.__cause__, (ImportError, OSError, MemoryError)):
            user_cache.save(KIND, key, {"refusal": [err.detail, err.path is not None, err.hint]})
        raise
    if key is not None:
        user_cache.save(KIND, key, {"skeleton": _to_json(skeleton)})
    return skeleton


def cached_skeleton(config: ModelConfig) -> ModelSkeleton | ReshardError | None:
    """What :func:`build_skeleton` answers for ``config`` if the cache holds it (its refusal as an exception
    object, not raised); None if it does not: a few milliseconds, no import."""
    return _cached(skeleton_key(config.raw), config) if config.model_type else None


def _cached(key: str | None, config: ModelConfig) -> ModelSkeleton | ReshardError | None:
    """The answer the cache holds under ``key`` (a refusal given ``config``'s path), checked; None if none is."""
    stored = None if key is None else user_cache.load(KIND, key)
    if not isinstance(stored, dict) or len(stored) != 1:
        return None
    if "skeleton" in stored:
        return _from_json(stored["skeleton"])
    refusal = stored.get("refusal")
    if isinstance(refusal, list) and len(refusal) == 3:
        detail, at_path, hint = refusal
        if isinstance(detail, str) and isinstance(at_path, bool) and (hint is None or isinstance(hint, str)):
            return ReshardError(detail, path=config.path if at_path else None, hint=hint)
    return None


def _to_json(skeleton: ModelSkeleton) -> dict[str, Any]:
    """A cache entry's value: :data:`FIELDS` in order, as JSON spells them."""
    return {
        "tp_plan": skeleton.tp_plan,
        "shapes": {name: list(shape) for name, shape in skeleton.shapes.items()},
        "model_class": skeleton.model_class,
        "sub_models": [[s.prefix, s.model_class, s.has_plan] for s in skeleton.sub_models],
        "tied": sorted(skeleton.tied),
        "loaded_as": skeleton.loaded_as,
        "heads": skeleton.heads,
    }


def _from_json(value: object) -> ModelSkeleton | None:
    """The skeleton a cache entry holds, every field's type checked (None: not one)."""
    if not isinstance(value, dict) or list(value) != list(FIELDS):
        return None
    plan, shapes, model_class, subs, tied, loaded_as, heads = (value[k] for k in FIELDS)
    plain_plan = plan is None or (isinstance(plan, dict) and all(isinstance(v, str) for v in plan.values()))
    plain_shapes = isinstance(shapes, dict) and all(
        isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) for shape in shapes.values()
    )
    plain_subs = isinstance(subs, list) and all(
        isinstance(s, list)
        and len(s) == 3
        and isinstance(s[0], str)
        and isinstance(s[1], str)
        and isinstance(s[2], bool)
        for s in subs
    )
    plain_tied = isinstance(tied, list) and all(isinstance(t, str) for t in tied)
    plain_loaded = isinstance(loaded_as, dict) and all(isinstance(v, str) for v in loaded_as.values())
    plain_heads = isinstance(heads, dict) and all(type(v) is int and v > 0 for v in heads.values())
    plain = plain_plan and plain_shapes and plain_subs and plain_tied and plain_loaded and plain_heads
    if not (plain and isinstance(model_class, str)):
        return None
    return ModelSkeleton(
        None if plan is None else dict(plan),
        {name: tuple(shape) for name, shape in shapes.items()},
        model_class,
        tuple(SubModel(*s) for s in subs),
        frozenset(tied),
        dict(loaded_as),
        dict(heads),
    )


@contextlib.contextmanager
def _torch_cache_in_a_temporary_folder() -> Iterator[None]:
    """Importing transformers imports ``torch._dynamo``, which makes its cache folder at import,
    ``$TMPDIR/torchinductor_<user>`` unless ``TORCHINDUCTOR_CACHE_DIR`` says otherwise: a folder reshard would leave
    in ``$TMPDIR`` (reshard compiles nothing). Until the build is done the folder is a temporary one, removed after."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ or "torch._dynamo" in sys.modules:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="reshard-torch-cache-") as folder:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
        try:
            yield
        finally:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def _build(config: ModelConfig) -> ModelSkeleton:
    """The meta build itself: imports transformers (the costly part) and builds the model."""
    try:
        import torch
        import transformers
        from transformers import CONFIG_MAPPING, PreTrainedModel
    except ImportError as err:  # pragma: no cover - transformers is a test dependency
        raise ReshardError(f"the transformers plan needs transformers installed ({err})") from err
    if config.model_type is None or config.model_type not in CONFIG_MAPPING:
        raise ReshardError(
            f"transformers {transformers.__version__} does not know model_type {config.model_type!r}", path=config.path
        )
    try:
        hf_config = CONFIG_MAPPING[config.model_type].from_dict(dict(config.raw))
        model_class = model_class_for(transformers, hf_config, config.architectures)
        with torch.device("meta"), _no_init_weights():  # shapes only: no initialising of meta tensors
            model = model_class(hf_config)
    except ReshardError:
        raise
    except Exception as err:  # transformers raises many types for a config it cannot build
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ReshardError(
            f"transformers cannot build {config.model_type!r} from it: {detail}", path=config.path
        ) from err
    plan = getattr(model, "_tp_plan", None)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    subs: list[SubModel] = []
    hidden: list[str] = []
    for name, module in model.named_modules():
        if not name or not isinstance(module, PreTrainedModel) or any(name.startswith(h + ".") for h in hidden):
            continue
        has_plan = bool(getattr(module, "_tp_plan", None))
        if not has_plan:
            hidden.append(name)
        own_config = module.config is not model.config  # not the base model a head class wraps
        if own_config and any(shape_name.startswith(name + ".") for shape_name in shapes):
            subs.append(SubModel(name, type(module).__name__, has_plan))
    tied = frozenset(getattr(model, "all_tied_weights_keys", None) or ())
    plan = None if plan is None else dict(plan)
    loaded_as = _loaded_as(model, list(shapes))
    return ModelSkeleton(plan, shapes, model_class.__name__, tuple(subs), tied, loaded_as, _own_heads(model, config))


def _own_heads(model: Any, config: ModelConfig) -> dict[str, int]:
    """Modules whose own head count (``num_heads``) is not the ``num_attention_heads`` of the config that sizes them:
    models with a config per layer (dots3's sliding-window layers) build some attention layers with other heads."""
    heads = {}
    for name, module in model.named_modules():
        count = getattr(module, "num_heads", None)
        if name and type(count) is int and count > 0:
            if count != config.for_tensor(f"{name}.weight").num_attention_heads:
                heads[name] = count
    return heads


def _loaded_as(model: Any, names: list[str]) -> dict[str, str]:
    """The checkpoint names transformers renames on load to ``names`` (its parameters), by transformers' own
    renamings for this model (``conversion_mapping.py``, by class and model type, sub-models' scoped): each name as
    ``save_pretrained`` writes it (the renamings reversed, as ``revert_weight_conversion`` does), kept only if
    the loader's ``rename_source_key`` turns it back into the name. Tensors a converter fuses or splits (per-expert
    weights) are left out: their names are not one-to-one, and the plan's per-expert rules cover them.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers before 5: no renaming on load before its TP plan is matched
        return {}
    try:
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            apply_renamings,
            rename_source_key,
        )
    except ImportError as err:  # it renames on load, but not in a way reshard can read: never a guess of none
        import transformers

        raise ReshardError(
            f"transformers {transformers.__version__} renames checkpoint names on load, and reshard cannot read "
            f"its renamings ({err})",
            hint="upgrade transformers (reshard is tested with 5.23)",
        ) from err
    loading = get_model_conversion_mapping(model)
    renamings = [t for t in loading if isinstance(t, WeightRenaming)]
    converters = [t for t in loading if isinstance(t, WeightConverter)]
    saving = [
        cast(WeightRenaming, t.reverse_transform())  # copy() keeps the class: a renaming reversed is one
        for t in get_model_conversion_mapping(model, add_legacy=False)[::-1]
        if isinstance(t, WeightRenaming) and not isinstance(t, PrefixChange)
    ]
    loaded_as = {}
    for name in names:
        saved = apply_renamings(name, saving)
        if saved != name and rename_source_key(saved, renamings, converters) == (name, None):
            loaded_as[saved] = name
    return loaded_as


def _no_init_weights() -> contextlib.AbstractContextManager:
    """transformers' own switch that skips weight initialisation (most of the time a meta build takes)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - transformers before 5
        return contextlib.nullcontext()
    return no_init_weights()


def model_class_for(transformers: Any, hf_config: Any, architectures: list[str]) -> type:
    """The class ``architectures`` names, else the first auto class of :data:`AUTO_CLASSES` that maps the config."""
    for name in architectures:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    for auto_name in AUTO_CLASSES:
        mapping = getattr(getattr(transformers, auto_name, None), "_model_mapping", None)
        if mapping is not None and type(hf_config) in mapping:
            return mapping[type(hf_config)]
    raise ReshardError(f"transformers has no model class for {type(hf_config).__name__}")
