"""An OpenRLHF checkpoint written once per key by DeepSpeed as OpenRLHF's saver calls it, shared by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.openrlhf_runs import fixture_key, write_openrlhf_run


@pytest.fixture(scope="session")
def openrlhf(pytestconfig: pytest.Config) -> Path:
    """``ckpt/`` (``_actor/`` of DeepSpeed ZeRO-2 bf16 at 2 ranks, ``global_step1_hf/``) and ``oracle.pt``
    (DeepSpeed's ``zero_to_fp32`` of ``_actor/``)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("TQDM_DISABLE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        return write_openrlhf_run(pytestconfig, pytestconfig.cache.mkdir("openrlhf") / fixture_key())
