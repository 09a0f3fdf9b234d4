"""``--plan transformers``: the installed transformers' own TP plan as reshard rules.

transformers keys its plan by module (or parameter) path with ``*`` for layer indices
(``model.layers.*.self_attn.q_proj``) and looks a parameter up by its own path first, then by its
parent module; a parameter the plan does not name is replicated. The styles map to partitions as
transformers' loader slices them (``nn.Linear`` weights are ``[out, in]``): ``colwise*`` -> dim -2 (bias
dim -1), ``rowwise*`` -> dim -1 (bias replicated), ``packed_colwise`` / ``packed_rowwise`` -> gate and up
halves split on their own, ``embedding_rowwise`` (and ``lm_head``) -> the vocab on dim 0, the
replicating styles -> replicate. transformers splits sizes that do not divide as ``torch.chunk`` does:
convert with ``--uneven`` to get the same per-rank tensors.

Attention projections whose output (or input) stays split are cut in whole heads, where the loader's rows are
whole heads only at a tp that divides them: the query and output projections in ``num_attention_heads`` heads of
``size / heads`` (any head width: MLA's too), the KV projections in heads of ``head_dim``. Another tp is refused
(``--uneven``: the loader's ``torch.chunk`` rows, part of a head on some ranks).

A plan key is matched after the language model's optional prefixes (``model.``, ``language_model.``, peft's
``base_model.model.``), since saved checkpoints and the model in memory name the language model differently
(``model.layers.`` vs ``model.language_model.layers.``), but never inside another sub-model: a vision
tower's ``encoder.layers.N.self_attn`` is not the language model's ``layers.N.self_attn``. A missing plan
(``_tp_plan`` None, as Qwen2.5-Omni had) is an empty plan, never an error.
"""

from __future__ import annotations

import re
from typing import Any

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Heads, Packed, Partition, Replicate, Shard, Vocab
from reshard.plans.base import Plan, Rule
from reshard.plans.llama import by_heads
from reshard.plans.skeleton import ModelSkeleton, build_skeleton

__all__ = ["NAME", "ModelSkeleton", "build_skeleton", "plan_from_skeleton", "plan_from_tp_plan", "transformers_plan"]

NAME = "transformers"
COLWISE = {"colwise", "colwise_rep", "colwise_gather_output", "local_colwise"}
ROWWISE = {"rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise"}
REPLICATED = {
    "replicate",
    "replicated_with_grad_allreduce",
    "sequence_parallel",
    "gather",
    "ep_router",
    "megamoe_router",
    "moe_tp_experts",
    "moe_identity_expert",
    "all_reduce",
    "all_reduce_output",
    "mla_kv_a_proj",  # DeepSeek's kv_a_proj_with_mqa: kept whole, only its gradient is reduced
    "local_params",  # runs its module on the parameters' own entries; slices nothing itself
}
GATHERED = {"colwise_rep", "colwise_gather_output"}
WHOLE_INPUT = {"rowwise_rep", "rowwise_split_input"}  # rowwise layers that split a whole input themselves
# Prefixes of the model in memory that saved checkpoints may lack (or spell otherwise).
_PREFIX = re.compile(r"^(model\.)?(language_model\.)?")
_ANY_PREFIX = r"^(base_model\.model\.)?(model\.)?(language_model\.)?(model\.)?"
_INDEX = re.compile(r"(?:(?<=\.)|^)(?:\*|\d+)(?=\.|$)")  # a layer index: ``*`` in a plan key, a number in a name
# A projection whose rank computes on its own heads (``colwise``: the output stays split; ``rowwise``: the input
# arrives split) is cut in whole heads, since transformers' loader chunks its rows and a rank holding part of a head
# computes something else; a gathered one (``colwise_gather_output``, ``rowwise_split_input``) is computed whole
# and keeps its rows. The query side (``q_proj``, its per-head gate included as in Qwen3-Next; MLA's ``q_b_proj``
# and ``kv_b_proj``; GPT-NeoX's ``query_key_value``, each head's q, k, v together) and the output side (the
# columns of ``o_proj``, Phi's and GPT-NeoX's ``dense``) hold ``num_attention_heads`` heads of ``size / heads``:
# ``head_dim``, or MLA's ``qk_head_dim``, ``qk_nope_head_dim + v_head_dim`` and ``v_head_dim``. The KV projections
# are cut in heads of ``head_dim``.
_QUERY_HEADS = re.compile(
    r"(self_attn\.(q_proj|q_b_proj|kv_b_proj|q_gate_proj|gate_proj|g_proj|gate_bias|sinks)|attention\.query_key_value)$"
)
_OUTPUT_HEADS = re.compile(r"(self_attn\.(o_proj|dense)|attention\.dense)$")
_KV_PROJECTIONS = re.compile(r"self_attn\.[kv]_proj$")


def transformers_plan(config: ModelConfig | None) -> Plan:
    """The installed transformers' TP plan for ``config``'s model as a :class:`Plan`."""
    return plan_from_skeleton(build_skeleton(config), config)


def plan_from_skeleton(skeleton: ModelSkeleton, config: ModelConfig | None) -> Plan:
    """The plan of the model ``skeleton`` describes: its ``tp_plan``, matched against the names checkpoint tensors
    load as (``skeleton.loaded_as``), with the keys that name a one-dimensional parameter (attention sinks, a
    per-head gate bias) known from its shapes."""
    plain = {_PREFIX.sub("", name) for name, shape in skeleton.shapes.items() if len(shape) == 1}
    vectors = {key for key in skeleton.tp_plan or {} if any(map(re.compile(_generic(key)).fullmatch, plain))}
    return plan_from_tp_plan(
        skeleton.tp_plan, config, loaded_as=skeleton.loaded_as, vectors=frozenset(vectors), heads=skeleton.heads
    )


def plan_from_tp_plan(
    tp_plan: dict[str, str] | None,
    config: ModelConfig | None,
    *,
    loaded_as: dict[str, str] | None = None,
    vectors: frozenset[str] = frozenset(),
    heads: dict[str, int] | None = None,
) -> Plan:
    """Rules for a transformers ``tp_plan`` mapping; the last rule replicates what the plan does not name.

    Keys are tried deepest first, as transformers tries a parameter's own path before its module's. A checkpoint
    name that transformers renames on load (``loaded_as``: checkpoint name -> the model's) gets the partition of the
    name it loads as, and keeps its own name in the output. A key in ``vectors`` names a one-dimensional parameter,
    which ``colwise`` splits on its only dim (transformers' ``Shard(ndim - 2)``), as it does a bias. ``heads`` gives
    the attention modules built with another head count than the config's (module path -> count): their query and
    output heads are cut in that many.

    Example:
        >>> plan = plan_from_tp_plan({"model.layers.*.mlp.down_proj": "rowwise"}, None)
        >>> plan.match("model.layers.3.mlp.down_proj.weight").resolve(None)
        Shard(dim=-1, unit=1)
    """
    if not tp_plan:
        return Plan(NAME, ())
    rules: list[Rule] = []
    for key, style in sorted(tp_plan.items(), key=lambda kv: -kv[0].count(".")):
        gathered = style in GATHERED or style in WHOLE_INPUT  # each rank computes on whole heads
        for path, count in _paths(key, style, heads or {}):
            weight, bias = _style_partitions(style, key, config, heads=count)
            if weight is None:  # a style reshard cannot express: an error for what it covers, never a guess
                weight = bias = _unsupported(style)
            elif key in vectors and style in COLWISE:
                weight = bias
            rules.append(Rule(rf"{_ANY_PREFIX}{path}\.bias$", bias, gathered=gathered))
            rules.append(Rule(rf"{_ANY_PREFIX}{path}(\.[^.]+)?$", weight, gathered=gathered))
        rules += _per_expert_rules(_key_path(key), style)
    rules.append(Rule("", Replicate(), implicit=True))
    return Plan(NAME, (*_renamed_rules(loaded_as or {}, Plan(NAME, tuple(rules))), *rules))


def _generic(name: str) -> str:
    """A pattern of ``name`` without the language model's prefixes, with any layer index (``*`` in a plan key, a
    number in a tensor name)."""
    parts = _INDEX.split(_PREFIX.sub("", name))
    return r"\d+".join(re.escape(part) for part in parts)


def _renamed_rules(loaded_as: dict[str, str], plan: Plan) -> list[Rule]:
    """Rules for the checkpoint names transformers renames on load, with the partition the plan gives the name each
    loads as: the plan is transformers', keyed by the model's names, not the checkpoint's. One rule for any layer
    index, with the partition most layers' names load under; before it, one a name for the others (layers built
    with heads of their own)."""
    found: dict[str, dict[Rule, list[str]]] = {}
    for saved, loaded in loaded_as.items():
        if (rule := plan.match(loaded)) is not None:
            found.setdefault(_generic(saved), {}).setdefault(rule, []).append(saved)
    exact, generic = [], []
    for pattern, by_rule in found.items():
        most, *others = sorted(by_rule.items(), key=lambda item: -len(item[1]))
        exact += [(re.escape(_PREFIX.sub("", name)), rule) for rule, names in others for name in names]
        generic.append((pattern, most[0]))
    return [
        Rule(rf"{_ANY_PREFIX}{pattern}$", rule.partition, gathered=rule.gathered, implicit=rule.implicit)
        for pattern, rule in exact + generic
    ]


def _key_path(key: str) -> str:
    """The pattern of a plan key's path after the language model's prefixes, any layer index for ``*``."""
    return re.escape(_PREFIX.sub("", key)).replace(r"\*", r"\d+")


def _paths(key: str, style: str, heads: dict[str, int]) -> list[tuple[str, int | None]]:
    """The key's pattern, after one for each head count other than the config's that modules it covers were built
    with (``(path, None)``: the config's count), for the styles cut in heads."""
    path = _key_path(key)
    if style in GATHERED or style in WHOLE_INPUT or not (_QUERY_HEADS.search(key) or _OUTPUT_HEADS.search(key)):
        return [(path, None)]
    parent, _, own = key.rpartition(".")
    module = re.compile(_generic(parent))
    by_count: dict[int, list[str]] = {}
    for name, count in heads.items():
        if module.fullmatch(_PREFIX.sub("", name)):
            by_count.setdefault(count, []).append(re.escape(_PREFIX.sub("", name)))
    other = [(rf"({'|'.join(names)})\.{re.escape(own)}", count) for count, names in sorted(by_count.items())]
    return [*other, (path, None)]


def _unsupported(style: str):
    def partition(config: ModelConfig | None) -> Partition:
        raise AmbiguousPartitionError(
            f"transformers' TP style {style!r} has no reshard partition", hint="add a rule for it with --plan FILE"
        )

    return partition


def _per_expert_rules(path: str, style: str) -> list[Rule]:
    """Saved checkpoints hold one tensor per expert where transformers fuses them in memory.

    The loader slices each expert's ``gate_proj`` / ``up_proj`` ``[I, H]`` on dim 0 and ``down_proj``
    ``[H, I]`` on dim 1 before stacking them into ``experts.gate_up_proj`` / ``experts.down_proj``; Mixtral
    saves them as ``block_sparse_moe.experts.N.w1`` / ``w3`` (gate, up) and ``w2`` (down).
    """
    experts = r"experts\.gate_up_proj", r"experts\.down_proj"
    for fused, style_ok, names, partition in (
        (experts[0], style == "packed_colwise", r"(gate_proj|up_proj|w1|w3)", Shard(0)),
        (experts[1], style in ROWWISE, r"(down_proj|w2)", Shard(1)),
    ):
        if path.endswith(fused) and style_ok:
            block = path[: -len(fused)]
            if block.endswith(r"mlp\."):
                block = block[: -len(r"mlp\.")] + r"(mlp|block_sparse_moe)\."
            return [Rule(rf"{_ANY_PREFIX}{block}experts\.\d+\.{names}\.weight$", partition)]
    return []


def _style_partitions(
    style: str, key: str, config: ModelConfig | None, *, heads: int | None = None
) -> tuple[Any, Any]:
    """``(weight, bias)`` partitions (or functions of the tensor's own sub-config) of a style; ``(None, None)``
    for a style reshard does not know. ``heads``: the module's own head count, if not its config's."""
    vocab = key.endswith(("lm_head", "embed_tokens"))
    if style in COLWISE:
        if style not in GATHERED and _QUERY_HEADS.search(key):
            return _query_heads(-2, heads), _query_heads(-1, heads)
        if style not in GATHERED and _KV_PROJECTIONS.search(key):
            return by_heads(-2), by_heads(-1)
        return (Vocab(0) if vocab else Shard(-2)), Shard(-1)
    if style in ROWWISE:
        cut = style not in WHOLE_INPUT and _OUTPUT_HEADS.search(key)
        return (_query_heads(-1, heads) if cut else Shard(-1)), Replicate()
    if style == "embedding_rowwise":
        return Vocab(0), Replicate()
    if style == "embedding_colwise":
        return Shard(1), Replicate()
    if style in ("packed_colwise", "packed_rowwise"):
        dim = -2 if style == "packed_colwise" else -1

        def weight(config: ModelConfig | None) -> Partition:
            size = _intermediate(config, key)
            return Packed(dim, (size, size)) if size else Shard(dim)

        def bias(config: ModelConfig | None) -> Partition:
            size = _intermediate(config, key)
            return Packed(-1, (size, size)) if size and style == "packed_colwise" else Replicate()

        return weight, bias
    if style in REPLICATED:
        return Replicate(), Replicate()
    return None, None


def _query_heads(dim: int, count: int | None = None):
    """The ``num_attention_heads`` heads along ``dim`` of the tensor's own sub-config (``count``: the module's own,
    when it was built with others), each ``size / heads`` wide.

    Raises:
        AmbiguousPartitionError: the config gives no head count (the heads cannot be told apart in the rows).
    """

    def partition(config: ModelConfig | None) -> Partition:
        heads = count or (config.num_attention_heads if config is not None else None)
        if not isinstance(heads, int) or heads < 1:
            raise AmbiguousPartitionError(f"num_attention_heads is {heads!r}: its heads cannot be told apart")
        return Heads(dim, heads)

    return partition


def _intermediate(config: ModelConfig | None, key: str) -> int:
    """The size of one half of a packed gate/up: the expert or the dense intermediate size (0: unknown).

    Raises:
        AmbiguousPartitionError: the config gives several sizes (ERNIE-4.5-VL: one per kind of expert).
    """
    if config is None:
        return 0
    name = "moe_intermediate_size" if "expert" in key and config.get("moe_intermediate_size") else "intermediate_size"
    value = config.get(name)
    if value is not None and not isinstance(value, int):
        raise AmbiguousPartitionError(
            f"{name} is {value!r}, not one size: the packed gate/up halves of {key} are unknown"
        )
    return value or 0
