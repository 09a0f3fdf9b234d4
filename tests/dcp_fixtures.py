"""DCP checkpoints written by the real ``torch.distributed.checkpoint`` under ``torchrun`` (see ``dcp_writer.py``),
cached across test sessions in pytest's cache folder (keyed by the writer's source and the library versions),
and helpers to damage copies of them."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch

HERE = Path(__file__).parent
WRITER = HERE / "dcp_writer.py"
# Variants whose tensors carry the tiny Llama's HF names (a config.json is copied beside them).
LLAMA_VARIANTS = ("tp2", "fsdp_tp_bf16", "tp4_bf16_nocoll", "safetensors", "hf_sharded")
VARIANTS = (*LLAMA_VARIANTS, "misc")
RANKS = 4


def fixture_key() -> str:
    digest = hashlib.sha256()
    for path in (WRITER, HERE / "helpers.py", Path(__file__)):
        digest.update(path.read_bytes())
    digest.update(f"{torch.__version__} {version('transformers')}".encode())
    return digest.hexdigest()[:16]


def write_fixtures(root: Path) -> Path:
    """Write every variant under ``root`` (once: a finished ``root`` is reused) and return it."""
    done = root / "DONE"
    if done.exists():
        return root
    from helpers import tiny_llama

    staging = root.with_name(root.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tiny_llama(staging / "hf_source", vocab=1001)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    done_run = subprocess.run(
        [*command, str(WRITER), str(staging / "hf_source"), str(staging)], capture_output=True, text=True, env=env
    )
    if done_run.returncode != 0:
        raise RuntimeError(f"torchrun dcp_writer.py failed:\n{done_run.stderr[-4000:]}")
    for variant in LLAMA_VARIANTS:
        shutil.copy(staging / "hf_source" / "config.json", staging / variant / "config.json")
    for stale in root.parent.iterdir():  # fixtures of older writers or versions
        if stale != staging:
            shutil.rmtree(stale, ignore_errors=True)
    staging.rename(root)
    done.write_text("ok\n")
    return root


def expected(root: Path, variant: str) -> dict[str, torch.Tensor]:
    """The tensors the writer held before it sharded them."""
    return torch.load(root / f"{variant}.expected.pt", weights_only=True)


def rewrite_metadata(folder: Path, change: Callable[[object], None], name: str = ".metadata") -> None:
    """Load a real ``.metadata`` with torch's own classes, let ``change`` damage it, and save it back."""
    import torch.distributed.checkpoint  # noqa: F401  (the pickled classes)

    path = folder / name
    metadata = pickle.loads(path.read_bytes())
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def storage_key(metadata, fqn: str, offsets) -> object:
    """The ``storage_data`` key of one chunk."""
    return next(k for k in metadata.storage_data if k.fqn == fqn and tuple(k.offset or ()) == tuple(offsets))
