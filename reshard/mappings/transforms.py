"""How source tensors become target tensors when names change between frameworks: renames, fused splits, merges.

Each transform states its shapes from headers (:meth:`target_shapes`, pure) and moves bytes only in
:meth:`apply` (torch, run by the engine on the gathered canonical tensors of one group): the engine's
:class:`Transform`, the protocol defined here. ``convert --dtype``'s dequantize and cast
(:mod:`reshard.quantization.dequantize`) implement it too, structurally: the quantization layer sits above the
mappings and imports nothing of them; the engine holds both as a ``Transform``. The engine calls
:meth:`Transform.target_shapes` while planning (pure, from headers), then :meth:`Transform.apply` once per unit, with
``out`` only when :attr:`Transform.writes_into`. Each mapping transform has an inverse (:class:`Invertible`), so a
mapping table written one way (say Megatron -> transformers) also maps back.

* :class:`Rename` - one tensor, same bytes, another name.
* :class:`SplitGroupedQKV` / :class:`FuseGroupedQKV` - Megatron's fused QKV ``[ng, q/ng + 2, d, h]``
  (per query group: its query heads, then its key head, then its value head) <-> separate q, k, v.
* :class:`Chunk` / :class:`Concat` - equal parts along dim 0 (SwiGLU ``[gate; up]``) <-> the parts.
* :class:`RopePermute` / :class:`RopeUnpermute` - Meta's interleaved RoPE pairs (torchtitan ``wq``/``wk``)
  <-> the half-split layout transformers' ``rotate_half`` expects; the permutation transformers'
  ``convert_llama_weights_to_hf.py`` and torchtitan's ``to_hf`` apply (forgetting it gives garbage text:
  torchtitan#1291).
* :class:`WithZeros` / :class:`DropZeros` - a tensor and a zero vector of its rows <-> the tensor (a sigmoid router
  without an expert bias is DeepSeek-V3's router with a zero ``e_score_correction_bias``).
* :class:`Parallel` / :class:`Chain` - one transform per tensor of a group, and transforms one after the other
  (torchtitan's fused ``wqkv``: split per KV group, then permute q and k).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from reshard.errors import MappingError, ShapeMismatchError

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]


class Transform(Protocol):
    """Source tensors (``sources`` of them, in the order of the unit's names) -> ``targets`` target tensors."""

    @property
    def sources(self) -> int:
        """How many source tensors it takes."""
        ...

    @property
    def targets(self) -> int:
        """How many target tensors it makes."""
        ...

    @property
    def writes_into(self) -> bool:
        """Whether :meth:`apply` fills target tensors it is given (``out``), so the engine may hand it pooled
        buffers instead of fresh memory."""
        ...

    @property
    def moves_values(self) -> bool:
        """Whether every target element is a source element or a zero (a rename, split, fusion or permutation): then
        a parameter's optimizer state (its master, its moments) goes through it as its weight does."""
        ...

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        """The targets' shapes from the sources' (pure).

        Raises:
            ShapeMismatchError: the sources' shapes do not fit the transform.
        """
        ...

    def apply(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        out: Sequence[torch.Tensor] = (),
        finite: list[bool] | None = None,
    ) -> list[torch.Tensor]:
        """The target tensors of ``tensors`` (into ``out``, one per target, when given: only if :attr:`writes_into`).
        When ``finite`` is given, one flag per target is appended to it: whether the inputs alone show every value
        of that target finite (the engine then skips looking at its bytes)."""
        ...

    def describe(self) -> str:
        """What it does, in a few words (for reports and errors)."""
        ...


class Invertible(Transform, Protocol):
    """A transform of a mapping table: it maps back too, so one table serves both directions."""

    def inverse(self) -> Invertible:
        """The transform that undoes this one (targets -> sources)."""
        ...


class _Maker:
    """What every transform of a mapping shares: it makes its targets itself (views or new tensors), so it writes
    into no tensor it is given and knows nothing of their values beforehand. Subclasses implement :meth:`_made`."""

    writes_into = False
    moves_values = True

    def apply(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        out: Sequence[torch.Tensor] = (),
        finite: list[bool] | None = None,
    ) -> list[torch.Tensor]:
        """The target tensors of ``tensors``; ``finite`` (when given) gets False for each: nothing is known."""
        if out:
            raise TypeError(f"{type(self).__name__} writes into no tensor it is given (writes_into is False)")
        made = self._made(tensors)
        if finite is not None:
            finite.extend(False for _ in made)
        return made

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError


@dataclass(frozen=True)
class Rename(_Maker):
    """One tensor under another name; the bytes do not change."""

    sources: int = 1
    targets: int = 1

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        return [tuple(shapes[0])]

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [tensors[0]]

    def inverse(self) -> Rename:
        return self

    def describe(self) -> str:
        return "rename"


@dataclass(frozen=True)
class SplitGroupedQKV(_Maker):
    """Megatron's fused QKV ``[groups * (q_per_group + 2) * head_dim, ...]`` -> q, k, v.

    Rows of group ``g``: ``q_per_group`` query heads, one key head, one value head, each ``head_dim``
    rows. Weights and biases alike (the trailing dims are carried along).
    """

    groups: int
    q_per_group: int
    head_dim: int
    sources: int = 1
    targets: int = 3

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        (shape,) = shapes
        rows = self.groups * (self.q_per_group + 2) * self.head_dim
        if shape[0] != rows:
            raise ShapeMismatchError(
                f"fused QKV has {shape[0]} rows, not {self.groups} groups x ({self.q_per_group} + 2) heads x "
                f"{self.head_dim}"
            )
        rest = tuple(shape[1:])
        kv = self.groups * self.head_dim
        return [(self.groups * self.q_per_group * self.head_dim, *rest), (kv, *rest), (kv, *rest)]

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        (qkv,) = tensors
        rest = tuple(qkv.shape[1:])
        grouped = qkv.reshape(self.groups, self.q_per_group + 2, self.head_dim, *rest)
        q = grouped[:, : self.q_per_group].reshape(-1, *rest)
        k = grouped[:, self.q_per_group].reshape(-1, *rest)
        v = grouped[:, self.q_per_group + 1].reshape(-1, *rest)
        return [q, k, v]

    def inverse(self) -> FuseGroupedQKV:
        return FuseGroupedQKV(self.groups, self.q_per_group, self.head_dim)

    def describe(self) -> str:
        return f"split fused QKV ({self.groups} groups of {self.q_per_group} + 2 heads of {self.head_dim})"


@dataclass(frozen=True)
class FuseGroupedQKV(_Maker):
    """q, k, v -> Megatron's fused QKV, interleaved per query group (the inverse of :class:`SplitGroupedQKV`)."""

    groups: int
    q_per_group: int
    head_dim: int
    sources: int = 3
    targets: int = 1

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        q, k, v = (tuple(s) for s in shapes)
        expected = self.inverse().target_shapes([(self.groups * (self.q_per_group + 2) * self.head_dim, *q[1:])])
        if [q, k, v] != expected:
            raise ShapeMismatchError(f"q, k, v of shapes {[list(s) for s in shapes]} do not make {self.describe()}")
        return [(q[0] + k[0] + v[0], *q[1:])]

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        import torch

        q, k, v = tensors
        rest = tuple(q.shape[1:])
        parts = [
            q.reshape(self.groups, self.q_per_group, self.head_dim, *rest),
            k.reshape(self.groups, 1, self.head_dim, *rest),
            v.reshape(self.groups, 1, self.head_dim, *rest),
        ]
        return [torch.cat(parts, dim=1).reshape(-1, *rest)]

    def inverse(self) -> SplitGroupedQKV:
        return SplitGroupedQKV(self.groups, self.q_per_group, self.head_dim)

    def describe(self) -> str:
        return (
            f"fuse q, k, v per query group ({self.groups} groups of {self.q_per_group} + 2 heads of {self.head_dim})"
        )


@dataclass(frozen=True)
class Chunk(_Maker):
    """One tensor -> ``parts`` equal parts along dim 0 (views: no copy)."""

    parts: int = 2
    sources: int = 1

    @property
    def targets(self) -> int:
        return self.parts

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        (shape,) = shapes
        if shape[0] % self.parts:
            raise ShapeMismatchError(f"{shape[0]} rows do not split in {self.parts} equal parts")
        return [(shape[0] // self.parts, *shape[1:])] * self.parts

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        (tensor,) = tensors
        return list(tensor.chunk(self.parts, dim=0))

    def inverse(self) -> Concat:
        return Concat(self.parts)

    def describe(self) -> str:
        return f"split in {self.parts} along dim 0"


@dataclass(frozen=True)
class Concat(_Maker):
    """``parts`` tensors of one shape -> their concatenation along dim 0."""

    parts: int = 2
    targets: int = 1

    @property
    def sources(self) -> int:
        return self.parts

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        first = tuple(shapes[0])
        if any(tuple(s) != first for s in shapes):
            raise ShapeMismatchError(f"parts of shapes {[list(s) for s in shapes]} differ")
        return [(first[0] * self.parts, *first[1:])]

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        import torch

        return [torch.cat(list(tensors), dim=0)]

    def inverse(self) -> Chunk:
        return Chunk(self.parts)

    def describe(self) -> str:
        return f"concatenate {self.parts} along dim 0"


@dataclass(frozen=True)
class RopePermute(_Maker):
    """Rows of each head from Meta's interleaved RoPE pairs to transformers' half split (``heads`` heads).

    Per head of ``d`` rows: row ``2i + j`` (pair ``i``, member ``j``) moves to ``j * d/2 + i``.
    """

    heads: int
    sources: int = 1
    targets: int = 1

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        (shape,) = shapes
        if shape[0] % (2 * self.heads):
            raise ShapeMismatchError(f"{shape[0]} rows are not {self.heads} heads of an even size")
        return [tuple(shape)]

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        (w,) = tensors
        rest = tuple(w.shape[1:])
        half = w.shape[0] // self.heads // 2
        return [w.reshape(self.heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)]

    def inverse(self) -> RopeUnpermute:
        return RopeUnpermute(self.heads)

    def describe(self) -> str:
        return f"RoPE pairs to halves ({self.heads} heads)"


@dataclass(frozen=True)
class RopeUnpermute(_Maker):
    """The inverse of :class:`RopePermute`: transformers' half split back to interleaved pairs."""

    heads: int
    sources: int = 1
    targets: int = 1

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        return RopePermute(self.heads).target_shapes(shapes)

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        (w,) = tensors
        rest = tuple(w.shape[1:])
        half = w.shape[0] // self.heads // 2
        return [w.reshape(self.heads, 2, half, *rest).transpose(1, 2).reshape(w.shape)]

    def inverse(self) -> RopePermute:
        return RopePermute(self.heads)

    def describe(self) -> str:
        return f"RoPE halves to pairs ({self.heads} heads)"


@dataclass(frozen=True)
class WithZeros(_Maker):
    """One tensor -> itself and a zero vector, one element per row (or ``length``): a bias the target family always
    has, which the source lacks because it is zero (a router without an expert bias, as DeepSeek-V3's
    ``e_score_correction_bias``; an off-by-one softmax, as granite_swa's ``sinks`` of zero, one per head)."""

    length: int | None = None
    sources: int = 1
    targets: int = 2

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        (shape,) = shapes
        return [tuple(shape), (shape[0] if self.length is None else self.length,)]

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        (tensor,) = tensors
        return [tensor, tensor.new_zeros(tensor.shape[0] if self.length is None else self.length)]

    def inverse(self) -> DropZeros:
        return DropZeros()

    def describe(self) -> str:
        return "kept, with a zero vector of its rows"


@dataclass(frozen=True)
class DropZeros(_Maker):
    """A tensor and a zero vector -> the tensor (:class:`WithZeros` backwards); a vector that is not zero changes the
    computation and is refused."""

    sources: int = 2
    targets: int = 1
    moves_values = False  # the moments of a zero bias need not be zero: they would be dropped

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        return [tuple(shapes[0])]

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tensor, zeros = tensors
        if bool(zeros.any()):
            raise MappingError("a bias the target has no place for is not zero: dropping it would change the model")
        return [tensor]

    def inverse(self) -> WithZeros:
        return WithZeros()

    def describe(self) -> str:
        return "kept, its zero vector dropped"


@dataclass(frozen=True)
class Parallel(_Maker):
    """``parts[i]`` applied to the ``i``-th tensor of the group (each part maps one tensor to one)."""

    parts: tuple[Invertible, ...]

    @property
    def moves_values(self) -> bool:  # type: ignore[override]  # a property where the base has a class attribute
        return all(part.moves_values for part in self.parts)

    @property
    def sources(self) -> int:
        return len(self.parts)

    @property
    def targets(self) -> int:
        return len(self.parts)

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        return [part.target_shapes([shape])[0] for part, shape in zip(self.parts, shapes, strict=True)]

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [part.apply([tensor])[0] for part, tensor in zip(self.parts, tensors, strict=True)]

    def inverse(self) -> Parallel:
        return Parallel(tuple(part.inverse() for part in self.parts))

    def describe(self) -> str:
        return "; ".join(f"{i}: {part.describe()}" for i, part in enumerate(self.parts))


@dataclass(frozen=True)
class Chain(_Maker):
    """``steps`` one after the other: each step's targets are the next step's sources."""

    steps: tuple[Invertible, ...]

    @property
    def moves_values(self) -> bool:  # type: ignore[override]  # a property where the base has a class attribute
        return all(step.moves_values for step in self.steps)

    @property
    def sources(self) -> int:
        return self.steps[0].sources

    @property
    def targets(self) -> int:
        return self.steps[-1].targets

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        for step in self.steps:
            shapes = step.target_shapes(shapes)
        return list(shapes)

    def _made(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        for step in self.steps:
            tensors = step.apply(tensors)
        return list(tensors)

    def inverse(self) -> Chain:
        return Chain(tuple(step.inverse() for step in reversed(self.steps)))

    def describe(self) -> str:
        return ", then ".join(step.describe() for step in self.steps)
