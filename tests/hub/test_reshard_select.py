"""Which files of a repo reshard fetches, from the file list alone."""

from __future__ import annotations

import json

import pytest

from reshard.errors import HubError
from reshard.hub.select import literal, plan_patterns, side_patterns, weight_files
from reshard.layouts.hf.folder import weight_files as folder_weight_files

INDEX = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
SMALL = {"model.safetensors.index.json": INDEX, "latest_checkpointed_iteration.txt": "200\n", "latest": "1000"}


def _weights(files: list[str], root: str = "") -> list[str]:
    return weight_files(files, root, lambda path: SMALL[path.rsplit("/", 1)[-1]])


@pytest.mark.parametrize(
    ("files", "root", "expected"),
    [
        (  # an index is authoritative: not the consolidated copy, not the original/ folder, not the .bin copies
            ["model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "consolidated.safetensors", "original/consolidated.00.pth", "pytorch_model.bin", "config.json"],
            "",
            ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
        ),
        (["model.safetensors", "adapter.safetensors", "pytorch_model.bin"], "", ["model.safetensors"]),
        (  # rank-named files, safetensors over torch copies
            ["model-rank-0.safetensors", "model-rank-1.safetensors", "model-rank-0.bin", "model-rank-1.bin"],
            "",
            ["model-rank-0.safetensors", "model-rank-1.safetensors"],
        ),
        (  # rank folders, and optimizer state left out
            ["rank_00/model.safetensors", "rank_01/model.safetensors", "onnx/model.safetensors", "notes/x.pt"],
            "",
            ["rank_00/model.safetensors", "rank_01/model.safetensors"],
        ),
        (
            ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_01_model_states.pt"],
            "",
            ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"],
        ),
        (  # Megatron: the tracker's iteration only, without the distributed optimizer
            ["latest_checkpointed_iteration.txt", "iter_0000100/mp_rank_00/model_optim_rng.pt",
             "iter_0000200/mp_rank_00/model_optim_rng.pt", "iter_0000200/mp_rank_00/distrib_optim.pt"],
            "",
            ["iter_0000200/mp_rank_00/model_optim_rng.pt"],
        ),
        (  # SAT: the iteration ``latest`` names
            ["ckpt/latest", "ckpt/1000/mp_rank_00_model_states.pt", "ckpt/500/mp_rank_00_model_states.pt"],
            "ckpt",
            ["ckpt/1000/mp_rank_00_model_states.pt"],
        ),
        (["run1/model.safetensors", "run2/model.safetensors"], "run2", ["run2/model.safetensors"]),
        (["run1/model.safetensors", "config.json"], "run1/model.safetensors", ["run1/model.safetensors"]),
    ],
    ids=["index", "single", "rank-files", "rank-folders", "deepspeed", "megatron", "sat", "folder", "file"],
)  # fmt: skip
def test_weight_files(files: list[str], root: str, expected: list[str]) -> None:
    assert _weights(files, root) == expected


def test_a_missing_shard_or_folder_is_named() -> None:
    with pytest.raises(HubError, match="names model-00002-of-00002.safetensors, which is not in the repo"):
        _weights(["model.safetensors.index.json", "model-00001-of-00002.safetensors"])
    with pytest.raises(HubError, match="no file or folder 'tp4' at this revision"):
        _weights(["tp2/model.safetensors"], "tp4")


def test_patterns_match_what_planning_and_copying_need() -> None:
    assert plan_patterns("runs/[a]/tp2") == [
        "runs/[[]a[]]/tp2/config.json",
        "runs/[[]a[]]/config.json",
        "runs/config.json",
        "config.json",
        "runs/[[]a[]]/tp2/*.index.json",
        "runs/[[]a[]]/tp2/reshard.json",
        "runs/[[]a[]]/tp2/latest_checkpointed_iteration.txt",
        "runs/[[]a[]]/tp2/latest",
    ]
    files = ["tp2/tokenizer.json", "tp2/tokenizer.model", "tp2/model.safetensors", "tp2/model.gguf", "tp2/x/a.json"]
    assert side_patterns("tp2", files) == ["tp2/tokenizer.json", "tp2/tokenizer.model"]
    assert literal("a*b?.json") == "a[*]b[?].json"


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
          "consolidated.safetensors", "pytorch_model.bin"],
         ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]),
        (["model.safetensors", "adapter.safetensors", "pytorch_model.bin"], ["model.safetensors"]),
        (["model-rank-0.safetensors", "model-rank-1.safetensors", "model-rank-0.bin"],
         ["model-rank-0.safetensors", "model-rank-1.safetensors"]),
        (["weights-a.bin", "weights-b.bin", "consolidated.00.pt", "consolidated.01.pth"],
         ["weights-a.bin", "weights-b.bin"]),
        (["model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "optimizer.pt", "distrib_optim.pt"],
         ["model_states.pt"]),
        (["optimizer.bin", "weights.pt"], ["weights.pt"]),
        (["config.json", "tokenizer.json"], []),
    ],
    ids=["index", "single", "safetensors-over-bin", "bin-and-pt", "optimizer-left-out", "only-optimizer-bin", "none"],
)  # fmt: skip
def test_local_and_hub_choose_the_same_files(tmp_path, names: list[str], expected: list[str]) -> None:
    """The Hub downloads exactly the files the local reader then reads, for the same names."""
    for name in names:
        (tmp_path / name).write_text(INDEX if name.endswith(".index.json") else "")
    local = [p.name for p in folder_weight_files(tmp_path)]
    hub = weight_files(names, "", lambda path: (tmp_path / path).read_text())
    assert local == hub == expected
