"""verl actors written once per key by the real framework (FSDP2 under torchrun), shared by the verl tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.verl_runs import fixture_key, write_verl_run


def _written(config: pytest.Config, world: int) -> Path:
    with pytest.MonkeyPatch.context() as patch:
        for name in ("TQDM_DISABLE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        return write_verl_run(config.cache.mkdir(f"verl-world{world}") / fixture_key(), world=world)


@pytest.fixture(scope="session")
def verl2(pytestconfig: pytest.Config) -> Path:
    """World 2: ``run/`` (tracker, ``global_step_1/actor`` of FSDP2 DTensors, ``data.pt``), ``hsdp/actor`` (mesh
    ``("ddp", "fsdp")`` of 2 x 1), ``fsdp1/actor`` (FSDP1's sharded state dict), ``oracle.pt``, ``hsdp_oracle.pt`` and
    ``fsdp1_oracle.pt`` (each model's full state dict)."""
    return _written(pytestconfig, 2)


@pytest.fixture(scope="session")
def verl1(pytestconfig: pytest.Config) -> Path:
    """World 1: ``actor/`` of plain tensors and ``oracle.pt``."""
    return _written(pytestconfig, 1)
