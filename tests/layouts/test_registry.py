"""``reshard.layouts``: the registry is the one place a layout is known. A layout added as one spec is found, read,
converted from and refused as a target without any other module naming it; the engine, the commands, the Hub code
and the mappings import no layout package."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from fixtures.hf import load_folder, load_rank, write_hf

from reshard import convert, inspect_checkpoint
from reshard.errors import ReshardError
from reshard.layouts import (
    LAYOUTS,
    LayoutSpec,
    SourceCheckpoint,
    discover,
    find_layout,
    target_layout,
    tracker_files,
    writable_layouts,
)
from reshard.layouts.hf import HF
from reshard.options import ConvertOptions, ReadOptions

PACKAGE = Path(__file__).resolve().parents[2] / "reshard"
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
MARKER = "toy.layout"  # a folder: files beside the weights are copied into outputs, folders not


def _toy_detect(path: Path) -> bool:
    return (path / MARKER).is_dir()


def _toy_open(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """A read-only layout of its own: an HF folder beside a marker file (the registry decides, not the files)."""
    return dataclasses.replace(HF.open(path, options), layout="toy")


TOY = LayoutSpec(name="toy", looked_for="toy.layout", detect=_toy_detect, open=_toy_open)


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry with one more layout, tried first: the one line a new layout adds."""
    monkeypatch.setattr("reshard.layouts.LAYOUTS", (TOY, *LAYOUTS))


@pytest.fixture
def toy_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    state = {
        "model.embed_tokens.weight": torch.randn(64, 16),
        "lm_head.weight": torch.randn(64, 16),
        "model.norm.weight": torch.randn(16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(8, 16),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(8, 16),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(16, 16),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(32, 16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 32),
        "model.layers.0.input_layernorm.weight": torch.randn(16),
        "model.layers.0.post_attention_layernorm.weight": torch.randn(16),
    }
    folder = write_hf(tmp_path / "toy", CONFIG, state)
    (folder / MARKER).mkdir()
    return folder, state


def test_every_layout_has_one_name_and_the_writable_ones_are_listed() -> None:
    names = [spec.name for spec in LAYOUTS]
    assert sorted(names) == [
        "dcp",
        "deepspeed",
        "hf",
        "hf-ranks",
        "loose",
        "megatron",
        "nemo-rl",
        "openrlhf",
        "peft",
        "sat",
        "torch_dist",
        "verl",
    ]
    assert writable_layouts() == ["dcp", "deepspeed", "hf", "hf-ranks", "megatron", "peft", "sat", "torch_dist"]
    assert all(find_layout(name).name == name for name in names)
    assert find_layout("nope") is None


def test_trackers_come_from_the_layouts_that_have_them() -> None:
    trackers = tracker_files()
    assert list(trackers) == ["latest_checkpointed_iteration.txt", "latest"]
    assert trackers["latest_checkpointed_iteration.txt"](" 100\n") == "iter_0000100"
    assert trackers["latest_checkpointed_iteration.txt"]("release") == "release"
    assert trackers["latest"]("global_step7\n") == "global_step7"


@pytest.mark.usefixtures("toy_registered")
def test_a_layout_added_as_one_spec_is_detected_read_and_converted(
    toy_checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    folder, state = toy_checkpoint
    assert discover(folder).layout == "toy"
    assert inspect_checkpoint(folder).layout == "toy"
    report = convert(folder, tmp_path / "tp2", ConvertOptions(tp=2, progress=False))
    assert (report.source_layout, report.layout, report.tp) == ("toy", "hf-ranks", 2)
    manifest = json.loads((tmp_path / "tp2" / "reshard.json").read_text())
    assert manifest["source"]["layout"] == "toy"
    rank1 = load_rank(tmp_path / "tp2", 1)
    assert torch.equal(
        rank1["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.weight"][:, 16:]
    )
    back = convert(tmp_path / "tp2", tmp_path / "tp1", ConvertOptions(tp=1, progress=False))
    assert back.layout == "hf"
    gathered = load_folder(tmp_path / "tp1")
    assert sorted(gathered) == sorted(state)
    assert all(torch.equal(gathered[name], tensor) for name, tensor in state.items())


@pytest.mark.usefixtures("toy_registered")
def test_a_layout_without_a_writer_is_refused_as_a_target_before_any_output(
    toy_checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    folder, _ = toy_checkpoint
    with pytest.raises(
        ReshardError,
        match=r"cannot write the 'toy' layout.*dcp, deepspeed, hf, hf-ranks, megatron, peft, sat, torch_dist",
    ):
        convert(folder, tmp_path / "out", ConvertOptions(tp=1, layout="toy", progress=False))
    assert not (tmp_path / "out").exists()


def test_an_unknown_target_layout_names_the_known_ones(toy_checkpoint, tmp_path: Path) -> None:
    folder, _ = toy_checkpoint
    source = discover(folder)
    with pytest.raises(ReshardError, match=r"unknown layout 'nope'.*choose one of dcp, deepspeed, hf, hf-ranks"):
        target_layout("nope", source, 1)


def test_without_a_layout_a_source_keeps_its_own_only_when_its_spec_says_so(toy_checkpoint) -> None:
    folder, _ = toy_checkpoint
    source = discover(folder)
    assert target_layout(None, source, 1).name == "hf"
    assert target_layout(None, source, 4).name == "hf-ranks"
    assert target_layout(None, dataclasses.replace(source, layout="megatron"), 4).name == "megatron"
    assert target_layout(None, dataclasses.replace(source, layout="dcp"), 1).name == "hf"


def _imports(path: Path) -> list[str]:
    """Every ``reshard.*`` module a file imports, at any depth (lazy and ``TYPE_CHECKING`` imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("reshard"):
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("reshard")]
    return found


@pytest.mark.parametrize("package", ["engine", "commands", "hub", "mappings"])
def test_the_engine_commands_hub_and_mappings_import_no_layout_package(package: str) -> None:
    """They ask the registry (``reshard.layouts``) and the shared bases, never a layout's own package."""
    layout_packages = {p.name for p in (PACKAGE / "layouts").iterdir() if (p / "__init__.py").is_file()}
    assert {"hf", "megatron", "sat", "dcp"} <= layout_packages
    named = sorted(
        f"{path.relative_to(PACKAGE)}: {module}"
        for path in (PACKAGE / package).rglob("*.py")
        for module in _imports(path)
        if module.split(".")[:3][-1] in layout_packages and module.startswith("reshard.layouts.")
    )
    assert named == []
