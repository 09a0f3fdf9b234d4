"""The ``dcp`` layout on checkpoints written by ``torch.distributed.checkpoint`` itself (``fixtures/dcp_writer``): the
assembled global tensors equal what DCP loads, bit for bit, and inspect / convert / check work on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures.checks import check_in_a_fresh_interpreter
from fixtures.dcp import LLAMA_VARIANTS, VARIANTS, expected
from fixtures.hf import load_folder
from fixtures.models import logits
from safetensors.torch import load_file

from reshard.formats.boxes import Box
from reshard.formats.dcp_metadata.read import read_index
from reshard.layouts import discover
from reshard.layouts.dcp.boxed_reader import BoxedReader, BoxView, StackedView


def assembled(folder: Path) -> dict[str, torch.Tensor]:
    source = discover(folder)
    assert source.layout == "dcp" and source.tp == 1
    return {name: ref.read() for name, ref in source.ranks[0].items()}


def dcp_loaded(folder: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """What DCP itself loads without a process group: ``dcp_to_torch_save``, then the model part."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    return state.get("model", state)


def hf_loaded(folder: Path) -> dict[str, torch.Tensor]:
    """What DCP's ``HuggingFaceStorageReader`` loads (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    metadata = HuggingFaceStorageReader(str(folder)).read_metadata()
    state = {
        name: torch.empty(tuple(m.size), dtype=m.properties.dtype) for name, m in metadata.state_dict_metadata.items()
    }
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    return state


@pytest.mark.parametrize("variant", VARIANTS)
def test_assembled_tensors_are_the_ones_the_writer_held(dcp_root, variant):
    got, want = assembled(dcp_root / variant), expected(dcp_root, variant)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("variant", ["tp2", "fsdp_tp_bf16", "misc"])
def test_assembled_tensors_equal_what_dcp_loads(dcp_root, variant, tmp_path):
    got, loaded = assembled(dcp_root / variant), dcp_loaded(dcp_root / variant, tmp_path)
    assert got and set(got) <= set(loaded)
    for name, tensor in got.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_hf_shards_equal_what_dcp_loads(dcp_root):
    got, loaded = assembled(dcp_root / "hf_sharded"), hf_loaded(dcp_root / "hf_sharded")
    assert sorted(got) == sorted(loaded)
    assert all(torch.equal(got[name], loaded[name]) for name in got)


def test_training_state_is_read_and_the_rest_reported(dcp_root, cli):
    result = cli("inspect", dcp_root / "tp2", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["layout"] == "dcp" and report["tp"] == 1 and report["problems"] == []
    assert not [t for t in report["tensors"] if t["name"].startswith(("optimizer", "train_state"))]
    embed = next(t for t in report["tensors"] if t["name"] == "model.embed_tokens.weight")
    assert embed["rank_shapes"] == [[1001, 64]] and embed["partition"]["kind"] == "vocab"
    skipped = next(n for n in report["notes"] if n.startswith("skipped"))
    for part in ("optimizer (63 tensors, 3 values, 1.8 MB)", "lr_scheduler (1 value", "dataloader", "train_state"):
        assert part in skipped
    training = report["training"]
    assert training["step"] == 3 and training["moments"] == ["exp_avg", "exp_avg_sq"] and training["frozen"] == []
    ((group),) = training["groups"]
    assert group["hyper"] == {"lr": 1e-3, "betas": [0.9, 0.95]} and len(group["params"]) == 21
    assert training["not_carried"] == [
        "dataloader (.metadata: 2 entries)", "lr_scheduler (.metadata)", "train_state (.metadata: 2 entries)"
    ]  # fmt: skip
    assert "model_version (in the state dict), rank 0" in report["extras"]
    assert any("37 chunk boxes (boxes per tensor: 1 (5 tensors), 2 (16 tensors))" in n for n in report["notes"])


def test_nested_model_is_read_by_its_own_names(dcp_root):
    source = discover(dcp_root / "fsdp_tp_bf16")
    assert "model.embed_tokens.weight" in source.ranks[0]
    assert any("stored under 'model.'" in note for note in source.notes)
    assert any(note.startswith("skipped, not model weights: optim (21 tensors") for note in source.notes)
    training = source.training  # exp_avg alone, no param groups nor steps: one group, its hyper-parameters unknown
    assert training is not None and training.moments == ("exp_avg",) and training.step is None
    assert [group.hyper for group in training.groups] == [{}] and len(training.groups[0].params) == 21


def test_per_rank_metadata_is_merged(dcp_root):
    index = read_index(dcp_root / "tp4_bf16_nocoll")
    embed = index.tensors["model.embed_tokens.weight"]
    assert sorted(c.box.offsets[0] for c in embed.chunks) == [0, 251, 502, 753]
    assert [len(index.tensors[n].chunks) for n in ("model.norm.weight",)] == [1]  # stored by 4 ranks, read once
    assert "(replicated tensors)" in " ".join(index.notes)


@pytest.mark.parametrize("variant", LLAMA_VARIANTS)
def test_convert_to_one_hf_folder_gives_the_source_weights(dcp_root, variant, tmp_path, cli):
    out = tmp_path / "hf"
    result = cli("convert", dcp_root / variant, "--tp", 1, "-o", out, "-q")
    assert result.exit_code == 0, result.output
    written = load_folder(out)
    want = expected(dcp_root, variant)
    assert sorted(written) == sorted(want)
    assert all(torch.equal(written[name], want[name]) for name in want)
    assert json.loads((out / "reshard.json").read_text())["source"]["layout"] == "dcp"


@pytest.mark.parametrize("tp", [2, 4])
def test_convert_to_hf_ranks_and_back(dcp_root, tp, tmp_path, cli):
    ranks, back = tmp_path / f"tp{tp}", tmp_path / "back"
    result = cli("convert", dcp_root / "fsdp_tp_bf16", "--tp", tp, "--layout", "hf-ranks", "-o", ranks, "-q")
    assert result.exit_code == 0, result.output
    want = expected(dcp_root, "fsdp_tp_bf16")
    rank1 = load_file(ranks / "rank_01" / "model.safetensors")
    q = want["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(rank1["model.layers.1.self_attn.q_proj.weight"], q.chunk(tp)[1])
    down = want["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(rank1["model.layers.0.mlp.down_proj.weight"], down.chunk(tp, dim=1)[1])
    assert cli("convert", ranks, "--tp", 1, "-o", back, "-q").exit_code == 0
    written = load_folder(back)
    assert all(torch.equal(written[name], want[name]) for name in want)


def test_verify_round_trips_a_dcp_checkpoint(dcp_root, cli):
    result = cli("verify", dcp_root / "tp2", "--roundtrip", "2,4", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ok"]


def test_converted_model_gives_the_source_logits(dcp_root, tmp_path, cli):
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    assert cli("convert", dcp_root / "tp2", "--tp", 1, "-o", out, "-q").exit_code == 0
    source = LlamaForCausalLM.from_pretrained(dcp_root / "hf_source").eval()
    converted = LlamaForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(converted, 1001), logits(source, 1001))


def test_any_box_reads_as_the_slice_of_the_global_tensor(dcp_root):
    """The reader serves sub-boxes (one layer of a stacked tensor, as torch_dist will use it), byte ranges of
    them, and strided destinations, across chunk edges and an empty chunk."""
    index = read_index(dcp_root / "misc")
    stacked, want = index.tensors["stacked"], expected(dcp_root, "misc")["stacked"]
    views = {f"layer{i}": BoxView(stacked, Box((i, 0, 0), (1, 6, 40)), (6, 40)) for i in range(3)}
    views["middle"] = BoxView(stacked, Box((1, 1, 3), (2, 4, 30)), (2, 4, 30))
    reader = BoxedReader(dcp_root / "misc", views)
    for i in range(3):
        assert torch.equal(reader.get(f"layer{i}"), want[i])
    assert torch.equal(reader.get("middle"), want[1:3, 1:5, 3:33])
    flat = want[1:3, 1:5, 3:33].reshape(-1)
    for start, stop in [(0, 7), (5, 63), (29, 30), (31, 240)]:
        out = torch.empty(stop - start)
        reader.read_into("middle", out, start=start * 4)
        assert torch.equal(out, flat[start:stop]), (start, stop)
    wide = torch.zeros(6, 50)
    reader.read_into("layer2", wide[:, 5:45])
    assert torch.equal(wide[:, 5:45], want[2]) and not wide[:, :5].any()


def test_stacked_views_read_and_take_page_cache_hints(dcp_root):
    """A view stacked of whole tensors (torch_dist's fc1 halves) reads as their concatenation, and its prefetch and
    evict hints reach every part's chunks (they took the first part's box, which a stacked view has not)."""
    index = read_index(dcp_root / "misc")
    stacked, want = index.tensors["stacked"], expected(dcp_root, "misc")["stacked"]
    reader = BoxedReader(dcp_root / "misc", {"pair": StackedView((BoxView.whole(stacked), BoxView.whole(stacked)))})
    assert torch.equal(reader.get("pair"), torch.cat([want, want]))
    reader.prefetch("pair")
    reader.evict("pair")


def test_check_reads_dcp_headers_without_importing_torch(dcp_root):
    report, imported_torch = check_in_a_fresh_interpreter(dcp_root / "tp2", 2)
    assert report["ok"] and not imported_torch


def test_metadata_carrying_save_plans_is_read(dcp_copy):
    """Megatron-Core's ``.metadata`` also pickles DCP planner classes (SavePlan, WriteItem, TensorWriteData,
    WriteItemType): they are on the allow-list, so such a file reads without --trust-pickle."""
    from fixtures.dcp import rewrite_metadata
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    ckpt = dcp_copy("tp2")

    def add_plan(md):
        key = next(iter(md.storage_data))
        entry = md.state_dict_metadata[key.fqn]
        item = WriteItem(
            key, WriteItemType.SHARD, tensor_data=TensorWriteData(entry.chunks[0], entry.properties, entry.size)
        )
        md.planner_data["plans"] = [SavePlan([item], planner_data={"note": "mcore"})]

    rewrite_metadata(ckpt, add_plan)
    source = discover(ckpt)
    assert len(source.ranks[0]) == 21
