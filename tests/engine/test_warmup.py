"""``reshard.engine.warmup``: torch is imported beside the planning, which must not need it."""

from __future__ import annotations

import subprocess
import sys

from fixtures.models import tiny_llama


def test_planning_a_safetensors_conversion_never_imports_torch(tmp_path):
    """In a fresh interpreter, opening and planning a conversion leave torch unimported, so its 1-2 s import
    can run beside them."""
    tiny_llama(tmp_path / "orig")
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from reshard.engine.open import open_checkpoint\n"
        "from reshard.engine.target import plan_target\n"
        "from reshard.options import ConvertOptions\n"
        "options = ConvertOptions(tp=2)\n"
        "opened = open_checkpoint(Path(sys.argv[1]), options.read, target_tp=2)\n"
        "print(len(plan_target(opened, options).conversion.tensors), 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "orig")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    tensors, imported = done.stdout.split()
    assert int(tensors) > 10 and imported == "False"


def test_convert_imports_torch_on_a_thread_while_it_plans(tmp_path):
    """Importing the convert command leaves torch alone; by the time planning starts, its import has begun."""
    tiny_llama(tmp_path / "orig")
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "import reshard.commands.convert as convert_module\n"
        "import reshard.engine.run as run_module\n"
        "from reshard.engine import warmup\n"
        "from reshard.options import ConvertOptions\n"
        "plan_target, seen = run_module.plan_target, ['torch' in sys.modules]\n"
        "def watched(opened, options):\n"
        "    seen.append(warmup._started.is_set())\n"
        "    return plan_target(opened, options)\n"
        "run_module.plan_target = watched\n"
        "convert_module.convert(Path(sys.argv[1]), Path(sys.argv[2]), ConvertOptions(tp=2, progress=False))\n"
        "print(*seen)\n"
    )
    run = [sys.executable, "-c", probe, str(tmp_path / "orig"), str(tmp_path / "tp2")]
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"] and (tmp_path / "tp2" / "reshard.json").exists()
