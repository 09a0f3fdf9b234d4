"""``reshard.engine.warmup``: torch is imported beside the planning, which must not need it, and the first
tensors' source slices are read ahead meanwhile."""

from __future__ import annotations

import subprocess
import sys
import threading

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
        "warmed, warm, read_ahead, done = [], SafetensorsReader.warm, warmup._read_ahead, threading.Event()\n"
        "def recording(self, key):\n"
        "    warmed.append(key)\n"
        "    warm(self, key)\n"
        "def reading_ahead(reads, importing):\n"
        "    read_ahead(reads, importing)\n"
        "    done.set()\n"
        "def importing():  # the import outlasts the reading ahead, which then stops at the budget only\n"
        "    done.wait()\n"
        "    importlib.import_module('torch')\n"
        "SafetensorsReader.warm, warmup._read_ahead, warmup._import_torch = recording, reading_ahead, importing\n"
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


def test_rank_files_only_torch_can_open_are_named_without_torch_in_rank_order(tmp_path):
    """Megatron and SAT rank files are found from folder names; other layouts and broken folders give none (the
    real open reports what is wrong)."""
    from fixtures.megatron import TINY, full_model, write_megatron
    from fixtures.sat import full_tensors, sat_config, write_sat

    from reshard.layouts import files_torch_opens

    megatron = write_megatron(tmp_path / "megatron", full_model(TINY), 4)
    assert [f.relative_to(megatron).as_posix() for f in files_torch_opens(megatron)] == [
        f"iter_0001000/mp_rank_0{r}/model_optim_rng.pt" for r in range(4)
    ]
    cfg = sat_config(tp=2)
    write_sat(tmp_path / "sat", cfg, full_tensors(cfg), 2)
    assert [f.name for f in files_torch_opens(tmp_path / "sat")] == [f"mp_rank_0{r}_model_states.pt" for r in range(2)]
    tiny_llama(tmp_path / "hf")
    assert files_torch_opens(tmp_path / "hf") == []
    (megatron / "latest_checkpointed_iteration.txt").write_text("not a number")
    assert files_torch_opens(megatron) == []


def test_rank_files_are_read_ahead_from_their_start_in_turns_within_the_budget(tmp_path, monkeypatch):
    from reshard.engine import warmup
    from reshard.io import direct

    files = [tmp_path / f"rank{r}.pt" for r in range(3)]
    for r, file in enumerate(files):
        file.write_bytes(bytes([r]) * (1000 + 300 * r))  # 1000, 1300 and 1600 bytes
    release = threading.Event()
    importing = threading.Thread(target=release.wait)  # stands for an import of torch still under way
    importing.start()
    monkeypatch.setattr(warmup, "_importing", importing)
    monkeypatch.setattr(warmup, "FILE_TURN", 500)
    monkeypatch.setattr(warmup, "WARM_BYTES", 3600)
    monkeypatch.setattr(direct, "_warm_ranges", {})
    try:
        warmup.warm_files(files).join(timeout=60)
    finally:
        release.set()
    # turns of 500 bytes: 1500 each round; the third round stops at the budget, before the third file's turn
    assert direct._warm_ranges == {
        str(files[0].resolve()): [(0, 1000)],
        str(files[1].resolve()): [(0, 1300)],
        str(files[2].resolve()): [(0, 1000)],
    }
    importing.join()
    assert warmup.warm_files(files) is None  # torch imported: nothing to wait for, nothing read ahead
