"""Megatron-Core 0.19's ``torch_dist``, proven against Megatron-Core 0.19.2 itself on CPU: it writes no
``common.pt`` (its ``args``, ``iteration`` and ``checkpoint_version`` are the ``common_state`` entry of the data
files), and reshard converts it with no ``--config``: to transformers with 0.19.2's logits, and to ``megatron``
and ``torch_dist`` files that 0.19.2 loads with the same logits.

0.19.2 declares Python >= 3.12 while shipping wheels that run on 3.11, and imports ``triton`` without declaring
it: its venv (``fixtures/venvs.py``, built once, ~100 s) installs it with ``--ignore-requires-python``, numpy
pinned and triton added. The oracle script is the 0.16.1 one (``oracles/mcore_gpt.py``), run unchanged with that
venv's python; its checkpoints are written once and cached (``fixtures/torchrun.py``).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from fixtures.dcp import rewrite_metadata
from fixtures.mcore19 import mcore19_python, written_by_mcore19
from oracles import run_jobs
from oracles.variants import Spec

from reshard.layouts.dcp.torch_dist_common import COMMON_STATE

pytestmark = pytest.mark.oracle

# DeepSeek-V3-like (MLA with q_lora_rank, YaRN, the grouped sigmoid router with its expert bias, scaled top-k, a
# shared expert, a dense first layer), under the local spec's names and Transformer Engine's (down projections whole).
# Without q_lora_rank 0.19 puts a norm before linear_q_proj (Transformer Engine's fused
# linear_q_proj.layer_norm_weight, which the local spec cannot build and transformers' DeepseekV3 has no place for).
SPECS = {
    "llama": Spec("llama", tp=2),
    "moe": Spec("moe", tp=2),
    "rope-linear": Spec("rope-linear", tp=2),  # rotary_seq_len_interpolation_factor -> rope_type linear
    "moe-dense-first": Spec("moe-dense-first", tp=2),  # Qwen3-MoE, mlp_only_layers [0]
    "moe-shared-gate-dense-first": Spec("moe-shared-gate-dense-first", tp=2),  # Qwen2-MoE, mlp_only_layers [0]
    "dsv3": Spec("dsv3", tp=2),
    "dsv3-te-names": Spec("dsv3", tp=2, overrides=(("te_names", "true"),)),
}
TOLERANCE = 1e-4  # fp32


@pytest.fixture(scope="module")
def mcore19(pytestconfig: pytest.Config) -> Path:
    return mcore19_python(pytestconfig)


@pytest.fixture(scope="module")
def written(pytestconfig: pytest.Config, mcore19: Path) -> Path:
    """``SPECS`` saved by Megatron-Core 0.19.2 (``<name>/torch_dist``, ``<name>/reference.pt``), once."""
    return written_by_mcore19(pytestconfig, mcore19, SPECS, "mcore-0.19-checkpoints")


def reference(written: Path, name: str) -> dict:
    ref = torch.load(written / name / "reference.pt", weights_only=True)
    return ref | {"logits": ref["logits"][..., : SPECS[name].model().vocab]}


def test_megatron_core_0_19_keeps_args_in_the_data_files(cli, written: Path) -> None:
    (iteration,) = (written / "llama" / "torch_dist").glob("iter_*")
    assert not (iteration / "common.pt").exists()
    report = json.loads(cli("inspect", written / "llama" / "torch_dist", "--json").stdout)
    assert any(f"read from {COMMON_STATE} in __0_0.distcp" in note for note in report["notes"])


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("name", list(SPECS))
def test_to_transformers_without_config(cli, written: Path, tmp_path: Path, name: str, fmt: str) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    result = cli("convert", written / name / fmt, "--tp", 1, "--layout", "hf", "-o", out)
    assert result.exit_code == 0, result.output
    ref = reference(written, name)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.inference_mode():
        logits = model.eval()(ref["input_ids"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=TOLERANCE)


def test_deepseek_v3_back_to_torch_dist_loads_in_megatron_core_0_19(cli, written: Path, mcore19: Path, tmp_path):
    """Megatron-Core 0.19.2 -> transformers DeepseekV3 -> ``torch_dist`` (Transformer Engine's names, as reshard writes
    them) and the legacy ``torch`` format at tp 2: 0.19.2 loads both at tp 2 with the first writer's logits."""
    hf, back, legacy = tmp_path / "hf", tmp_path / "back", tmp_path / "legacy"
    steps = ((written / "dsv3" / "torch_dist", hf, "hf", 1), (hf, back, "torch_dist", 1), (hf, legacy, "megatron", 2))
    for source, out, layout, tp in steps:
        result = cli("convert", source, "--tp", tp, "--layout", layout, "-o", out)
        assert result.exit_code == 0, result.output
    spec = Spec("dsv3", tp=2, overrides=(("te_names", "true"),)).to_json()
    jobs = [
        {"command": "load", "spec": spec, "ckpt": str(ckpt), "format": fmt, "strict": "assume_ok_unexpected"}
        | {"out": str(tmp_path / f"{fmt}.pt")}
        for ckpt, fmt in ((back, "torch_dist"), (legacy, "torch"))
    ]
    run_jobs(jobs, nproc=2, python=mcore19)
    for job in jobs:
        logits = torch.load(job["out"], weights_only=True)["logits"]
        torch.testing.assert_close(logits[..., :1000], reference(written, "dsv3")["logits"], rtol=0, atol=TOLERANCE)


def test_to_megatron_and_torch_dist_loaded_by_megatron_core_0_19(cli, written: Path, mcore19: Path, tmp_path):
    """reshard's legacy files (tp 2) and its ``torch_dist`` (``common.pt`` beside the data files, which 0.19.2
    reads as 0.16.1 does) load in Megatron-Core 0.19.2 with the writer's logits and the source's counters."""
    source, spec = written / "llama" / "torch_dist", SPECS["llama"]
    legacy, dist = tmp_path / "megatron", tmp_path / "torch_dist"
    for layout, out in (("megatron", legacy), ("torch_dist", dist)):
        result = cli("convert", source, "--tp", 2, "--layout", layout, "-o", out)
        assert result.exit_code == 0, result.output
    jobs = [
        {"command": "load", "spec": spec.to_json(), "ckpt": str(legacy), "format": "torch"},
        {"command": "load", "spec": Spec("llama", tp=1).to_json(), "ckpt": str(dist), "format": "torch_dist"},
    ]
    jobs = [job | {"out": str(tmp_path / f"{i}.pt"), "strict": "assume_ok_unexpected"} for i, job in enumerate(jobs)]
    run_jobs(jobs, nproc=2, python=mcore19)
    ref = reference(written, "llama")
    for job in jobs:
        out = torch.load(job["out"], weights_only=True)
        torch.testing.assert_close(out["logits"][..., :1000], ref["logits"], rtol=0, atol=TOLERANCE)
        assert (out["iteration"], out["checkpoint_version"]) == (10, 3.0)
        assert out["args"]["hidden_size"] == 64 and out["args"]["tensor_model_parallel_size"] == 2


class NotAllowed:
    """A class outside reshard's allow-list, pickled into a damaged common state."""


def _damaged(written: Path, tmp_path: Path, *, entry: object = None, length: int | None = None) -> Path:
    """A copy whose ``common_state`` is ``entry`` (appended to its data file), or claims ``length`` bytes."""
    copy = tmp_path / "copy"
    shutil.copytree(written / "llama" / "torch_dist", copy)
    (folder,) = copy.glob("iter_*")

    def change(metadata) -> None:
        key = next(k for k in metadata.storage_data if k.fqn == COMMON_STATE)
        info = metadata.storage_data[key]
        if entry is not None:
            buffer = io.BytesIO()
            torch.save(entry, buffer)
            with (folder / info.relative_path).open("ab") as file:
                info.offset = file.tell()
                file.write(buffer.getvalue())
            info.length = len(buffer.getvalue())
        if length is not None:
            info.length = length

    rewrite_metadata(folder, change)
    return copy


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ({"length": 1 << 30}, "1.1 GB claimed, more than the 67.1 MB"),
        ({"length": 1 << 20}, "claimed in a file of"),
        ({"entry": [1, 2]}, "holds a list of 2, not [dict]"),
        ({"entry": [{"args": NotAllowed()}]}, "NotAllowed, which is not on reshard's allow-list"),
    ],
    ids=["too-large", "past-the-end", "not-a-dict", "unsafe"],
)
def test_a_damaged_common_state_is_refused(cli, written: Path, tmp_path: Path, damage: dict, message: str) -> None:
    result = cli("inspect", _damaged(written, tmp_path, **damage))
    assert result.exit_code == 2, result.output
    assert message in result.output and COMMON_STATE in result.output and "Traceback" not in result.output
