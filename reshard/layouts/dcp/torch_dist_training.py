"""The training state of a Megatron-Core ``torch_dist`` checkpoint (:class:`~reshard.layouts.training.TrainingState`),
where Megatron-LM's ``save_checkpoint`` puts it (Megatron-Core 0.19, ``optimizer/distrib_optimizer.py``,
``optimizer/optimizer.py``, ``dist_checkpointing/optimizer.py``, ``training/checkpointing.py``):

* **Model space** (read): each parameter's state is a global tensor of its weight's shape and sharding, under the
  weight's key behind ``optimizer.state.<slot>.`` (layers stacked like the weights). The distributed optimizer's
  ``fully_reshardable`` format writes ``param`` (the fp32 master), ``exp_avg``, ``exp_avg_sq``; the non-distributed
  ``Float16OptimizerWithFloat16Params`` writes ``fp32_param``, ``exp_avg``, ``exp_avg_sq`` and ``FP32Optimizer`` the
  moments alone (its weights are the masters). They are read as the weights are, under :func:`state_name`.
* **Bucket space** (read): ``dp_reshardable``, Megatron-LM's default: per tp rank and bucket, flat buffers
  ``optimizer.distributed.dp_group_idx_*`` whose layout reshard computes again from the weights' shapes and checks
  against the checkpoint's records (:mod:`reshard.layouts.dcp.torch_dist_dp`); the step and groups are the
  ``optimizer.distributed.dp_group_idx_{r}.optimizer`` object of each tp rank (all alike).
* **Flattened space** (refused by name, shown by ``inspect``): ``fully_sharded_model_space``
  (``flattened_range``), ``dp_zero_gather_scatter`` and ``fsdp_dtensor``: the common state's
  ``param_state_sharding_type`` names them.
* **Step and groups**, in the common state (``common.pt`` or 0.19's ``common_state`` entry): the optimizer's
  ``state_dict()`` without its ``params`` (``optimizer.optimizer.param_groups``, or ``optimizer.param_groups``; a
  chained optimizer with several parts keeps one per index), the step in each group (``step``) or as
  ``state.common_step``. Megatron-Core records no group membership: it builds its groups again at load and matches
  the saved ones by ``param_group_identifier_keys`` (``wd_mult``, ``lr_mult``, ``max_lr``, ...). Membership is
  taken from Megatron-Core's standard rule (``get_standard_config_overrides``: no weight decay, ``wd_mult`` 0, for
  biases and 1-D parameters; the routed experts' parameters in the ``is_expert_parallel`` groups where there are
  such, which Megatron-Core makes only under expert parallelism or an expert tp of its own); groups it does not explain
  (other overrides) leave the state unread, by name.
* **Not carried**: ``opt_param_scheduler``, ``rng_state``, ``rerun_state_machine``, the grad scaler, the FLOPs
  counter, each a :class:`~reshard.layouts.training.Leftover` with its kind.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from reshard.errors import shown
from reshard.formats.dcp_metadata.read import StoredTensor
from reshard.layouts.base import TensorRef
from reshard.layouts.dcp.boxed_reader import BoxedReader, BoxView, StackedView
from reshard.layouts.training import SLOTS, Leftover, ParamGroup, TrainingState, state_name, stored_value
from reshard.megatron.model import arg

BUCKETED = "dp_reshardable"
STATE = re.compile(r"^optimizer\.state\.(?P<slot>param|fp32_param|exp_avg|exp_avg_sq)\.(?P<key>.+)$")
SLOT = {"param": "master", "fp32_param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
READ = (None, "fully_reshardable", BUCKETED)  # the sharding types read: the non-distributed optimizers record none
REFUSED = {
    "fully_sharded_model_space": "flattened ranges of each parameter (deprecated; Megatron-Core <= 0.14 writes it)",
    "dp_zero_gather_scatter": "one object per tp/pp rank (deprecated)",
    "fsdp_dtensor": "Megatron-FSDP's DTensors",
}
RESAVE = "re-save it in Megatron-LM with --dist-ckpt-optim-fully-reshardable, the format reshard reads"
# Top-level keys of the common state that are not the training state (or are read here), and the kind of each
# other one ``--drop`` names.
KNOWN = frozenset({"args", "checkpoint_version", "iteration", "content_metadata", "optimizer"})
KINDS = {
    "opt_param_scheduler": "scheduler",
    "lr_scheduler": "scheduler",
    "rng_state": "rng",
    "rerun_state_machine": "trainer",
    "num_floating_point_operations_so_far": "trainer",
}
MODEL = re.compile(r"^model\d*$")
BUCKET_OBJECT = re.compile(r"^optimizer\.distributed\.dp_group_idx_(?P<group>\d+)\.(?P<what>optimizer|grad_scaler)$")

Views = dict[str, BoxView | StackedView]


def training_state(
    args: Any,
    common: Mapping[str, Any],
    stored: Mapping[str, StoredTensor],
    values: list[str],
    weights: Views,
    views_of: Callable[[dict[str, StoredTensor]], Views],
    reader: Callable[[Views], BoxedReader],
    objects: Mapping[str, Any],
    buckets: Callable[[Views], dict[str, TensorRef] | str],
) -> TrainingState | None:
    """The training state, None when the checkpoint holds no optimizer.

    Args:
        args: Megatron's args (``optimizer``, ``use_distributed_optimizer``).
        common: the common state dict.
        stored: the optimizer's tensors (fqn -> stored tensor), ``optimizer.*`` keys only.
        values: the non-tensor entries' keys (``rng_state/shard_...``).
        weights: the model's views by name (their shapes are the parameters').
        views_of: the reader's naming of stored tensors (per layer, the ``torch`` format's names).
        reader: a :class:`BoxedReader` over views.
        objects: the ``optimizer.distributed.*`` objects by key (``dp_reshardable`` only; else empty).
        buckets: the state tensors of ``dp_reshardable`` by :func:`state_name` from the weights' views, or why
            they cannot be placed (:func:`reshard.layouts.dcp.torch_dist_dp.bucket_refs`).
    """
    optimizer = common.get("optimizer")
    if not isinstance(optimizer, Mapping) and not stored:
        return None
    bucketed = sharding_types(common) == {BUCKETED}
    plain = _parts(optimizer if isinstance(optimizer, Mapping) else {})
    parts, unread = _bucket_parts(objects) if bucketed else (plain, None)
    raw_groups = [group for part in parts for group in _groups(part)]
    leftovers = _leftovers(common, values, parts)
    by_slot: dict[str, dict[str, StoredTensor]] = {}
    for fqn, tensor in stored.items():
        match = STATE.match(fqn)
        if match:
            by_slot.setdefault(SLOT[match["slot"]], {})[match["key"]] = tensor
    moments = tuple(slot for slot in SLOTS if slot != "master" and slot in by_slot)
    if bucketed or not by_slot:  # flat buffers: the slot ends the key
        moments = tuple(m for m in ("exp_avg", "exp_avg_sq") if any(f.endswith(f".{m}") for f in stored))
    unread = unread_format(common, stored, distributed=bool(arg(args, "use_distributed_optimizer"))) or unread
    refs = buckets(weights) if bucketed and unread is None else {}
    if isinstance(refs, str):
        unread = f"the distributed optimizer's state is {BUCKETED!r}, but {refs}; {RESAVE}"
    if unread is not None:
        groups = tuple(ParamGroup(_hyper(g), ()) for g in raw_groups)
        return TrainingState(arg(args, "optimizer"), _step(parts), moments, groups, (), leftovers, unread=unread)
    assert not isinstance(refs, str)
    if not bucketed:
        states = {
            state_name(name, slot): view
            for slot, tensors in by_slot.items()
            for name, view in views_of(tensors).items()
        }
        boxed = reader(states)
        refs = {name: TensorRef(name, 0, boxed, name, boxed.headers[name]) for name in states}
    trainable = [name for name in weights if state_name(name, "exp_avg") in refs]
    members, unread = _members(trainable, weights, raw_groups)
    groups = tuple(ParamGroup(_hyper(g), tuple(names)) for g, names in zip(raw_groups, members, strict=True))
    frozen = tuple(name for name in weights if name not in trainable)
    if unread is not None:
        return TrainingState(arg(args, "optimizer"), _step(parts), moments, groups, frozen, leftovers, unread=unread)
    return TrainingState(arg(args, "optimizer"), _step(parts), moments, groups, frozen, leftovers, (refs,))


def _bucket_parts(objects: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], str | None]:
    """``dp_reshardable``'s optimizer as one part: every tp rank's ``optimizer`` object (param groups, step) and
    ``grad_scaler``, which must be alike; or why not."""
    held: dict[int, dict[str, Any]] = {}
    for key, value in objects.items():
        match = BUCKET_OBJECT.match(key)
        if match:
            held.setdefault(int(match["group"]), {})[match["what"]] = value
    ranks: list[Mapping[str, Any]] = [part for part in held.values() if "optimizer" in part]
    if not ranks:
        return [], f"no optimizer.distributed.dp_group_idx_*.optimizer object: no param groups; {RESAVE}"
    if any(part != ranks[0] for part in ranks):
        return ranks[:1], f"the tp ranks' optimizer objects (param groups, step) differ; {RESAVE}"
    return ranks[:1], None


def _parts(optimizer: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The optimizer's parts: a chained optimizer of several keeps one state per index (``{0: ..., 1: ...}``)."""
    if optimizer and all(isinstance(key, int) for key in optimizer):
        return [part for _, part in sorted(optimizer.items()) if isinstance(part, Mapping)]
    return [optimizer]


def _inner(part: Mapping[str, Any]) -> Mapping[str, Any]:
    """The torch optimizer's state dict inside a part (``optimizer`` for the mixed-precision and distributed
    optimizers, the part itself for ``FP32Optimizer``)."""
    inner = part.get("optimizer")
    return inner if isinstance(inner, Mapping) else part


def _groups(part: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    groups = _inner(part).get("param_groups")
    return [g for g in groups if isinstance(g, Mapping)] if isinstance(groups, list) else []


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {str(key): stored_value(value) for key, value in group.items() if key != "params"}


def _step(parts: list[Mapping[str, Any]]) -> int | None:
    """The step: every group's ``step`` (the distributed optimizer), else ``state.common_step``; None when they
    disagree or none is recorded."""
    steps = {g.get("step") for part in parts for g in _groups(part) if g.get("step") is not None}
    for part in parts:
        state = _inner(part).get("state")
        if isinstance(state, Mapping) and "common_step" in state:
            steps.add(state["common_step"])
    found = {_number(step) for step in steps}
    return found.pop() if len(found) == 1 else None


def _number(value: Any) -> int | None:
    """A step as an int: a float or a scalar tensor holding an integer."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 0:
        return None
    return int(value)


def sharding_types(common: Mapping[str, Any]) -> set[str]:
    """The formats the optimizer's parts record (``param_state_sharding_type``), else the content metadata's
    ``distrib_optim_sharding_type`` (Megatron-Core >= 0.13); empty when neither says."""
    optimizer = common.get("optimizer")
    parts = _parts(optimizer) if isinstance(optimizer, Mapping) else []
    sharding = {str(kind) for part in parts if (kind := part.get("param_state_sharding_type")) is not None}
    metadata = common.get("content_metadata")
    if not sharding and isinstance(metadata, Mapping) and metadata.get("distrib_optim_sharding_type"):
        sharding = {str(metadata["distrib_optim_sharding_type"])}
    return sharding


def unread_format(common: Mapping[str, Any], stored: Mapping[str, Any], *, distributed: bool) -> str | None:
    """Why the optimizer's tensors are not read, for the formats that are not in model space (None: they are).

    The format is what each optimizer part records (``param_state_sharding_type``), else the content metadata's
    ``distrib_optim_sharding_type`` (Megatron-Core >= 0.13); a distributed optimizer's state that records neither
    (``args.use_distributed_optimizer``) is of an older Megatron-Core, in a format reshard does not read.
    """
    sharding = sharding_types(common)
    if not sharding and distributed and stored:
        return f"a distributed optimizer's state that records no format (Megatron-Core <= 0.12); {RESAVE}"
    other = sorted(map(str, sharding - set(READ)))
    if other:
        what = REFUSED.get(other[0], "a format reshard does not know")
        return f"the distributed optimizer's state is {other[0]!r}: {what}; {RESAVE}"
    if len(sharding) > 1:
        return f"optimizer parts in different formats: {sorted(map(str, sharding))}"
    bucketed = [fqn for fqn in stored if fqn.startswith("optimizer.distributed.")]
    if bucketed and sharding != {BUCKETED}:
        return f"the distributed optimizer's state is in flat buffers ({bucketed[0]}); {RESAVE}"
    return None


def _members(
    trainable: list[str], weights: Views, groups: list[Mapping[str, Any]]
) -> tuple[list[list[str]], str | None]:
    """Each group's parameters by Megatron-Core's standard rule (module docstring), or why they cannot be told."""
    members: list[list[str]] = [[] for _ in groups]
    unexplained: list[str] = []
    apart = any(g.get("is_expert_parallel") for g in groups)  # only with expert parallelism (or its own tp)
    for name in trainable:
        expert = apart and ".mlp.experts." in name
        no_decay = name.endswith(".bias") or len(weights[name].shape) == 1
        wanted = {"is_expert_parallel": expert, "wd_mult": 0.0 if no_decay else 1.0, "lr_mult": 1.0}
        found = [i for i, g in enumerate(groups) if all(g.get(k) == v for k, v in wanted.items())]
        if len(found) == 1 and not groups[found[0]].get("is_decoupled_lr"):
            members[found[0]].append(name)
        else:
            unexplained.append(name)
    if not unexplained:
        return members, None
    listed = "; ".join(shown({k: g.get(k) for k in ("wd_mult", "lr_mult", "is_expert_parallel")}) for g in groups)
    return members, (
        f"param groups ({listed}) that Megatron-Core's standard rule (no weight decay for biases and 1-D "
        f"parameters) does not explain for {unexplained[0]} and {len(unexplained) - 1} more: the checkpoint "
        "does not record which parameters each group holds"
    )


def _leftovers(common: Mapping[str, Any], values: list[str], parts: list[Mapping[str, Any]]) -> tuple[Leftover, ...]:
    """What the checkpoint holds of its training beside the optimizer's state, each with its kind."""
    found = [
        Leftover(KINDS.get(key, "other"), f"Megatron's {key}", "common state")
        for key in common
        if key not in KNOWN and not MODEL.match(str(key))
    ]
    rng = [value for value in values if value.startswith("rng_state/")]
    if rng:
        found.append(Leftover("rng", f"Megatron's rng_state ({len(rng)} per-rank objects)", rng[0]))
    if any("grad_scaler" in part for part in parts):
        found.append(Leftover("loss_scaler", "Megatron's grad_scaler", "common state optimizer.grad_scaler"))
    return tuple(found)
