"""LoRA adapters across ranks: merging them into their base weights, and refusing what cannot be exact.

``--merge-lora`` turns a source checkpoint into one whose LoRA-wrapped layers are plain weights, per
source rank, before anything is planned: ``X.weight = W_r + scaling * cat_i(B_i A_i)`` (in float32, cast
back to W's dtype). For SAT's ``lora2`` names ``scaling = lora_alpha / r``, ``lora_alpha`` 1 by default as
SAT's ``LoraMixin``. For peft's names it is PEFT's ``merge_and_unload``: ``W + (B A) * scaling`` (``(B A)^T`` for
an embedding; DoRA's ``m / ||W + (B A) s||`` row by row times that, from a tp 1 source), ``scaling`` from the
adapter's recorded or given alpha and its rank
(:mod:`reshard.engine.plan.lora_adapter`), the one adapter chosen merged and any other left behind, and the
names lose PEFT's ``base_model.model.``. Each rank's merge uses only that rank's tensors, exactly as SAT's
``merge_lora()`` run on every rank does, so the merged slices then reshard like any base weight. Merged
tensors are computed lazily, one at a time, when the pipeline reads them.

Without merging, a LoRA tensor that is replicated by its rule (B of a row-parallel layer, A of a
column-parallel one) but differs between ranks cannot be resharded exactly: SAT does not reduce B
of a row-parallel layer, so trained ranks drift apart. :func:`check_lora_replicas` refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.dtypes import TensorHeader
from reshard.engine.plan.lora_adapter import PeftAdapter, peft_plain
from reshard.errors import DivergentReplicaError, PlanError, ReshardError, ShapeMismatchError
from reshard.formats.adapter_config import ADAPTER_CONFIG
from reshard.formats.readers import FileReader
from reshard.geometry import Replicate
from reshard.layouts.base import SourceCheckpoint, TensorRef
from reshard.plans.lora import BASE, MAGNITUDE, A, B, parse_lora_name

SAT_ALPHA = 1.0  # SAT's LoraMixin default, for its own lora2 names only

if TYPE_CHECKING:
    import torch

    from reshard.engine.plan.planner import SourceTensor


@dataclass
class _Adapter:
    """The tensors of one LoRA-wrapped layer, by name."""

    layer: str
    base: dict[str, str] = field(default_factory=dict)  # "weight"/"bias" -> source name
    a: dict[int, str] = field(default_factory=dict)
    b: dict[int, str] = field(default_factory=dict)
    peft: bool = False
    embedding: bool = False
    magnitude: str | None = None  # DoRA's

    def ordered(self, parts: dict[int, str], what: str) -> list[str]:
        if sorted(parts) != list(range(len(parts))):
            raise ShapeMismatchError(f"LoRA {what} parts {sorted(parts)} are not numbered from 0", tensor=self.layer)
        return [parts[i] for i in range(len(parts))]


def _adapters(names: Sequence[str], peft: PeftAdapter | None) -> tuple[dict[str, _Adapter], set[str]]:
    """The LoRA-wrapped layers by name, and the tensors of peft adapters not chosen (left behind)."""
    found: dict[str, _Adapter] = {}
    others: set[str] = set()
    for name in names:
        lora = parse_lora_name(name)
        if lora is None:
            continue
        if lora.role != BASE and lora.peft and (peft is None or lora.adapter != peft.name):
            others.add(name)
            continue
        adapter = found.setdefault(lora.layer, _Adapter(lora.layer))
        if lora.role == MAGNITUDE:
            adapter.magnitude = name
            continue
        if lora.role != BASE:
            adapter.peft, adapter.embedding = lora.peft, lora.embedding
        index = 0 if lora.index is None else lora.index
        target = {BASE: None, A: adapter.a, B: adapter.b}[lora.role]
        if target is None:
            adapter.base[lora.param] = name
        else:
            target[index] = name
    return found, others


@dataclass
class MergedLoraReader(FileReader):
    """One rank's merged base weight, computed from the rank's base, A and B tensors when read: SAT's
    ``merge_linear_lora``, or for peft PEFT's ``get_delta_weight`` (``(B @ A) * scaling``, transposed for an
    embedding) added to the weight in float32."""

    name: str
    weight: TensorRef
    a: list[TensorRef]
    b: list[TensorRef]
    scaling: float
    peft: bool = False
    embedding: bool = False
    magnitude: TensorRef | None = None
    path: Path = field(init=False)
    headers: dict[str, TensorHeader] = field(init=False)
    extras: dict = field(init=False, default_factory=dict)
    notes: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.path = self.weight.file
        self.headers = {self.name: self.weight.header}

    def get(self, key: str) -> torch.Tensor:
        import torch

        weight = self.weight.read()
        scaling = self.scaling
        if self.peft:
            delta = self.b[0].read().float() @ self.a[0].read().float()
            delta = (delta.T if self.embedding else delta) * scaling
            merged = weight.float() + delta
            if self.magnitude is not None:  # DoRA (PEFT's DoraLinearVariant.merge_unsafe): m / ||W + s B A||_row
                norm = torch.linalg.norm(weight.float() + delta, dim=1)
                merged = (self.magnitude.read().float() / norm).view(-1, 1) * merged
            return merged.to(weight.dtype)
        # SAT's merge_linear_lora: A_i^T B_i^T per part, concatenated on the output dim, transposed back.
        parts = [a.read().T.float() @ b.read().T.float() * scaling for a, b in zip(self.a, self.b, strict=True)]
        delta = torch.cat(parts, -1).T
        return (weight.float() + delta).to(weight.dtype)


def _check_shapes(name: str, weight: TensorRef, a: list[TensorRef], b: list[TensorRef], *, embedding: bool) -> None:
    rows, cols = weight.shape[0], weight.shape[-1]
    if embedding:  # PEFT's lora_embedding_A [r, vocab], lora_embedding_B [hidden, r]: B A is the transpose
        rows, cols = cols, rows
    ranks = {ref.shape[0] for ref in a} | {ref.shape[-1] for ref in b}
    problem = None
    if len(weight.shape) != 2 or any(len(r.shape) != 2 for r in a + b):
        problem = "LoRA merge needs 2-d base, A and B tensors"
    elif len(ranks) != 1:
        problem = f"LoRA ranks disagree: A {[r.shape for r in a]}, B {[r.shape for r in b]}"
    elif any(ref.shape[1] != cols for ref in a) or sum(ref.shape[0] for ref in b) != rows:
        problem = f"A {[list(r.shape) for r in a]} and B {[list(r.shape) for r in b]} do not fit {list(weight.shape)}"
    if problem:
        raise ShapeMismatchError(f"rank {weight.rank}: {problem}", path=weight.file, tensor=name)


def merge_lora_source(
    source: SourceCheckpoint, *, alpha: float | None = None, peft: PeftAdapter | None = None
) -> SourceCheckpoint:
    """``source`` with every LoRA-wrapped layer replaced by its merged plain ``X.weight`` (and ``X.bias``).

    Args:
        source: the checkpoint.
        alpha: SAT's ``lora_alpha`` for ``lora2`` names (None: SAT's default 1).
        peft: the peft adapter to merge (:func:`reshard.engine.plan.lora_adapter.peft_adapter`), if it has one.

    Raises:
        ShapeMismatchError: an adapter without its base weight, parts that do not pair up, or shapes
            that do not fit the base (checked from headers, before any byte is read).
    """
    adapters, others = _adapters(source.names(), peft)
    if not adapters:
        return replace(source, notes=[*source.notes, "--merge-lora: no LoRA adapters found, nothing merged"])
    sat_alpha = SAT_ALPHA if alpha is None else alpha
    plain = peft_plain if peft is not None else str  # PEFT's merge_and_unload returns the wrapped model
    renamed: dict[str, str] = {}  # base tensor's source name -> its plain name
    merges: dict[str, tuple[str, list[str], list[str], _Adapter]] = {}  # base weight -> (plain name, A, B, layer)
    for layer, adapter in adapters.items():
        for param, name in adapter.base.items():
            renamed[name] = plain(f"{layer}.{param}")
        if not adapter.a and not adapter.b:  # a wrapped base whose adapter is gone: only the name changes
            continue
        if "weight" not in adapter.base:
            some = next(iter({**adapter.a, **adapter.b}.values()))
            raise ShapeMismatchError("a LoRA adapter without its base weight cannot be merged", tensor=some)
        a_names, b_names = adapter.ordered(adapter.a, "A"), adapter.ordered(adapter.b, "B")
        if len(a_names) != len(b_names):
            raise ShapeMismatchError(f"{len(a_names)} A and {len(b_names)} B tensors do not pair up", tensor=layer)
        merges[adapter.base["weight"]] = (plain(f"{layer}.weight"), a_names, b_names, adapter)
    clashes = sorted(set(renamed.values()) & {plain(name) for name in source.names() if name not in renamed})
    if clashes:
        raise ShapeMismatchError("both a LoRA base and a plain tensor of this name exist", tensor=clashes[0])
    _check_dora(source, adapters)
    dropped = others | {n for adapter in adapters.values() for n in [*adapter.a.values(), *adapter.b.values()]}
    dropped |= {adapter.magnitude for adapter in adapters.values() if adapter.magnitude is not None}
    ranks = []
    for rank in source.ranks:
        refs: dict[str, TensorRef] = {}
        for name, ref in rank.items():
            if name in dropped:
                continue
            if name in merges:
                out, a_names, b_names, adapter = merges[name]
                a, b = _refs(rank, a_names, ref), _refs(rank, b_names, ref)
                _check_shapes(out, ref, a, b, embedding=adapter.embedding)
                scaling = peft.scaling if adapter.peft and peft is not None else sat_alpha / a[0].shape[0]
                magnitude = _refs(rank, [adapter.magnitude], ref)[0] if adapter.magnitude else None
                reader = MergedLoraReader(out, ref, a, b, scaling, adapter.peft, adapter.embedding, magnitude)
                refs[out] = TensorRef(out, ref.rank, reader, out, ref.header)
            else:
                out = renamed.get(name, plain(name))
                refs[out] = TensorRef(out, ref.rank, ref.reader, ref.key, ref.header)
        ranks.append(refs)
    if peft is not None:
        rule = f"lora_alpha / {'sqrt(r)' if peft.settings.use_rslora else 'r'} = {peft.scaling:g}"
        left = f"; left behind adapters {', '.join(str(o) for o in peft.others)}" if peft.others else ""
        note = f"--merge-lora: merged {len(merges)} LoRA adapters per rank (peft adapter {peft.name}, {rule}{left})"
    else:
        note = f"--merge-lora: merged {len(merges)} LoRA adapters per rank (scaling = {sat_alpha:g} / rank)"
    sides = [path for path in source.side_files if path.name != ADAPTER_CONFIG]  # a merged model has no adapter
    return replace(source, ranks=ranks, side_files=sides, notes=[*source.notes, note])


def _check_dora(source: SourceCheckpoint, adapters: dict[str, _Adapter]) -> None:
    """Refuse a DoRA merge that is not exact here: ``||W + s B A||`` is over each whole output row, which the ranks of
    a row-parallel layer split (a tp 1 source holds every row whole); DoRA on an embedding."""
    dora = [adapter for adapter in adapters.values() if adapter.magnitude is not None]
    if not dora:
        return
    problem = next((adapter for adapter in dora if adapter.embedding), None)
    if problem is not None:
        raise ReshardError("merging DoRA on an embedding is not supported", path=source.path, tensor=problem.magnitude)
    if source.tp > 1:
        raise ReshardError(
            f"merging DoRA at tp {source.tp}: its norm is over whole rows, which a row-parallel rank does not hold",
            path=source.path,
            tensor=dora[0].magnitude,
            hint="convert it to --tp 1 first (its LoRA tensors gather exactly), then --merge-lora",
        )


def _refs(rank: dict[str, TensorRef], names: list[str], base: TensorRef) -> list[TensorRef]:
    missing = [n for n in names if n not in rank]
    if missing:
        raise ShapeMismatchError(f"rank {base.rank} lacks {missing[0]}", path=base.file, tensor=missing[0])
    return [rank[n] for n in names]


def check_lora_replicas(tensors: Sequence[SourceTensor]) -> None:
    """Refuse LoRA A/B tensors that their rule replicates but that differ between ranks.

    Reads those (small) tensors once before anything is written, so the refusal leaves no output.

    Raises:
        PlanError: one :class:`DivergentReplicaError` per such tensor, naming ``--merge-lora``.
    """
    problems: list[ReshardError] = []
    for tensor in tensors:
        lora = parse_lora_name(tensor.name)
        refs = tensor.refs
        if lora is None or lora.role == BASE or not isinstance(tensor.partition, Replicate) or len(refs) < 2:
            continue
        from reshard.geometry.tensors import bitwise_equal  # imports torch: only with LoRA replicas to compare

        first = refs[0].read()
        for ref in refs[1:]:
            if not bitwise_equal(first, ref.read()):
                problems.append(
                    DivergentReplicaError(
                        f"LoRA {lora.role} is replicated for this layer but rank {ref.rank} differs from rank 0, "
                        "so no unmerged adapter at another tp is exact",
                        path=ref.file,
                        tensor=tensor.name,
                        hint="pass --merge-lora to merge each rank's adapter into its base weight first",
                    )
                )
                break
    if problems:
        raise PlanError(problems)
