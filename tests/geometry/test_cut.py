"""``reshard.geometry.cut``: the one record of a cut, driven against ``torch.chunk`` / ``torch.cat`` of real tensors
for every partition kind, tp 1-8, even and uneven.

The reference here is torch's own arithmetic, written out per kind without reshard: an even split is
``torch.split`` into equal pieces, an uneven one ``torch.chunk`` (ranks past its last chunk hold nothing), a vocab
is zero-padded first, packed parts are each cut on their own and joined per rank, copied KV heads go to the
``tp / heads`` ranks that use them. A cut must give exactly those slices, place them back into the canonical
tensor, and be found again from the slices' shapes alone.
"""

from __future__ import annotations

import pytest
import torch

from reshard.errors import ShapeMismatchError
from reshard.geometry import (
    Grouped,
    Heads,
    Packed,
    Replicate,
    ReplicatedHeads,
    Shard,
    Vocab,
    slices_cut,
    split_cut,
)
from reshard.geometry.tensors import cut_slices

TPS = range(1, 9)


def _pieces(full: torch.Tensor, dim: int, tp: int, uneven: bool) -> list[torch.Tensor] | None:
    """torch's split of ``full`` along ``dim`` into ``tp`` pieces (None: an even split that does not divide)."""
    size = full.shape[dim]
    if not uneven:
        return None if size % tp else list(torch.split(full, size // tp, dim=dim))
    chunks = list(torch.chunk(full, tp, dim=dim)) if size else []
    empty = full.narrow(dim, 0, 0)
    return chunks + [empty] * (tp - len(chunks))


def _reference(kind: str, full: torch.Tensor, tp: int, uneven: bool, **sizes: int) -> list[torch.Tensor] | None:
    """Each rank's slice as torch cuts it, for the partition ``kind`` (None where that kind refuses the tp)."""
    if kind == "replicate":
        return [full] * tp
    if kind in ("shard", "grouped"):
        groups = sizes.get("groups")
        if groups is not None and groups % tp and tp % groups:
            return None
        return _pieces(full, sizes["dim"], tp, uneven and kind == "shard")
    if kind == "heads":
        if full.shape[0] % sizes["heads"] or (sizes["heads"] % tp and not uneven):
            return None
        return _pieces(full, 0, tp, uneven)
    if kind == "replicated_heads":
        heads = sizes["heads"]
        if tp > heads and tp % heads == 0:
            per_rank = tp // heads
            return [torch.chunk(full, heads, dim=0)[rank // per_rank] for rank in range(tp)]
        if heads % tp and not uneven:
            return None
        return _pieces(full, 0, tp, uneven)
    if kind == "vocab":
        rows = sizes["padded"]
        padded = torch.cat([full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))])
        return _pieces(padded, 0, tp, uneven)
    if kind == "packed":
        parts = torch.split(full, list(sizes["parts"]), dim=sizes["dim"])
        per_part = [_pieces(part, sizes["dim"], tp, uneven) for part in parts]
        if any(pieces is None for pieces in per_part):
            return None
        return [torch.cat([pieces[rank] for pieces in per_part], dim=sizes["dim"]) for rank in range(tp)]
    raise AssertionError(kind)


def _cases() -> list[tuple[str, object, tuple[int, ...], dict]]:
    """``(kind, partition, canonical shape, sizes for the reference)``: even and uneven sizes, both dims."""
    return [
        ("replicate", Replicate(), (6, 4), {}),
        ("shard", Shard(0), (24, 3), {"dim": 0}),
        ("shard", Shard(0), (10, 3), {"dim": 0}),
        ("shard", Shard(1), (3, 24), {"dim": 1}),
        ("shard", Shard(1), (2, 13), {"dim": 1}),
        ("grouped", Grouped(0, 4), (16, 2), {"dim": 0, "groups": 4}),
        ("heads", Heads(0, 8), (32, 2), {"heads": 8}),
        ("heads", Heads(0, 6), (30, 2), {"heads": 6}),
        ("replicated_heads", ReplicatedHeads(0, 2), (8, 3), {"heads": 2}),
        ("replicated_heads", ReplicatedHeads(0, 4), (12, 2), {"heads": 4}),
        ("packed", Packed(0, (16, 8, 8)), (32, 2), {"dim": 0, "parts": (16, 8, 8)}),
        ("packed", Packed(1, (6, 5)), (2, 11), {"dim": 1, "parts": (6, 5)}),
    ]


CASES = _cases()


def _ids(case: tuple) -> str:
    kind, _, shape, _ = case
    return f"{kind}-{'x'.join(map(str, shape))}"


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_cut_gives_torchs_slices_and_places_them_back(case: tuple, tp: int, uneven: bool) -> None:
    kind, partition, shape, sizes = case
    full = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    expected = _reference(kind, full, tp, uneven, **sizes)
    if expected is None:
        with pytest.raises(ShapeMismatchError):
            split_cut(partition, shape, tp, uneven=uneven)
        return
    cut = split_cut(partition, shape, tp, uneven=uneven)
    got = cut_slices(full, cut)
    assert [tuple(piece.shape) for piece in got] == [tuple(piece.shape) for piece in expected]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    _places_back(cut, expected, full)
    assert slices_cut(partition, shape, [piece.shape for piece in expected]) == cut


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("vocab", [37, 40])
def test_vocab_cut_pads_as_torch_pads(vocab: int, tp: int, uneven: bool) -> None:
    """A vocab padded to a multiple of tp (or not at all, uneven): the pad rows are zeros past the data rows."""
    full = torch.arange(1, 1 + vocab * 3, dtype=torch.float32).reshape(vocab, 3)
    padded = vocab if uneven else -(-vocab // tp) * tp
    expected = _reference("vocab", full, tp, uneven, padded=padded)
    cut = split_cut(Vocab(0), full.shape, tp, padded=padded, uneven=uneven)
    assert (cut.rows, cut.data_rows) == (padded, vocab)
    got = cut_slices(full, cut)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    _places_back(cut, expected, full)
    assert slices_cut(Vocab(0), full.shape, [piece.shape for piece in expected]) == cut


def _places_back(cut, slices: list[torch.Tensor], full: torch.Tensor) -> None:
    """The cut's placed runs, copied in their order from the slices into a buffer of its rows, tile it and rebuild the
    (padded) tensor, every row once; its copies are the ranks whose slices repeat an earlier rank's."""
    if cut.dim is None:
        assert cut.placed() == [] and [rank for rank, _ in cut.copies()] == list(range(1, cut.tp))
        return
    buffer = full.new_full((*full.shape[: cut.dim], cut.rows, *full.shape[cut.dim + 1 :]), float("nan"))
    seen = 0
    for run in cut.placed():
        assert run.at == seen  # in canonical order, each run where the last ended
        buffer.narrow(cut.dim, run.at, run.length).copy_(slices[run.rank].narrow(cut.dim, run.start, run.length))
        seen += run.length
    assert seen == cut.rows
    assert torch.equal(buffer.narrow(cut.dim, 0, cut.data_rows), full)
    assert torch.all(buffer.narrow(cut.dim, cut.data_rows, cut.rows - cut.data_rows) == 0)
    for rank, first in cut.copies():
        assert torch.equal(slices[rank], slices[first])


def test_a_cut_refuses_shapes_it_does_not_give() -> None:
    with pytest.raises(ShapeMismatchError, match="not a shard"):
        slices_cut(Shard(0), (8, 4), [(3, 4), (5, 4)])
    with pytest.raises(ShapeMismatchError):
        slices_cut(Shard(0), (8, 4), [(4, 4), (4, 5)])
