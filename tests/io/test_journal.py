"""``reshard.io.journal``: every line is checked before it is trusted; a damaged line is dropped, never a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reshard.errors import ReshardError
from reshard.io.journal import JOURNAL, Journal

MARK = "f" * 64
SHA = "ab" * 32
DIGEST = "blake3:" + "cd" * 32


def journal_of(staging: Path) -> Path:
    journal = Journal.start(staging, MARK, facts={"options": {"vocab": "None"}})
    journal.tensor_done("a", DIGEST, True, False)
    journal.tensor_done("b", DIGEST, None, False)
    journal.close()
    return staging / JOURNAL.format(rank=0)


def test_lines_journal_writes_are_resumed(tmp_path: Path) -> None:
    journal_of(tmp_path)
    journal, resumed = Journal.resume(tmp_path, MARK)
    journal.close()
    assert sorted(resumed.tensors) == ["a", "b"] and resumed.tensors["a"].digest == DIGEST


@pytest.mark.parametrize(
    "damage",
    [
        lambda line: line | {"digest": "blake3:" + "0" * 64},  # the line's check no longer matches
        lambda line: {k: v for k, v in line.items() if k != "finite"},
        lambda line: line | {"finite": 1},
        lambda line: line | {"divergent": "no"},
        lambda line: line | {"digest": 7},
        lambda line: line | {"digest": "md5:" + "0" * 64},
        lambda line: {"sha256": "cd" * 32} | {k: v for k, v in line.items() if k != "digest"},  # an older version's
        lambda line: line | {"extra": 1},
        lambda line: [line],
    ],
    ids=[
        "zeroed",
        "no-finite",
        "finite-int",
        "divergent-str",
        "digest-int",
        "unknown-algorithm",
        "sha256-line",
        "extra-field",
        "not-an-object",
    ],
)
def test_a_damaged_tensor_line_is_dropped_and_the_others_kept(tmp_path: Path, damage) -> None:
    path = journal_of(tmp_path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[1] = damage(lines[1])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    journal, resumed = Journal.resume(tmp_path, MARK)
    journal.close()
    assert sorted(resumed.tensors) == ["b"]


@pytest.mark.parametrize("raw", ["9" * 5000, "[" * 100_000, "{not json"], ids=["huge-int", "deep", "torn"])
def test_unparsable_lines_are_dropped(tmp_path: Path, raw: str) -> None:
    path = journal_of(tmp_path)
    first, *rest = path.read_text().splitlines(keepends=True)
    path.write_text(first + raw + "\n" + "".join(rest))
    journal, resumed = Journal.resume(tmp_path, MARK)
    journal.close()
    assert sorted(resumed.tensors) == ["a", "b"]


def test_another_conversion_is_named_by_what_differs(tmp_path: Path) -> None:
    journal_of(tmp_path)
    with pytest.raises(ReshardError, match=r"of another conversion \(--vocab unset then, 1000 now\)"):
        Journal.resume(tmp_path, "e" * 64, describe=lambda before: "--vocab unset then, 1000 now" if before else None)
