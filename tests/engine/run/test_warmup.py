"""``reshard.engine.run.warmup``: torch is imported beside the planning, which must not need it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fixtures.models import tiny_llama


def test_planning_a_safetensors_conversion_never_imports_torch(tmp_path):
    """In a fresh interpreter, opening and planning a conversion leave torch unimported, so its 1-2 s import
    can run beside them."""
    tiny_llama(tmp_path / "orig")
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from reshard.engine.plan.open import open_checkpoint\n"
        "from reshard.engine.plan.target import plan_target\n"
        "from reshard.options import ConvertOptions\n"
        "options = ConvertOptions(tp=2)\n"
        "opened = open_checkpoint(Path(sys.argv[1]), options.read, target_tp=2)\n"
        "print(len(plan_target(opened, options).conversion.tensors), 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "orig")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    tensors, imported = done.stdout.split()
    assert int(tensors) > 10 and imported == "False"


@pytest.mark.parametrize(("extra", "started"), [("", "False"), (", dtype='bfloat16'", "True")])
def test_convert_imports_torch_on_a_thread_only_when_its_bytes_need_it(tmp_path, extra: str, started: str):
    """Importing the convert command leaves torch alone. Once the conversion is planned, one whose bytes need torch
    (a cast) has begun importing it on a thread, while the config's family is checked and the output staged; one
    that only moves bytes has not (and never imports it, tests/engine/test_stream.py)."""
    tiny_llama(tmp_path / "orig")
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "import reshard.commands.convert as convert_module\n"
        "from reshard.engine.run import warmup\n"
        "from reshard.options import ConvertOptions\n"
        "from reshard.plans import built_family\n"
        "check_counts, seen = built_family.check_counts, ['torch' in sys.modules]\n"
        "def watched(config, names):\n"
        "    seen.append(warmup._started.is_set())\n"
        "    return check_counts(config, names)\n"
        "built_family.check_counts = watched\n"
        f"options = ConvertOptions(tp=2, progress=False{extra})\n"
        "convert_module.convert(Path(sys.argv[1]), Path(sys.argv[2]), options)\n"
        "print(*seen)\n"
    )
    run = [sys.executable, "-c", probe, str(tmp_path / "orig"), str(tmp_path / "tp2")]
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    before, first_check = done.stdout.split()[:2]  # torch before the run, the import begun at the first check
    assert (before, first_check) == ("False", started) and (tmp_path / "tp2" / "reshard.json").exists()
