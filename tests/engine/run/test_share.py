"""``reshard.engine.run.worker_shares`` on plain data (filters of a FilePlan): how several workers share one
conversion.

A worker must convert every tensor with a piece in a file it writes (else that file misses bytes) and no other
(else it reads for nothing); the tensors in no data file go to rank 0 alone, whose manifest needs their facts.
The conversion here is built by hand, F32 tensors of known sizes, so every byte count is worked out below.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.engine.plan.planner import ConversionPlan, TargetTensor, TensorPlan
from reshard.engine.run.worker_shares import assign, file_bytes, share_of, tensors_for
from reshard.engine.run.workers import Group
from reshard.formats.file_plan import FilePlan
from reshard.geometry import Replicate
from reshard.layouts.base import SourceCheckpoint
from reshard.vocab import VocabPlan


def target(name: str, elements: int) -> TargetTensor:
    """An F32 tensor of ``elements`` values: 4 bytes each."""
    return TargetTensor(name, (elements,), "F32", Replicate(), ((elements,),))


# "gh" is one unit of work with two targets (as a fused QKV split by a mapping): g in f3, h in f2.
PLANS = {
    "a": TensorPlan((), (target("a", 10),)),  # 40 bytes, in f1
    "b": TensorPlan((), (target("b", 20),)),  # 80 bytes, in f2
    "c": TensorPlan((), (target("c", 5),)),  # 20 bytes, in f3
    "d": TensorPlan((), (target("d", 30),)),  # 120 bytes, split over f1 and f2: 60 each
    "e": TensorPlan((), (target("e", 2),)),  # 8 bytes, in no data file
    "gh": TensorPlan((), (target("g", 4), target("h", 6))),  # 16 bytes in f3, 24 in f2
}
DATA_FILES = {
    "f1": frozenset({"a", "d"}),
    "f2": frozenset({"b", "d", "h"}),
    "f3": frozenset({"c", "g"}),
}
# f1 = 40 + 60, f2 = 80 + 60 + 24, f3 = 20 + 16
BYTES = {"f1": 100, "f2": 164, "f3": 36}


def conversion(plans: dict[str, TensorPlan] = PLANS) -> ConversionPlan:
    source = SourceCheckpoint(Path("/nowhere"), "hf", [])
    return ConversionPlan(source, 1, tuple(plans.values()), VocabPlan(None, "unknown"), False)


def units(plan: ConversionPlan) -> list[str]:
    """The plan's units of work by their key in :data:`PLANS`, in order."""
    keys = {id(plan): key for key, plan in PLANS.items()}
    return [keys[id(unit)] for unit in plan.tensors]


def test_file_bytes_spread_a_tensor_over_the_files_holding_it() -> None:
    assert file_bytes(conversion(), FilePlan(DATA_FILES)) == BYTES


def test_file_bytes_round_a_shared_tensor_down_and_count_unknown_names_as_nothing() -> None:
    """10 bytes over 3 files: 3 each (the estimate only orders the files); a name the plan lacks weighs 0."""
    plans = {"x": TensorPlan((), (TargetTensor("x", (5,), "F16", Replicate()),))}
    files = {"p": frozenset({"x"}), "q": frozenset({"x", "stray"}), "r": frozenset({"x"})}
    assert file_bytes(conversion(plans), FilePlan(files)) == {"p": 3, "q": 3, "r": 3}


@pytest.mark.parametrize(
    ("files", "workers", "expected"),
    [
        ({"a": 5, "b": 3, "c": 3, "d": 1}, 2, [{"a", "d"}, {"b", "c"}]),
        # ties: the lower rank first, equal sizes by name
        ({"z": 1, "y": 1, "x": 1}, 2, [{"x", "z"}, {"y"}]),
        # more workers than files: the last ones get nothing
        ({"only": 7}, 3, [{"only"}, set(), set()]),
        (BYTES, 2, [{"f2"}, {"f1", "f3"}]),  # 164 | 100 + 36
        (BYTES, 3, [{"f2"}, {"f1"}, {"f3"}]),
        (BYTES, 1, [{"f1", "f2", "f3"}]),
    ],
)
def test_assign_shares_files_largest_first_to_the_lightest_worker(
    files: dict[str, int], workers: int, expected: list[set[str]]
) -> None:
    assert assign(files, workers) == [frozenset(share) for share in expected]
    assert assign(dict(reversed(list(files.items()))), workers) == [frozenset(share) for share in expected]


# For 1 to 3 workers: each worker's units of work (in plan order) and the data files it leaves to the others.
SHARES = {
    1: [(["a", "b", "c", "d", "e", "gh"], set())],
    2: [(["b", "d", "e", "gh"], {"f1", "f3"}), (["a", "c", "d", "gh"], {"f2"})],
    3: [(["b", "d", "e", "gh"], {"f1", "f3"}), (["a", "d"], {"f2", "f3"}), (["c", "gh"], {"f1", "f2"})],
}


@pytest.mark.parametrize("size", [1, 2, 3])
def test_share_of_gives_each_worker_the_tensors_of_its_files(size: int) -> None:
    shares = [share_of(Group(rank, size), conversion(), FilePlan(DATA_FILES)) for rank in range(size)]
    assert [(units(plan), set(left)) for plan, left in shares] == SHARES[size]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_tensor_lands_with_exactly_the_owners_of_its_files(size: int) -> None:
    """Whatever the number of workers: each file is written by one worker (left by all the others); a unit of
    work is converted by the owners of the files holding any of its targets and by no other worker (so every
    target reaches the owner of each file holding it); a unit in no data file by rank 0 only."""
    shares = [share_of(Group(rank, size), conversion(), FilePlan(DATA_FILES)) for rank in range(size)]
    owners = {file: [rank for rank, (_, left) in enumerate(shares) if file not in left] for file in DATA_FILES}
    assert all(len(ranks) == 1 for ranks in owners.values()), owners
    owner = {file: ranks[0] for file, ranks in owners.items()}
    for key, unit in PLANS.items():
        converting = {rank for rank, (plan, _) in enumerate(shares) if key in units(plan)}
        names = {t.name for t in unit.targets}
        holding = {owner[file] for file, held in DATA_FILES.items() if held & names}
        assert converting == (holding or {0}), key


def test_tensors_for_keeps_plan_order_and_the_rest_of_the_conversion() -> None:
    whole = conversion()
    mine = tensors_for(whole, FilePlan(DATA_FILES), frozenset({"f3", "f1"}), first=False)
    assert units(mine) == ["a", "c", "d", "gh"]
    assert (mine.source, mine.target_tp, mine.vocab, mine.uneven) == (whole.source, 1, whole.vocab, False)
    assert units(tensors_for(whole, FilePlan(DATA_FILES), frozenset(), first=True)) == ["e"]
    assert units(tensors_for(whole, FilePlan(DATA_FILES), frozenset(), first=False)) == []
