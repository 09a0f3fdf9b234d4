"""Session fixtures of the layout tests: DCP checkpoints from the real writer (one torchrun for all of them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fixtures.dcp import fixture_key, write_fixtures


@pytest.fixture(scope="session")
def dcp_root(pytestconfig: pytest.Config) -> Path:
    """Every DCP variant of ``fixtures/dcp_writer.py``, written once and kept in pytest's cache between sessions.

    It runs before the per-test environment (``tests/conftest.py``) is set, so it sets the same quiet, offline one.
    """
    with pytest.MonkeyPatch.context() as patch:
        for name in ("TQDM_DISABLE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        return write_fixtures(pytestconfig.cache.mkdir("dcp-fixtures") / fixture_key())


@pytest.fixture
def dcp_copy(dcp_root: Path, tmp_path: Path):
    """A private copy of one variant, to damage."""

    def copy(variant: str) -> Path:
        target = tmp_path / variant
        shutil.copytree(dcp_root / variant, target)
        return target

    return copy


@pytest.fixture
def copied(tmp_path: Path):
    """A private copy of a folder (under ``name``, else its own), to damage or change."""

    def copy(folder: Path, name: str | None = None) -> Path:
        target = tmp_path / "copy" / (name or folder.name)
        shutil.copytree(folder, target)
        return target

    return copy


@pytest.fixture(scope="session")
def trainer_root(pytestconfig: pytest.Config) -> Path:
    """The folders of ``fixtures/trainer_dirs_writer.py`` (real DCP, accelerate and Trainer writers), cached."""
    from fixtures.trainer_dirs import fixture_key as trainer_key
    from fixtures.trainer_dirs import write_fixtures as write_trainer_dirs

    with pytest.MonkeyPatch.context() as patch:
        for name in ("TQDM_DISABLE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        return write_trainer_dirs(pytestconfig.cache.mkdir("trainer-dirs") / trainer_key())
