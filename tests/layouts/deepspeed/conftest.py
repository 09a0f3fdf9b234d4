"""Session fixtures of the deepspeed layout tests: ZeRO checkpoints written by DeepSpeed itself (one torchrun for
all of them, in DeepSpeed's own venv), kept in pytest's cache between sessions."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fixtures.deepspeed import fixture_key, write_fixtures


@pytest.fixture(scope="session")
def ds_root(pytestconfig: pytest.Config) -> Path:
    with pytest.MonkeyPatch.context() as patch:
        for name in ("TQDM_DISABLE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        return write_fixtures(pytestconfig, pytestconfig.cache.mkdir("deepspeed-fixtures") / fixture_key())


@pytest.fixture
def ds_copy(ds_root: Path, tmp_path: Path):
    """A private copy of one variant, to damage."""

    def copy(variant: str) -> Path:
        target = tmp_path / variant
        shutil.copytree(ds_root / variant, target)
        return target

    return copy
