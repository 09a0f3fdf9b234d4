"""Session fixtures of the mapping tests: torchtitan-style DCP checkpoints from the real writer (one torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.titan_dcp import fixture_key, write_titan_fixtures


@pytest.fixture(scope="session")
def titan_root(pytestconfig: pytest.Config) -> Path:
    """Every variant of ``fixtures/titan_writer.py``, written once and kept in pytest's cache between sessions."""
    return write_titan_fixtures(pytestconfig.cache.mkdir("titan-fixtures") / fixture_key())
