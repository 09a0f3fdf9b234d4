"""Golden outputs: every sample checkpoint through every command, hashed, to prove a refactor changed no byte.

Each case runs one ``reshard`` command line on a committed sample in ``sample_ckpts/`` (every layout, tp 1/2/4/8,
``fix``, ``--merge-lora``, refusals included) and records the exit code, the sha256 of every file written and of what
the command printed. ``reshard.json`` is hashed without its ``created`` stamp and its ``conversion`` record (the source
files' times), and with every tensor's digest as sha256 (:func:`_as_sha256`): the stored hashes are of manifests that
recorded sha256, and a manifest's digest algorithm is not what these cases pin down (each data file's bytes are). The
temporary output folder is written as ``OUT`` in printed text.

    python tests/golden/golden.py          # rewrite tests/golden/outputs.json from this code
    pytest tests/test_golden_outputs.py    # compare this code with the stored hashes

Rewrite the hashes only for a change that means to change outputs, and say so in its commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
STORED = Path(__file__).resolve().parent / "outputs.json"
LLAMA, LOOSE = "sample_ckpts/tiny-llama-tp2", "sample_ckpts/tiny-llama-65535-tp2"
PROGRESS = re.compile(r"^[\w ]+:\s+\d+%\|")  # a tqdm bar (on when tqdm was imported before TQDM_DISABLE)
MEGATRON, SAT = "sample_ckpts/tiny-megatron-tp8", "sample_ckpts/tiny-cogagent-sat-tp8"

# name -> reshard arguments; "OUT" is replaced by a fresh output folder.
CASES: dict[str, list[str]] = {
    "llama-inspect": ["inspect", LLAMA, "--json"],
    "llama-check-4": ["check", LLAMA, "--tp", "4", "--json"],
    "llama-check-8": ["check", LLAMA, "--tp", "8", "--json"],
    "llama-tp1": ["convert", LLAMA, "--tp", "1", "-o", "OUT", "--json"],
    "llama-tp2": ["convert", LLAMA, "--tp", "2", "-o", "OUT", "--json"],
    "llama-tp4": ["convert", LLAMA, "--tp", "4", "-o", "OUT", "--json"],
    "llama-tp8": ["convert", LLAMA, "--tp", "8", "-o", "OUT", "--json"],
    "llama-tp3-uneven": ["convert", LLAMA, "--tp", "3", "--uneven", "-o", "OUT", "--json"],
    "llama-tp1-ranks": ["convert", LLAMA, "--tp", "1", "--layout", "hf-ranks", "-o", "OUT", "--json"],
    "llama-tp2-pad16": ["convert", LLAMA, "--tp", "2", "--pad-multiple", "16", "-o", "OUT", "--json"],
    "llama-tp1-shards": ["convert", LLAMA, "--tp", "1", "--max-shard-size", "100KB", "-o", "OUT", "--json"],
    "llama-fix": ["fix", LLAMA, "-o", "OUT", "--json"],
    "llama-verify": ["verify", LLAMA, "--roundtrip", "2,4,8", "--json"],
    "loose-inspect": ["inspect", LOOSE, "--json"],
    "loose-fix": ["fix", LOOSE, "--vocab", "65535", "-o", "OUT", "--json"],
    "loose-fix-text": ["fix", LOOSE, "--vocab", "65535", "-o", "OUT"],
    "loose-fix-tp4": ["fix", LOOSE, "--vocab", "65535", "--tp", "4", "-o", "OUT", "--json"],
    "loose-fix-tp2": ["fix", LOOSE, "--vocab", "65535", "--tp", "2", "-o", "OUT", "--json"],
    "loose-fix-no-vocab": ["fix", LOOSE, "-o", "OUT", "--json"],
    "loose-fix-one-rank": ["fix", LOOSE + "/pytorch_model_rank0.bin", "--vocab", "65535", "-o", "OUT"],
    "loose-tp1": ["convert", LOOSE, "--tp", "1", "-o", "OUT", "--json"],
    "loose-tp8": ["convert", LOOSE, "--tp", "8", "--vocab", "65535", "-o", "OUT", "--json"],
    "megatron-inspect": ["inspect", MEGATRON, "--json"],
    "megatron-check-4": ["check", MEGATRON, "--tp", "4", "--json"],
    "megatron-tp1": ["convert", MEGATRON, "--tp", "1", "--vocab", "500", "-o", "OUT", "--json"],
    "megatron-tp2": ["convert", MEGATRON, "--tp", "2", "--vocab", "500", "-o", "OUT", "--json"],
    "megatron-tp4": ["convert", MEGATRON, "--tp", "4", "--vocab", "500", "-o", "OUT", "--json"],
    "megatron-tp8": ["convert", MEGATRON, "--tp", "8", "-o", "OUT", "--json"],
    "megatron-tp3": ["convert", MEGATRON, "--tp", "3", "-o", "OUT", "--json"],
    "megatron-hf": ["convert", MEGATRON, "--tp", "1", "--layout", "hf", "--vocab", "500", "-o", "OUT", "--json"],
    "megatron-ranks": ["convert", MEGATRON, "--tp", "2", "--layout", "hf-ranks", "-o", "OUT", "--json"],
    "megatron-ranks-vocab": [
        "convert",
        MEGATRON,
        "--tp",
        "2",
        "--layout",
        "hf-ranks",
        "--vocab",
        "500",
        "-o",
        "OUT",
        "--json",
    ],
    "megatron-hf-keep": [
        "convert",
        MEGATRON,
        "--tp",
        "1",
        "--layout",
        "hf",
        "--vocab",
        "500",
        "--keep-names",
        "-o",
        "OUT",
        "--json",
    ],
    "megatron-verify": ["verify", MEGATRON, "--roundtrip", "4", "--json"],
    "sat-inspect": ["inspect", SAT, "--json"],
    "sat-check-2": ["check", SAT, "--tp", "2", "--json"],
    "sat-tp1": ["convert", SAT, "--tp", "1", "--layout", "sat", "-o", "OUT", "--json"],
    "sat-tp2": ["convert", SAT, "--tp", "2", "--layout", "sat", "-o", "OUT", "--json"],
    "sat-tp4": ["convert", SAT, "--tp", "4", "--layout", "sat", "-o", "OUT", "--json"],
    "sat-tp8": ["convert", SAT, "--tp", "8", "--layout", "sat", "-o", "OUT", "--json"],
    "sat-merge-tp4": ["convert", SAT, "--tp", "4", "--merge-lora", "-o", "OUT", "--json"],
    "sat-merge-hf": ["convert", SAT, "--tp", "1", "--merge-lora", "--layout", "hf", "-o", "OUT", "--json"],
    "sat-merge-alpha": ["convert", SAT, "--tp", "2", "--merge-lora", "--lora-alpha", "4", "-o", "OUT", "--json"],
    "sat-verify": ["verify", SAT, "--json"],
}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _as_sha256(manifest: dict, folder: Path) -> dict:
    """The manifest with each ``blake3`` digest checked against the tensor's bytes in ``folder`` (gathered as
    ``verify`` does) and replaced by the sha256 of those bytes; a digest that does not match is left as it is
    (so the case's hash differs from the stored one)."""
    import blake3
    import torch

    from reshard.engine.move.gather import gather_canonical
    from reshard.engine.plan.open import open_checkpoint
    from reshard.options import ReadOptions

    entries = manifest.get("tensors", {})
    if not any("blake3" in entry for entry in entries.values()):
        return manifest
    tensors = open_checkpoint(folder, ReadOptions(), target_tp=1, recorded_plan=True)
    by_name = tensors.by_name()
    with torch.inference_mode():
        for name, entry in entries.items():
            if "blake3" not in entry or name not in by_name:
                continue
            raw = gather_canonical(by_name[name]).contiguous().reshape(-1).view(torch.uint8)
            data = raw.numpy().tobytes()
            if blake3.blake3(data).hexdigest() == entry["blake3"]:
                del entry["blake3"]
                entry["sha256"] = _sha(data)
    return manifest


def _file_hash(path: Path) -> str:
    if path.name == "reshard.json":
        manifest = json.loads(path.read_text())
        manifest.pop("created", None)
        manifest.pop("conversion", None)  # the source files' modification times: of this clone, not of the output
        manifest = _as_sha256(manifest, path.parent)
        return _sha(json.dumps(manifest, sort_keys=True).encode())
    return _sha(path.read_bytes())


def run_case(args: list[str], scratch: Path) -> dict[str, object]:
    """Run one command in-process; its exit code and the hashes of its output files and printed text."""
    from reshard.cli import main

    out = scratch / "out"
    argv = [str(out) if a == "OUT" else a for a in args]
    result = CliRunner().invoke(main, argv, catch_exceptions=False)
    files = {}
    if out.is_dir():
        files = {str(p.relative_to(out)): _file_hash(p) for p in sorted(out.rglob("*")) if p.is_file()}

    def clean(text: str) -> str:
        return text.replace(str(out), "OUT")

    printed = [line for line in re.split(r"[\r\n]+", clean(result.stderr)) if not PROGRESS.match(line)]

    return {
        "exit": result.exit_code,
        "stdout": _sha(clean(result.stdout).encode()),
        "stderr": "\n".join(printed).strip(),
        "files": files,
    }


def run_all() -> dict[str, dict[str, object]]:
    """Every case, from the repository root (sample paths are relative, as the manifests record them)."""
    here = Path.cwd()
    os.chdir(ROOT)
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        results = {}
        for name, args in CASES.items():
            with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as tmp:
                results[name] = run_case(args, Path(tmp))
        return results
    finally:
        os.chdir(here)


if __name__ == "__main__":
    STORED.write_text(json.dumps(run_all(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {STORED}", file=sys.stderr)
