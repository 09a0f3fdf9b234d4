"""Fixtures of the robustness tests: the good checkpoints the corpus damages (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bases import build_bases


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_bases(tmp_path_factory.mktemp("robustness") / "bases")
