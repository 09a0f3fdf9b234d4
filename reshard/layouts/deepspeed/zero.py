"""Where each parameter of a ZeRO checkpoint lies in the flat partitions of the data-parallel ranks: pure
arithmetic on the shapes and sizes the files record (no bytes are read here).

DeepSpeed's own ``utils/zero_to_fp32.py`` rebuilds the same way:

* ZeRO-1/2 (``_zero2_merge_trainable_params``): a parameter group is the ranks' pieces concatenated in rank order;
  its parameters follow one another in ``param_shapes`` order, each followed by its
  ``param_alignment_paddings`` entry; what is left at the end is the group's padding (less than ``2 x dp``).
* ZeRO-3 (``_zero3_merge_trainable_params``): a rank's flat vector is its sub-groups concatenated; each parameter
  takes ``ceil(numel / dp)`` elements at the same offset of every rank's vector, concatenated in rank order
  and cut to ``numel`` (the last rank's piece holds the padding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from reshard.errors import CorruptFileError
from reshard.layouts.deepspeed.pieces import Piece


@dataclass(frozen=True)
class Segment:
    """``numel`` elements of ``itemsize`` bytes stored in ``file`` from byte ``position`` on (one flat tensor)."""

    file: Path
    position: int
    numel: int
    itemsize: int
    name: str  # what the file calls it, for errors


@dataclass(frozen=True)
class Flat:
    """A vector made of segments one after another (a group over ranks, or a rank's sub-groups)."""

    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    def span(self, start: int, count: int) -> list[Piece]:
        """The pieces of elements ``[start, start + count)``."""
        pieces, begin = [], 0
        for segment in self.segments:
            low, high = max(start, begin), min(start + count, begin + segment.numel)
            if low < high:
                position = segment.position + (low - begin) * segment.itemsize
                pieces.append(Piece(segment.file, position, (high - low) * segment.itemsize))
            begin += segment.numel
        return pieces


def zero2_pieces(
    shapes: Sequence[dict[str, tuple[int, ...]]],
    groups: Sequence[Flat],
    paddings: Sequence[Sequence[int]] | None,
    dp: int,
    *,
    path: Path,
) -> dict[str, list[Piece]]:
    """Each trainable parameter's pieces under ZeRO-1/2 (``groups[g]``: group ``g`` over the ranks)."""
    if len(shapes) != len(groups):
        raise CorruptFileError(
            f"param_shapes has {len(shapes)} parameter groups but the optimizer files hold {len(groups)}",
            path=path,
            tensor="param_shapes",
        )
    found: dict[str, list[Piece]] = {}
    align = 2 * dp
    for index, (group, flat) in enumerate(zip(shapes, groups, strict=True)):
        padding = paddings[index] if paddings is not None else [0] * len(group)
        if len(padding) != len(group):
            raise CorruptFileError(
                f"group {index} has {len(group)} parameters but {len(padding)} alignment paddings",
                path=path,
                tensor="param_alignment_paddings",
            )
        offset = 0
        for (name, shape), pad in zip(group.items(), padding, strict=True):
            numel = math.prod(shape)
            if offset + numel > flat.numel:
                raise _short(path, name, index, flat)
            found[name] = flat.span(offset, numel)
            offset += numel + pad
        if align * math.ceil(offset / align) != align * math.ceil(flat.numel / align):
            raise CorruptFileError(
                f"parameter group {index} takes {offset} elements but its partitions hold {flat.numel}",
                path=path,
                tensor="param_shapes",
            )
    return found


def zero3_pieces(shapes: dict[str, tuple[int, ...]], ranks: Sequence[Flat], *, path: Path) -> dict[str, list[Piece]]:
    """Each parameter's pieces under ZeRO-3 (``ranks[r]``: rank ``r``'s sub-groups one after another); also how
    frozen parameters are cut (one fragment per rank)."""
    dp = len(ranks)
    found: dict[str, list[Piece]] = {}
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / dp)
        pieces: list[Piece] = []
        left = numel
        for rank in ranks:
            if offset + part > rank.numel:
                raise _short(path, name, None, rank)
            take = min(part, left)
            pieces += rank.span(offset, take)
            left -= take
        found[name] = pieces
        offset += part
    if any(rank.numel != offset for rank in ranks):
        held = sorted({rank.numel for rank in ranks})
        raise CorruptFileError(
            f"the parameters take {offset} elements per rank but the ranks' partitions hold {held}",
            path=path,
            tensor="param_shapes",
        )
    return found


def _short(path: Path, name: str, group: int | None, flat: Flat) -> CorruptFileError:
    where = f"parameter group {group}" if group is not None else "a rank's partition"
    return CorruptFileError(
        f"{where} ({flat.numel} elements) ends before this parameter (param_shapes does not match the partitions)",
        path=path,
        tensor=name,
    )
