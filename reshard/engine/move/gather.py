"""Gathering one tensor: its rank slices read into their place in one buffer, then split for the target.

* **One buffer per tensor.** The rank slices are read into their place in one buffer of the gathered
  (padded) tensor: a dim-0 piece is one read of its byte range, a column block one read of the slice
  scattered over the block's rows; only packed parts off dim 0 and rows under 1 KB go through a
  temporary. The canonical tensor, and every target piece of a ``shard``/``grouped``/``vocab``/
  ``replicate`` tensor, is then a view of that buffer, written from its rows: nothing is gathered twice.
  Pad rows for a bigger target vocab are zeroed in the buffer, not concatenated; pad rows of the source
  are cut by :func:`reshard.geometry.cut_pad_rows`; where each rank's rows go is the tensors' cut
  (:class:`reshard.geometry.Cut`), read here as by every byte path.
* **Replicated KV heads** (``replicated_heads`` at a tp above the head count): the first copy of every head is
  read into its place, every other copy into one slice-sized temporary and compared with it, bit for bit.
* **Same bytes as the reference.** The gather here is :func:`reshard.geometry.tensors.gather` done in place;
  ``tests/engine/move/test_gather.py`` checks both agree on every partition kind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from reshard.engine.move.work import Work, check_fits, joins, plan_work
from reshard.engine.plan.planner import SourceTensor, TargetTensor, TensorPlan, identity_plan
from reshard.errors import ReshardError
from reshard.geometry import Cut, Packed, Replicate, Vocab, cut_pad_rows
from reshard.geometry.tensors import bitwise_equal, check_replica, cut_parts, cut_slices
from reshard.io.direct import Batch
from reshard.io.joined import Joined
from reshard.layouts.base import TensorRef

Shape = tuple[int, ...]


def gather_into(
    source: SourceTensor,
    buffer: torch.Tensor,
    *,
    allow_divergent: bool,
    divergent: set[str] | None = None,
) -> torch.Tensor:
    """Read every rank slice into ``buffer``; returns it (the canonical tensor is a view of it).

    A replicated tensor that differs between ranks raises, unless ``allow_divergent``: then rank 0's
    copy is taken and, when ``divergent`` is given, the tensor's name is added to it.
    """
    refs: tuple[TensorRef, ...] = source.refs
    partition = source.partition
    if isinstance(partition, Replicate):
        with Batch():
            refs[0].read_into(buffer)
        if len(refs) > 1 and not (allow_divergent and divergent is None):
            other = torch.empty_like(buffer)
            for rank, ref in enumerate(refs[1:], start=1):
                with Batch():
                    ref.read_into(other)
                if not allow_divergent:
                    check_replica(buffer, other, rank)
                elif divergent is not None and not bitwise_equal(buffer, other):
                    divergent.add(source.name)
                    break
        return buffer
    cut = source.cut
    dim = cut.axis
    contiguous = cut.rows_contiguous()  # pieces along dim are contiguous in file and buffer
    placed = cut.placed()
    with Batch():  # every rank's blocks in flight at once
        for rank, ref in enumerate(refs):
            mine = [run for run in placed if run.rank == rank]
            if contiguous:
                row_bytes = math.prod(ref.shape[dim + 1 :]) * buffer.element_size()
                for run in mine:
                    ref.read_into(buffer.narrow(dim, run.at, run.length), start=run.start * row_bytes)
                continue
            if not mine:
                continue
            if len(mine) == 1 and mine[0].length == ref.shape[dim]:  # the whole slice: read into its block
                ref.read_into(buffer.narrow(dim, mine[0].at, mine[0].length))
                continue
            whole = torch.empty(ref.shape, dtype=buffer.dtype)
            with Batch():
                ref.read_into(whole)
            for run in mine:
                buffer.narrow(dim, run.at, run.length).copy_(whole.narrow(dim, run.start, run.length))
            del whole
    if cut.replicas > 1 and not (allow_divergent and divergent is None):
        _compare_head_copies(source.name, refs, cut, buffer, allow_divergent, divergent)
    return buffer


def _compare_head_copies(
    name: str,
    refs: Sequence[TensorRef],
    cut: Cut,
    buffer: torch.Tensor,
    allow_divergent: bool,
    divergent: set[str] | None,
) -> None:
    """Every copy of a replicated head against the first one, already in ``buffer``; raise naming both ranks
    (or, with ``allow_divergent``, add ``name`` to ``divergent`` and keep the first copies)."""
    other = torch.empty(refs[0].shape, dtype=buffer.dtype)
    for rank, first in cut.copies():
        with Batch():
            refs[rank].read_into(other)
        ((at, length),) = cut.rank_rows(rank)
        head = buffer.narrow(cut.axis, at, length)
        if not allow_divergent:
            check_replica(head, other, rank, first_rank=first, what=f"replicated KV head {rank // cut.replicas}")
        elif divergent is not None and not bitwise_equal(head, other):
            divergent.add(name)
            return


Piece = tuple[str, "torch.Tensor", Sequence["torch.Tensor | Joined"]]


def gather_and_split(
    work: Work,
    *,
    allow_divergent: bool,
    divergent: set[str] | None = None,
    buffers: Sequence[torch.Tensor] | None = None,
    outputs: Sequence[torch.Tensor] | None = None,
    known_finite: set[str] | None = None,
) -> list[Piece]:
    """Gather one unit's source tensors (into ``buffers`` of ``work.buffer_shapes``, or new ones) and return,
    per target tensor, its name, the canonical tensor and its target rank slices.

    A tensor kept as it is gives views of its buffer (a ``packed`` target's slices as :class:`Joined` views of
    its parts, unless packed off dim 0: then copies); a mapped unit goes through its transform first, which
    writes into ``outputs`` (one per target, of its canonical shape and dtype) when given: only for a transform
    that :func:`writes_into` them. Such a transform may know from its inputs that a target has no NaN or Inf
    (a dequantized weight whose scales bound it): those targets' names are added to ``known_finite``.
    """
    tensor = work.tensor
    if buffers is None:
        buffers = [
            torch.empty(shape, dtype=s.dtype) for shape, s in zip(work.buffer_shapes, tensor.sources, strict=True)
        ]
    with torch.inference_mode():
        canonicals = [
            _gathered(source, buffer, allow_divergent=allow_divergent, divergent=divergent)
            for source, buffer in zip(tensor.sources, buffers, strict=True)
        ]
        if tensor.transform is None:
            (buffer,), (target,) = canonicals, tensor.targets
            return [(target.name, *kept_slices(buffer, target))]
        inputs = [c for c, _ in canonicals]
        if outputs:
            finite: list[bool] = []
            outputs = tensor.transform.apply(inputs, out=outputs, finite=finite)
            if known_finite is not None:
                known_finite.update(t.name for t, known in zip(tensor.targets, finite, strict=True) if known)
        else:
            outputs = tensor.transform.apply(inputs)
        targets = zip(tensor.targets, outputs, strict=True)
        return [(target.name, out, cut_slices(out, target.cut)) for target, out in targets]


def writes_into(tensor: TensorPlan) -> bool:
    """Whether the unit's transform writes its targets into tensors it is given (``apply(..., out=)``), so the
    engine can hand it pooled buffers instead of fresh memory (dequantizing and casting: a new tensor per weight
    costs its page faults and zeroing, a sixth of an FP8 -> bf16 conversion's CPU)."""
    return tensor.transform is not None and tensor.transform.writes_into


def _gathered(
    source: SourceTensor, buffer: torch.Tensor, *, allow_divergent: bool, divergent: set[str] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(canonical view, whole buffer)`` of one source tensor gathered into ``buffer``."""
    try:
        buffer = gather_into(source, buffer, allow_divergent=allow_divergent, divergent=divergent)
    except ReshardError as err:
        if err.path:
            raise
        raise type(err)(err.detail, path=source.refs[0].file, tensor=source.name, hint=err.hint) from err
    partition = source.partition
    if isinstance(partition, Vocab):
        return cut_pad_rows(buffer, partition.dim % buffer.dim(), source.cut.shape[partition.dim]), buffer
    return buffer, buffer


def kept_slices(
    gathered: tuple[torch.Tensor, torch.Tensor], target: TargetTensor
) -> tuple[torch.Tensor, Sequence[torch.Tensor | Joined]]:
    """A tensor kept as it is: its target slices, by the target's cut, are views of the buffer (pad rows zeroed in
    place; a ``packed`` target's slices :class:`Joined` views of its parts, unless packed off dim 0)."""
    canonical, buffer = gathered
    cut = target.cut
    if cut.dim is None:
        return buffer, [buffer] * cut.tp
    if cut.tp > 1 and isinstance(cut.partition, Packed) and joins(cut.partition, buffer.dim()):
        return buffer, [Joined(tuple(parts)) for parts in cut_parts(buffer, cut)]
    if not isinstance(cut.partition, Vocab):
        return buffer, cut_slices(buffer, cut)
    if cut.rows > cut.data_rows:
        buffer.narrow(cut.dim, cut.data_rows, cut.rows - cut.data_rows).zero_()
    return canonical, cut_slices(buffer, cut)


def gather_canonical(tensor: SourceTensor, *, allow_divergent: bool = False) -> torch.Tensor:
    """Read one tensor's rank slices and join them into the canonical tensor, as a conversion does."""
    plan = identity_plan(tensor)
    plan = TensorPlan(plan.sources, (replace(plan.targets[0], rank_shapes=(tuple(plan.targets[0].shape),)),))
    work = plan_work(plan, target_tp=1)
    check_fits([work])
    ((_, canonical, _),) = gather_and_split(work, allow_divergent=allow_divergent)
    return canonical
