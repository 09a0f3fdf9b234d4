"""The FSDP2 training run the DCP resume tests start from, trained once per session."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fixtures.models import tiny_llama
from fixtures.resumed import torchrun


@pytest.fixture(scope="session")
def fsdp_trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fixtures/fsdp_resume.py`` trained at world 2: ``src/`` (DCP, with ``config.json``), ``saved.pt`` and
    ``reference.json``. Tests write their conversions and resumes elsewhere."""
    root = tmp_path_factory.mktemp("fsdp")
    tiny_llama(root / "hf", vocab=128, num_attention_heads=4, num_key_value_heads=2)
    torchrun("fixtures.fsdp_resume", ranks=2, args=["train", str(root / "hf"), str(root)])
    shutil.copy(root / "hf" / "config.json", root / "src" / "config.json")
    return root
