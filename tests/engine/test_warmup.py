"""``reshard.engine.warmup``: torch is imported beside the planning, which must not need it, and the first
tensors' source slices are read ahead meanwhile."""

from __future__ import annotations

import subprocess
import sys

from fixtures.models import tiny_llama

from reshard.engine.open import open_checkpoint
from reshard.engine.target import plan_target
from reshard.options import ConvertOptions


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
        "from reshard.engine import warmup\n"
        "from reshard.options import ConvertOptions\n"
        "plan_target, seen = convert_module.plan_target, ['torch' in sys.modules]\n"
        "def watched(opened, options):\n"
        "    seen.append(warmup._started.is_set())\n"
        "    return plan_target(opened, options)\n"
        "convert_module.plan_target = watched\n"
        "convert_module.convert(Path(sys.argv[1]), Path(sys.argv[2]), ConvertOptions(tp=2, progress=False))\n"
        "print(*seen)\n"
    )
    run = [sys.executable, "-c", probe, str(tmp_path / "orig"), str(tmp_path / "tp2")]
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"] and (tmp_path / "tp2" / "reshard.json").exists()


def test_the_first_tensors_are_read_ahead_while_torch_imports(tmp_path, cli):
    """Their source slices, in the order the engine gathers them, within the byte budget; the engine takes
    them from the page cache and writes the same bytes as without."""
    tiny_llama(tmp_path / "orig")
    assert cli("convert", tmp_path / "orig", "--tp", 2, "-o", tmp_path / "plain").exit_code == 0
    probe = (
        "import importlib, sys, threading\n"
        "from pathlib import Path\n"
        "from reshard.commands.convert import convert\n"
        "from reshard.engine import warmup\n"
        "from reshard.layouts.readers import SafetensorsReader\n"
        "from reshard.options import ConvertOptions\n"
        "warmed, warm, read_ahead, done = [], SafetensorsReader.warm, warmup._warm, threading.Event()\n"
        "def recording(self, key):\n"
        "    warmed.append(key)\n"
        "    warm(self, key)\n"
        "def reading_ahead(refs, importing):\n"
        "    read_ahead(refs, importing)\n"
        "    done.set()\n"
        "def importing():  # the import outlasts the reading ahead, which then stops at the budget only\n"
        "    done.wait()\n"
        "    importlib.import_module('torch')\n"
        "SafetensorsReader.warm, warmup._warm, warmup._import_torch = recording, reading_ahead, importing\n"
        "warmup.WARM_BYTES = int(sys.argv[3])\n"
        "convert(Path(sys.argv[1]), Path(sys.argv[2]), ConvertOptions(tp=2, progress=False))\n"
        "print(' '.join(warmed))\n"
    )
    budget = 300_000  # the embedding (1001 x 64 fp32) and a few layer tensors, not the whole model
    run = [sys.executable, "-c", probe, str(tmp_path / "orig"), str(tmp_path / "warm"), str(budget)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    warmed = done.stdout.split()
    options = ConvertOptions(tp=2)
    plan = plan_target(open_checkpoint(tmp_path / "orig", options.read, target_tp=2), options).conversion
    refs = [ref for tensor in plan.tensors for source in tensor.sources for ref in source.refs]
    assert warmed and warmed == [ref.key for ref in refs[: len(warmed)]]  # the first ones the engine gathers
    size = sum(ref.header.nbytes for ref in refs[: len(warmed)])
    assert size <= budget < size + refs[len(warmed)].header.nbytes
    for path in (tmp_path / "plain").rglob("*.safetensors"):
        assert path.read_bytes() == (tmp_path / "warm" / path.relative_to(tmp_path / "plain")).read_bytes()
