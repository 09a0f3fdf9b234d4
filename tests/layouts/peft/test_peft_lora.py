"""peft LoRA out of a sharded checkpoint, judged by PEFT itself: a tiny transformers Llama wrapped by PEFT on CPU
(r 4, alpha 16, every linear, B random and nonzero), its whole state dict (``base_layer`` names) written at tp 2
by reshard, then merged (``--merge-lora``: the weights of ``merge_and_unload()`` bit for bit, its logits) or
written as PEFT's adapter folder (``--layout peft``: ``PeftModel.from_pretrained`` gives the PeftModel's logits)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers
from fixtures.torchrun import HERE, source_key, write_once
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from reshard import ConvertOptions, convert

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = {
    "lora": {"target_modules": LINEARS},
    "rslora": {"target_modules": [*LINEARS, "embed_tokens", "lm_head"], "use_rslora": True},
    "dora": {"target_modules": ["q_proj", "o_proj"], "use_dora": True},
}
IDS = torch.arange(24).reshape(2, 12) * 5 % 96


def _base(folder: Path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return model


def _trained(base: LlamaForCausalLM, root: Path, name: str, extra: dict) -> None:
    """``root/name/``: PEFT's own adapter folder (``adapter/``) and the whole state dict at tp 2 (``tp2/``)."""
    torch.manual_seed(1)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, **extra))
    model.save_pretrained(root / name / "adapter")
    whole = root / name / "whole"
    whole.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, whole / "model.safetensors")
    base.config.save_pretrained(whole)
    shutil.copy(root / name / "adapter" / "adapter_config.json", whole)
    convert(whole, root / name / "tp2", ConvertOptions(tp=2, layout="hf-ranks", progress=False))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base model (``base/``) and one folder per variant of :data:`VARIANTS`."""
    root = tmp_path_factory.mktemp("peft")
    base = _base(root / "base")
    for name, extra in VARIANTS.items():
        _trained(base, root, name, extra)
    return root


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _peft(root: Path, adapter: Path) -> PeftModel:
    return PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(root / "base"), adapter)


@pytest.mark.parametrize("variant", ["lora", "rslora"])
def test_merge_equals_merge_and_unload(runs: Path, cli, variant: str) -> None:
    out = runs / variant / "merged"
    result = cli("convert", runs / variant / "tp2", "--tp", 1, "--merge-lora", "-o", out)
    assert result.exit_code == 0, result.output
    rule = "lora_alpha / sqrt(r) = 8" if variant == "rslora" else "lora_alpha / r = 4"
    assert rule in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "reshard.json"]
    oracle = _peft(runs, runs / variant / "adapter").merge_and_unload()
    want, got = oracle.state_dict(), load_file(out / "model.safetensors")
    assert set(got) == set(want)
    assert [name for name in want if not torch.equal(got[name], want[name])] == []  # PEFT merges fp32 in fp32
    assert torch.equal(_logits(LlamaForCausalLM.from_pretrained(out)), _logits(oracle))


@pytest.mark.parametrize("variant", ["lora", "rslora"])
def test_adapter_folder_loads_in_peft(runs: Path, cli, variant: str) -> None:
    out = runs / variant / "peft-out"
    result = cli("convert", runs / variant / "tp2", "--tp", 1, "--layout", "peft", "-o", out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "reshard.json",
    ]
    written = load_file(out / "adapter_model.safetensors")
    saved = load_file(runs / variant / "adapter" / "adapter_model.safetensors")
    lora = {k: v for k, v in saved.items() if "lora_" in k}  # PEFT also saves a targeted embedding's base weight
    assert set(written) == set(lora) and all(torch.equal(written[k], lora[k]) for k in lora)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 16, variant == "rslora")
    assert isinstance(config["lora_alpha"], int)
    assert config["task_type"] == "CAUSAL_LM"
    want = _logits(_peft(runs, runs / variant / "adapter"))
    assert torch.equal(_logits(_peft(runs, out)), want)


def test_dora_merges_whole_rows_only(runs: Path, cli) -> None:
    """DoRA's norm is over whole output rows: refused by name at tp 2 (o_proj's ranks hold half of each row);
    gathered to tp 1 first (unmerged), the merge equals ``merge_and_unload()``'s."""
    out = runs / "dora" / "merged"
    result = cli("convert", runs / "dora" / "tp2", "--tp", 1, "--merge-lora", "-o", out)
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert "merging DoRA at tp 2" in result.stderr and "lora_magnitude_vector" in result.stderr
    assert "convert it to --tp 1 first" in result.stderr
    assert not out.exists()
    assert cli("convert", runs / "dora" / "tp2", "--tp", 1, "-o", runs / "dora" / "tp1").exit_code == 0
    result = cli("convert", runs / "dora" / "tp1", "--tp", 1, "--merge-lora", "-o", out)
    assert result.exit_code == 0, result.output
    oracle = _peft(runs, runs / "dora" / "adapter").merge_and_unload()
    got, want = load_file(out / "model.safetensors"), oracle.state_dict()
    assert set(got) == set(want)
    assert [name for name in want if not torch.equal(got[name], want[name])] == []
    assert torch.equal(_logits(LlamaForCausalLM.from_pretrained(out)), _logits(oracle))


def test_dora_adapter_folder_carries_the_magnitudes(runs: Path, cli) -> None:
    """DoRA's magnitude (one per output row) is cut like B at tp 2 (q_proj's rows, o_proj's whole) and gathered."""
    out = runs / "dora" / "peft-out"
    result = cli("convert", runs / "dora" / "tp2", "--tp", 1, "--layout", "peft", "-o", out)
    assert result.exit_code == 0, result.output
    assert "DoRA magnitudes carried" in result.stdout
    written = load_file(out / "adapter_model.safetensors")
    saved = load_file(runs / "dora" / "adapter" / "adapter_model.safetensors")
    assert set(written) == set(saved) and all(torch.equal(written[k], saved[k]) for k in saved)
    assert json.loads((out / "adapter_config.json").read_text())["use_dora"] is True
    assert torch.equal(_logits(_peft(runs, out)), _logits(_peft(runs, runs / "dora" / "adapter")))


def test_verl_lora_alpha_zero_needs_the_real_alpha(runs: Path, tmp_path: Path, cli) -> None:
    """verl wrote ``lora_alpha: 0`` (verl#4553): not an alpha to merge with; ``--lora-alpha`` gives the trained one."""
    folder = tmp_path / "tp2"
    shutil.copytree(runs / "lora" / "tp2", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 0}))
    result = cli("convert", folder, "--tp", 1, "--merge-lora", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "lora_alpha = 0 is recorded" in result.stderr and "--lora-alpha" in result.stderr
    result = cli("convert", folder, "--tp", 1, "--layout", "peft", "--lora-alpha", 16, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["lora_alpha"] == 16


def test_missing_alpha_is_required(runs: Path, tmp_path: Path, cli) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(runs / "lora" / "tp2", bare)
    (bare / "adapter_config.json").unlink()
    result = cli("convert", bare, "--tp", 1, "--merge-lora", "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "lora_alpha" in result.stderr and "--lora-alpha" in result.stderr
    assert not (tmp_path / "out").exists()
    given = cli("convert", bare, "--tp", 1, "--merge-lora", "--lora-alpha", 16, "-o", tmp_path / "out")
    assert given.exit_code == 0, given.output
    got = load_file(tmp_path / "out" / "model.safetensors")
    oracle = _peft(runs, runs / "lora" / "adapter").merge_and_unload().state_dict()
    assert all(torch.equal(got[k], oracle[k]) for k in oracle)


def test_recorded_rank_and_alpha_are_checked(runs: Path, tmp_path: Path, cli) -> None:
    folder = tmp_path / "tp2"
    shutil.copytree(runs / "lora" / "tp2", folder)
    result = cli("convert", folder, "--tp", 1, "--merge-lora", "--lora-alpha", 8, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "--lora-alpha 8, but lora_alpha = 16 is recorded" in result.stderr
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    result = cli("convert", folder, "--tp", 1, "--merge-lora", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "r = 8, but the adapter's tensors have rank 4" in result.stderr
    (folder / "adapter_config.json").write_text(json.dumps({**config, "alpha_pattern": {"q_proj": 2}}))
    result = cli("convert", folder, "--tp", 1, "--layout", "peft", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "per-layer alphas (alpha_pattern)" in result.stderr
    assert not (tmp_path / "out").exists()


def test_several_adapters_need_a_choice(runs: Path, tmp_path: Path, cli) -> None:
    """Two adapters in one state dict: refused naming both, unless ``--adapter`` picks one (its config in
    ``<name>/``, where PEFT's ``save_pretrained`` puts a non-default adapter's)."""
    base = LlamaForCausalLM.from_pretrained(runs / "base")
    torch.manual_seed(2)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, target_modules=LINEARS))
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=3, init_lora_weights=False, target_modules=["v_proj"]))
    for name in ("default", "second"):
        model.set_adapter(name)
        with torch.no_grad():  # add_adapter starts B at zero (peft's init); give it values
            for param_name, param in model.named_parameters():
                if f"lora_B.{name}." in param_name:
                    param.copy_(torch.randn_like(param))
    model.save_pretrained(tmp_path / "adapters")
    whole = tmp_path / "whole"
    whole.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, whole / "model.safetensors")
    base.config.save_pretrained(whole)
    shutil.copy(tmp_path / "adapters" / "adapter_config.json", whole)
    shutil.copytree(tmp_path / "adapters" / "second", whole / "second")
    result = cli("convert", whole, "--tp", 1, "--merge-lora", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "holds 2 LoRA adapters: default, second" in result.stderr
    assert "--adapter NAME" in result.stderr
    result = cli("convert", whole, "--tp", 1, "--merge-lora", "--adapter", "second", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "left behind adapters default" in result.stdout
    model.set_adapter("second")
    oracle = model.merge_and_unload().state_dict()  # merges the active adapter, unloads the rest
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(oracle) and all(torch.equal(got[k], oracle[k]) for k in oracle)


def _rank_files(tp2: Path, out: Path) -> Path:
    """tp 2 as loose torch rank files (``pytorch_model_rank{r}.bin``: ``torch.save`` of each rank's state dict),
    beside the config and the adapter config."""
    out.mkdir()
    for rank in range(2):
        torch.save(load_file(tp2 / f"rank_0{rank}" / "model.safetensors"), out / f"pytorch_model_rank{rank}.bin")
    return out


def _dcp(tp2: Path, out: Path) -> Path:
    """The whole PEFT state dict saved by torch's DCP writer (one process), as FSDP trainers save through DCP."""
    import torch.distributed.checkpoint as dcp

    dcp.save(load_file(tp2.parent / "whole" / "model.safetensors"), checkpoint_id=out)
    return out


@pytest.mark.parametrize("sharding", ["torch-rank-files", "dcp"])
def test_other_shardings_merge_and_write_the_same(runs: Path, tmp_path: Path, cli, sharding: str) -> None:
    tp2 = runs / "lora" / "tp2"
    folder = (_rank_files if sharding == "torch-rank-files" else _dcp)(tp2, tmp_path / sharding)
    for side in ("config.json", "adapter_config.json"):
        shutil.copy(tp2 / side, folder)
    merged = cli("convert", folder, "--tp", 1, "--merge-lora", "-o", tmp_path / "merged")
    assert merged.exit_code == 0, merged.output
    oracle = _peft(runs, runs / "lora" / "adapter").merge_and_unload().state_dict()
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(got) == set(oracle) and all(torch.equal(got[k], oracle[k]) for k in oracle)
    adapter = cli("convert", folder, "--tp", 1, "--layout", "peft", "-o", tmp_path / "adapter")
    assert adapter.exit_code == 0, adapter.output
    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    saved = load_file(runs / "lora" / "adapter" / "adapter_model.safetensors")
    assert set(written) == set(saved) and all(torch.equal(written[k], saved[k]) for k in saved)


@pytest.fixture(scope="module")
def fsdp_run(pytestconfig: pytest.Config) -> Path:
    """``fixtures/peft_fsdp_writer.py`` under torchrun at world 2 (FSDP2 DTensor shards saved by DCP, and PEFT's own
    adapter of the same trained model), kept in pytest's cache between sessions."""
    versions = f"{torch.__version__} {transformers.__version__} {peft.__version__}"
    root = pytestconfig.cache.mkdir("peft-fsdp") / source_key([HERE / "peft_fsdp_writer.py", Path(__file__)], versions)
    return write_once(
        root,
        "fixtures.peft_fsdp_writer",
        ranks=2,
        prepare=lambda staging: _base(staging / "base"),
        args=lambda staging: [str(staging / "base"), str(staging)],
    )


def test_fsdp2_lora_run_merges_and_writes_as_peft(fsdp_run: Path, tmp_path: Path, cli) -> None:
    """A LoRA trained two steps under FSDP2 and saved by DCP: merged, the weights of ``merge_and_unload()`` of the
    same trained PeftModel bit for bit; as an adapter folder, PEFT's own save of it, tensor for tensor."""
    merged = cli("convert", fsdp_run / "dcp", "--tp", 1, "--merge-lora", "-o", tmp_path / "merged")
    assert merged.exit_code == 0, merged.output
    trained = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(fsdp_run / "base"), fsdp_run / "adapter")
    want = _logits(trained)
    oracle = trained.merge_and_unload()
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(got) == set(oracle.state_dict())
    assert all(torch.equal(got[k], v) for k, v in oracle.state_dict().items())
    adapter = cli("convert", fsdp_run / "dcp", "--tp", 1, "--layout", "peft", "-o", tmp_path / "adapter")
    assert adapter.exit_code == 0, adapter.output
    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    saved = load_file(fsdp_run / "adapter" / "adapter_model.safetensors")
    assert set(written) == set(saved) and all(torch.equal(written[k], saved[k]) for k in saved)
    base = LlamaForCausalLM.from_pretrained(fsdp_run / "base")
    assert torch.equal(_logits(PeftModel.from_pretrained(base, tmp_path / "adapter")), want)


def test_base_model_is_named(runs: Path, tmp_path: Path, cli) -> None:
    """``base_model_name_or_path``: ``--base-model``, else the recorded one, else the config's ``_name_or_path``."""
    folder = tmp_path / "tp2"
    shutil.copytree(runs / "lora" / "tp2", folder)
    recorded = json.loads((folder / "adapter_config.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": "org/from-config"}))

    def named(*flags: object) -> str | None:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        assert cli("convert", folder, "--tp", 1, "--layout", "peft", *flags, "-o", out).exit_code == 0
        return json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]

    assert named() == "org/from-config"
    (folder / "adapter_config.json").write_text(json.dumps({**recorded, "base_model_name_or_path": "org/recorded"}))
    assert named() == "org/recorded"
    assert named("--base-model", "/models/base") == "/models/base"


def test_inspect_says_what_merges_or_extracts(runs: Path, cli) -> None:
    result = cli("inspect", runs / "lora" / "tp2")
    assert result.exit_code == 0
    assert "holds peft LoRA adapter(s) default beside their base weights: --merge-lora" in result.stdout
    assert "holds peft" not in cli("inspect", runs / "lora" / "adapter").stdout  # an adapter alone
