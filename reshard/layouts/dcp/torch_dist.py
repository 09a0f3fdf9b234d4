"""The ``torch_dist`` layout: Megatron-Core's ``dist_checkpointing`` format, also inside NeMo 2's ``weights/``.

    <root>/latest_checkpointed_iteration.txt       (Megatron-LM) the iteration, or ``release``
    <root>/iter_{iteration:07d}/                   metadata.json ({"sharded_backend": "torch_dist", ...}),
                                                   .metadata + __{rank}_{n}.distcp (DCP), common.pt (args, ...)
                                                   or, from Megatron-Core 0.19, args in the .distcp files
    <nemo>/weights/ + <nemo>/context/model.yaml    (NeMo 2) the same files under weights/, the config in context/

The data files are PyTorch DCP: every tensor is stored with its global shape, so the checkpoint is read as a
tp=1 checkpoint whose tensors are assembled from chunk boxes (:mod:`reshard.layouts.dcp.boxed_reader`, shared with the
``dcp`` layout). Megatron-Core stacks the layers of homogeneous models on a leading axis
(``decoder.layers.<rest>`` of shape ``[L, ...]``, the global layer index, so pipeline stages need no merge)
and the experts on the next (``decoder.layers.mlp.experts.experts.<rest>``, ``[L, E, ...]``): each layer and
expert is presented as its own tensor under the names Megatron's ``torch`` format gives it
(``decoder.layers.{i}.<rest>``, ``decoder.layers.{i}.mlp.experts.local_experts.{e}.<rest>``), so plans and
mappings read both formats alike; it is read one layer (one expert) at a time. Non-homogeneous models keep
``decoder.layers.{i}.`` keys; norms stored under Transformer Engine's names get the names the ``torch``
format of the same model uses (``input_layernorm`` / ``pre_mlp_layernorm`` for the local layer spec and for
a MoE layer's MLP norm); the ``_w`` / ``_v`` halves of a SwiGLU fc1 (``singleton_local_shards``) are seen
as the fused ``[gate; up]``. The stored forms are canonical already: QKV interleaved per query group, fc1
``[gate; up]``, the vocab padded (cut to the true size like everywhere else). NeMo's ``module.`` prefix is
dropped. The optimizer's state in model space is the training state
(:mod:`reshard.layouts.dcp.torch_dist_training`), read under the weights' names; rng state and Transformer Engine's
``_extra_state`` objects are skipped and reported.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError, ReshardError
from reshard.formats.boxes import Box
from reshard.formats.dcp_metadata.read import DcpIndex, StoredTensor, read_index
from reshard.layouts.base import SourceCheckpoint, TensorRef
from reshard.layouts.dcp.boxed_reader import BoxedReader, BoxView, StackedView
from reshard.layouts.dcp.dcp import checked
from reshard.layouts.dcp.nemo import NEMO_WEIGHTS, nemo_args, nemo_side_files, nemo_tokenizer, refuse_adapters
from reshard.layouts.dcp.torch_dist_common import read_common, read_object
from reshard.layouts.dcp.torch_dist_dp import bucket_refs
from reshard.layouts.dcp.torch_dist_training import BUCKETED, STATE, sharding_types, training_state, unread_format
from reshard.layouts.megatron.reader import read_tracker
from reshard.megatron.facts import MegatronFacts
from reshard.megatron.model import arg, config_from_args, count_problems, named_tokenizer
from reshard.options import ReadOptions
from reshard.sizes import human_bytes

NAME = "torch_dist"

CONFIG = "metadata.json"
STACKED = re.compile(r"^decoder\.layers\.(?!\d)")
EXPERTS = ".mlp.experts.experts."
HALVES = re.compile(r"^(?P<key>.+)_(?P<half>[wv])$")
SKIPPED = re.compile(r"^(optimizer|rng_state|rerun_state_machine)\b|/")
OPTIMIZER = "optimizer."
BUCKETS = "optimizer.distributed."  # dp_reshardable's flat buffers and objects
PREFIXES = ("module.",)
FUSED_NORM = re.compile(r"^(decoder\.layers\.\d+\.)(self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_(\w+)$")
MAX_STACKED = 1 << 16  # layers (or experts) on a stacked tensor's leading axis; more is damage, not a model
ROUTER = re.compile(r"^(decoder\.layers\.\d+\.)mlp\.router\.")


def folder_of(path: Path) -> Path | None:
    """The folder holding ``metadata.json`` for ``path`` (an iteration folder, a Megatron-LM root following its
    tracker, or a NeMo 2 checkpoint's ``weights/``), when it is a ``torch_dist`` checkpoint."""
    if not path.is_dir():
        return None
    candidates = [path, path / NEMO_WEIGHTS]
    text = read_tracker(path)
    if text is not None:
        if text == "release" or text.isdigit():  # anything else (a path) is not followed
            candidates.append(path / ("release" if text == "release" else f"iter_{int(text):07d}"))
    for folder in candidates:
        config = folder / CONFIG
        if config.is_file() and (folder / ".metadata").is_file():
            return folder
    return None


def detect(path: Path) -> bool:
    return folder_of(path) is not None


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Open a ``torch_dist`` checkpoint from its index: per-layer (and per-expert) views of the global tensors.

    Raises:
        CorruptFileError: a backend other than ``torch_dist`` (zarr), or unreadable common state (``common.pt`` or
            the data files' ``common_state``, :mod:`reshard.layouts.dcp.torch_dist_common`).
        ReshardError: the DCP index is inconsistent (see :mod:`reshard.layouts.dcp.dcp`), or a NeMo PEFT checkpoint
            (adapters only).
    """
    folder = folder_of(path)
    if folder is None:
        raise ReshardError("not a torch_dist checkpoint (no metadata.json beside a .metadata)", path=path)
    backend = _backend(folder / CONFIG)
    if backend != "torch_dist":
        raise CorruptFileError(f"sharded backend {backend!r}: only torch_dist is read", path=folder / CONFIG)
    refuse_adapters(folder)
    index = read_index(folder, trust_pickle=options.trust_pickle)
    common, notes, common_file = read_common(folder, index, options)
    args = nemo_args(path) if folder.name == NEMO_WEIGHTS else common.get("args")
    optimizer = {fqn: t for fqn, t in index.tensors.items() if _strip(fqn).startswith(OPTIMIZER)}
    stored = {fqn: t for fqn, t in index.tensors.items() if not SKIPPED.search(_strip(fqn))}
    distributed = bool(arg(args, "use_distributed_optimizer"))
    readable = unread_format(common, optimizer, distributed=distributed) is None  # else their boxes are not ours
    bucketed = readable and sharding_types(common) == {BUCKETED}
    read, sizes = checked(
        stored | {f: t for f, t in optimizer.items() if readable and (bucketed or STATE.match(_strip(f)))}
    )
    objects = _objects(index, options, notes) if bucketed else {}
    model = {fqn: t for fqn, t in read.items() if fqn in stored}
    views = _spec_names(_views({_strip(fqn): tensor for fqn, tensor in model.items()}), args)
    reader = BoxedReader(folder, views)
    refs = {name: TensorRef(name, 0, reader, name, reader.headers[name]) for name in views}
    source = SourceCheckpoint(path, NAME, [refs], extras=[{}], top_level=[common])
    source.training = training_state(
        args,
        common,
        {_strip(fqn): read.get(fqn, t) for fqn, t in optimizer.items()},
        list(index.values),
        views,
        lambda tensors: _spec_names(_views(tensors), args),
        lambda states: BoxedReader(folder, states),
        objects,
        lambda weights: bucket_refs(
            args, objects, {f: t for f, t in read.items() if f.startswith(BUCKETS)}, weights, folder
        ),
    )
    source.config = (
        config_from_args(args, common_file if folder.name != NEMO_WEIGHTS else folder / "..") if args else None
    )
    carried = source.training.tensors[0] if source.training and source.training.tensors else {}
    skipped = [fqn for fqn in [*index.tensors, *index.values] if fqn not in model and not (carried and fqn in read)]
    total = sum(index.tensors[f].stored_bytes for f in skipped if f in index.tensors)
    total += sum(index.values[f] for f in skipped if f in index.values)
    source.notes += notes + [
        f"torch_dist: {len(model)} stored tensors read as {len(refs)} per-layer and per-expert tensors, "
        f"{human_bytes(sum(sizes.values()))} in {len(sizes)} data files",
    ]
    if skipped:
        source.notes.append(
            f"skipped, not model weights: {len(skipped)} entries ({human_bytes(total)}), e.g. {skipped[0]}"
        )
    if folder.name == NEMO_WEIGHTS:
        source.tokenizer, source.side_files = nemo_tokenizer(path), nemo_side_files(path)
    elif args is not None:
        source.tokenizer = named_tokenizer(args)
    source.facts = MegatronFacts(
        args=args,
        iteration=common.get("iteration"),
        checkpoint_version=common.get("checkpoint_version"),
        release=folder.name == "release",
    )
    problems = _stack_problems({_strip(fqn): tuple(t.shape) for fqn, t in model.items()})
    problems += count_problems(views, args) if args is not None else []
    if problems:
        source.refusal = ReshardError("; ".join(problems), path=folder, hint="the checkpoint does not add up")
    if source.config is None:
        source.notes.append("no Megatron args or NeMo config: model sizes must come from --config")
    return source


def _objects(index: DcpIndex, options: ReadOptions, notes: list[str]) -> dict[str, Any]:
    """The distributed optimizer's ``ShardedObject`` entries (``optimizer.distributed.*``: param groups, bucket
    sizes) by key, each unwrapped from the one-item list it is stored as."""
    found = {}
    for entry, stored in index.stored_values.items():
        key, _, _ = entry.partition("/")
        if key.startswith(BUCKETS):
            value = read_object(stored, entry, options, notes)
            found[key] = value[0] if isinstance(value, list) and len(value) == 1 else value
    return found


def _stack_problems(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Stacked tensors that disagree on their leading layer axis, or expert tensors on their expert axis."""
    problems = []
    for what, axis, names in (
        ("layers", 0, [n for n in shapes if STACKED.match(n)]),
        ("experts", 1, [n for n in shapes if STACKED.match(n) and EXPERTS in n]),
    ):
        counts: dict[int, str] = {}
        for name in names:
            if len(shapes[name]) > axis:
                counts.setdefault(shapes[name][axis], name)
        if len(counts) > 1:
            listed = ", ".join(f"{name} {count}" for count, name in sorted(counts.items(), reverse=True))
            problems.append(f"stacked tensors hold different numbers of {what}: {listed}")
    return problems


def _spec_names(views: dict[str, BoxView | StackedView], args: Any) -> dict[str, BoxView | StackedView]:
    """The norms under the names the ``torch`` format of the same model gives them.

    ``torch_dist`` stores every layer's norms under Transformer Engine's fused names, whatever the layer spec
    (``sharded_state_dict_keys_map``); the ``torch`` format keeps the spec's own: ``input_layernorm`` and
    ``pre_mlp_layernorm`` for ``--transformer-impl local``, and ``pre_mlp_layernorm`` in a MoE layer, which
    has no ``linear_fc1``. Reading them so makes both formats of one model the same model.
    """
    local = arg(args, "transformer_impl", "transformer_engine") == "local"
    moe_layers = {m.group(1) for name in views if (m := re.match(r"^(decoder\.layers\.\d+\.)mlp\.router\.", name))}
    renamed = {}
    for name, view in views.items():
        match = re.match(
            r"^(decoder\.layers\.\d+\.)(self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_(\w+)$", name
        )
        if match and (local or (match.group(2) == "mlp.linear_fc1" and match.group(1) in moe_layers)):
            module = "input_layernorm" if match.group(2) == "self_attention.linear_qkv" else "pre_mlp_layernorm"
            name = f"{match.group(1)}{module}.{match.group(3)}"
        renamed[name] = view
    return renamed


def _backend(path: Path) -> str | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CorruptFileError(f"unreadable: {str(err) or type(err).__name__}", path=path) from err
    return data.get("sharded_backend") if isinstance(data, dict) else None


def _strip(fqn: str) -> str:
    for prefix in PREFIXES:
        if fqn.startswith(prefix):
            return fqn[len(prefix) :]
    return fqn


def _views(stored: dict[str, StoredTensor]) -> dict[str, BoxView | StackedView]:
    """Per-layer and per-expert views of the stored tensors, under Megatron's ``torch``-format names, in the
    order a Megatron state dict lists them (embedding, layer by layer, the rest)."""
    halves: dict[str, dict[str, StoredTensor]] = {}
    whole: dict[str, StoredTensor] = {}
    for fqn, tensor in stored.items():
        match = HALVES.match(fqn)
        if match and fqn.endswith(("weight_w", "weight_v", "bias_w", "bias_v")):
            halves.setdefault(match.group("key"), {})[match.group("half")] = tensor
        else:
            whole[fqn] = tensor
    views: dict[str, BoxView | StackedView] = {}
    layered: dict[int, dict[str, BoxView | StackedView]] = {}
    for fqn, tensor in whole.items():
        for name, view in _split(fqn, BoxView.whole(tensor)):
            _place(name, view, views, layered)
    for key, pair in halves.items():
        if set(pair) != {"w", "v"}:
            raise CorruptFileError(
                f"{key}: only the {set(pair)} half is stored", path=next(iter(pair.values())).declared_in
            )
        for (name, w), (_, v) in zip(
            _split(key, BoxView.whole(pair["w"])), _split(key, BoxView.whole(pair["v"])), strict=True
        ):
            _place(name, StackedView((w, v)), views, layered)
    head = {n: v for n, v in views.items() if "embedding" in n}
    tail = {n: v for n, v in views.items() if n not in head}
    return head | {n: v for layer in sorted(layered) for n, v in layered[layer].items()} | tail


def _place(name: str, view: BoxView | StackedView, views: dict, layered: dict[int, dict]) -> None:
    match = re.match(r"^decoder\.layers\.(\d+)\.", name)
    (layered.setdefault(int(match.group(1)), {}) if match else views)[name] = view


def _split(fqn: str, view: BoxView) -> list[tuple[str, BoxView]]:
    """``(name, view)`` per layer of a stacked tensor and per expert of a stacked expert tensor, else itself."""
    stacked = STACKED.match(fqn) or EXPERTS in fqn
    if stacked and (not view.shape or not 0 < view.shape[0] <= MAX_STACKED):
        raise CorruptFileError(
            f"a stacked tensor of shape {list(view.shape)}: no leading layer or expert axis of 1 to {MAX_STACKED}",
            path=view.tensor.declared_in,
            tensor=fqn,
        )
    if STACKED.match(fqn):
        rest = fqn[len("decoder.layers.") :]
        return [
            item
            for layer in range(view.shape[0])
            for item in _split(f"decoder.layers.{layer}.{rest}", _index(view, layer))
        ]
    if EXPERTS in fqn:
        head, rest = fqn.split(EXPERTS, 1)
        return [(f"{head}.mlp.experts.local_experts.{e}.{rest}", _index(view, e)) for e in range(view.shape[0])]
    return [(fqn, view)]


def _index(view: BoxView, i: int) -> BoxView:
    """The ``i``-th entry along the view's leading axis (a unit dim of the box, dropped from the shape)."""
    dims = len(view.tensor.shape) - len(view.shape)  # leading axes already fixed by enclosing views
    offsets = list(view.box.offsets)
    sizes = list(view.box.sizes)
    offsets[dims], sizes[dims] = offsets[dims] + i, 1
    return BoxView(view.tensor, Box(tuple(offsets), tuple(sizes)), view.shape[1:])
