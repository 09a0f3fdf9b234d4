"""The good checkpoints the corpus damages: one per layout reshard reads, built from the small samples.

Each comes with the arguments every command takes for it (the checkpoint itself goes first); every base
passes every command (``test_corpus.py::test_every_base_passes_every_command``), so a damaged copy that
fails does so because of its damage.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

SAMPLES = Path(__file__).resolve().parents[2] / "sample_ckpts"
_HALF = {"inspect": [], "check": ["--tp", "2"], "convert": ["--tp", "2"], "fix": []}
# Per base: the arguments of each command after the checkpoint (-o OUT -q are added by the harness).
ARGS: dict[str, dict[str, list[str]]] = {
    "hf": {**_HALF, "verify": []},
    "hf_sharded": {**_HALF, "verify": []},
    "bin": {**_HALF, "verify": ["--roundtrip", "2"]},
    "hf_ranks": {**_HALF, "convert": ["--tp", "1"], "verify": []},
    "loose": {**_HALF, "convert": ["--tp", "1"], "verify": ["--roundtrip", "1"]},
    "megatron": {
        "inspect": [],
        "check": ["--tp", "4"],
        "convert": ["--tp", "4", "--vocab", "500"],
        "fix": ["--vocab", "500"],
        "verify": ["--roundtrip", "8"],  # the true vocab is unknown: only its own tp keeps the padding
    },
    "sat": {"inspect": [], "check": ["--tp", "4"], "convert": ["--tp", "4"], "fix": [], "verify": []},
    "dcp": {**_HALF, "verify": ["--roundtrip", "2"]},
}


def build_bases(root: Path) -> dict[str, Path]:
    """Write every base under ``root`` (once; a finished ``root`` is reused) and return ``{name: folder}``."""
    from reshard.commands.convert import convert
    from reshard.options import ConvertOptions

    bases = {name: root / name for name in ARGS}
    if (root / "DONE").exists():
        return bases
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    quiet = {"progress": False, "jobs": 2}
    convert(SAMPLES / "tiny-llama-tp2", bases["hf"], ConvertOptions(tp=1, **quiet))
    convert(SAMPLES / "tiny-llama-tp2", bases["hf_sharded"], ConvertOptions(tp=1, max_shard_size=150_000, **quiet))
    bases["bin"].mkdir()
    torch.save(load_file(bases["hf"] / "model.safetensors"), bases["bin"] / "pytorch_model.bin")
    shutil.copy(bases["hf"] / "config.json", bases["bin"] / "config.json")
    shutil.copytree(SAMPLES / "tiny-llama-tp2", bases["hf_ranks"])
    shutil.copytree(SAMPLES / "tiny-llama-65535-tp2", bases["loose"])
    shutil.copytree(SAMPLES / "tiny-megatron-tp8", bases["megatron"])
    shutil.copytree(SAMPLES / "tiny-cogagent-sat-tp8", bases["sat"])
    _dcp(bases["hf"], bases["dcp"])
    (root / "DONE").write_text("ok\n")
    return bases


def _dcp(hf: Path, folder: Path) -> None:
    """The tiny Llama saved by ``torch.distributed.checkpoint`` itself, in one process (one chunk per tensor)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save(dict(load_file(hf / "model.safetensors")), checkpoint_id=folder, no_dist=True)
    shutil.copy(hf / "config.json", folder / "config.json")


def copy_base(base: Path, target: Path) -> Path:
    shutil.copytree(base, target, symlinks=True)
    return target
