"""Every sample checkpoint through every command gives the stored bytes (see ``tests/golden/golden.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))

import golden  # noqa: E402

STORED = json.loads(golden.STORED.read_text())


def test_every_case_is_stored() -> None:
    assert sorted(STORED) == sorted(golden.CASES)


@pytest.mark.parametrize("name", sorted(golden.CASES))
def test_same_outputs_as_stored(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(golden.ROOT)
    assert golden.run_case(golden.CASES[name], tmp_path) == STORED[name]
