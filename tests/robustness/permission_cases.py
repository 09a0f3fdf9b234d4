"""Permission errors through every command, run as a process that permission bits apply to.

``python permission_cases.py BASES WORK`` damages copies of the bases under WORK, runs every command on each,
and prints ``{case: [broken promises]}`` as JSON. ``test_permissions.py`` runs it without the capabilities
that let root ignore permission bits (``setpriv``), or as is for another user.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bases import ARGS, copy_base  # noqa: E402
from harness import COMMANDS, Workspace, clear_outputs, judge, run, snapshot  # noqa: E402

# name: (base, what to make unreadable or unwritable, fragments the error names, exit codes that are not 2)
CASES: dict[str, tuple[str, Callable[[Workspace], Path], tuple[str, ...], dict[str, int]]] = {
    "unreadable-safetensors": ("hf", lambda ws: ws.ckpt / "model.safetensors", ("model.safetensors",), {}),
    "unreadable-rank-folder": ("hf_ranks", lambda ws: ws.ckpt / "rank_01", ("rank_01", "Permission denied"), {}),
    "unreadable-config": ("hf", lambda ws: ws.ckpt / "config.json", ("config.json", "Permission denied"), {}),
    "unreadable-torch-rank": ("loose", lambda ws: ws.ckpt / "pytorch_model_rank1.bin", ("rank1.bin",), {}),
    "unreadable-dcp-metadata": ("dcp", lambda ws: ws.ckpt / ".metadata", (".metadata", "Permission denied"), {}),
    "unreadable-megatron-rank": (
        "megatron",
        lambda ws: ws.ckpt / "iter_0000100" / "mp_rank_05" / "model_optim_rng.pt",
        ("mp_rank_05", "Permission denied"),
        {},
    ),
    "unwritable-output-folder": (
        "hf",
        lambda ws: ws.outs,
        ("Permission denied",),
        {"inspect": 0, "check": 0, "verify": 0},
    ),
}


def main(bases: Path, work: Path) -> dict[str, list[str]]:
    report = {}
    for name, (base, target, names, exits) in CASES.items():
        ws = Workspace(work / name)
        copy_base(bases / base, ws.ckpt)
        locked = target(ws)
        locked.chmod(0o555 if locked == ws.outs else 0)
        before = snapshot(ws.ckpt)
        broken = []
        try:
            for command in COMMANDS:
                outcome = run(command, ws.ckpt, ARGS[base][command], ws)
                broken += judge(outcome, ws, before, exit_code=exits.get(command, 2), names=names)
                clear_outputs(ws)
        finally:
            locked.chmod(0o755 if locked.is_dir() else 0o644)
        report[name] = broken
    return report


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))))
