"""NeMo-RL steps written once per key (FSDP2 under torchrun, saved as NeMo-RL saves them), shared by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.nemo_rl_runs import fixture_key, write_nemo_rl_run


@pytest.fixture(scope="session")
def nemo_rl(pytestconfig: pytest.Config) -> Path:
    """``v1/step_3`` (weights nested ``{"model": ...}``), ``v2/step_3`` (flat, in ``weights/model/``), ``source/``
    (the model's config.json) and ``oracle.pt`` (the model's full state dict)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("TQDM_DISABLE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        return write_nemo_rl_run(pytestconfig.cache.mkdir("nemo-rl") / fixture_key())
