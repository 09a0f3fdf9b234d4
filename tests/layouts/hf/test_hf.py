"""``reshard.layouts.hf.folder``: every HF on-disk form read lazily: safetensors single/sharded, .bin single/sharded,
nested torch files."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.models import tiny_llama

from reshard.layouts import discover


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = tiny_llama(path)
    return path, model.state_dict()


def read_all(source):
    return {name: ref.read() for name, ref in source.ranks[0].items()}


def assert_same(state, expected):
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_single_safetensors_folder(llama_dir):
    path, expected = llama_dir
    source = discover(path)
    assert (source.layout, source.tp) == ("hf", 1)
    assert source.config.model_type == "llama"
    assert_same(read_all(source), expected)


def test_sharded_safetensors_with_index(tmp_path):
    model = tiny_llama(tmp_path, seed=3)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    files = list((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(files) > 2
    source = discover(tmp_path / "sharded")
    assert len(source.files) == len(files)
    assert_same(read_all(source), model.state_dict())


def write_bin_shards(folder, state, per_file=5):
    """``pytorch_model-0000i-of-0000n.bin`` + index, as transformers 4 wrote them."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    chunks = [names[i : i + per_file] for i in range(0, len(names), per_file)]
    weight_map = {}
    for i, chunk in enumerate(chunks, start=1):
        filename = f"pytorch_model-{i:05d}-of-{len(chunks):05d}.bin"
        torch.save({n: state[n].clone() for n in chunk}, folder / filename)
        weight_map |= {n: filename for n in chunk}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))


def test_bin_single_and_sharded(llama_dir, tmp_path):
    _, expected = llama_dir
    (tmp_path / "single").mkdir()
    torch.save(expected, tmp_path / "single" / "pytorch_model.bin")
    assert_same(read_all(discover(tmp_path / "single")), expected)
    write_bin_shards(tmp_path / "sharded", expected)
    source = discover(tmp_path / "sharded")
    assert len(source.files) == len(list((tmp_path / "sharded").glob("pytorch_model-*.bin"))) > 1
    assert_same(read_all(source), expected)


@pytest.mark.parametrize("key", ["module", "model", "state_dict"])
def test_single_torch_file_with_nested_state_dict(llama_dir, tmp_path, key):
    _, expected = llama_dir
    torch.save({key: expected, "iteration": 7}, tmp_path / "ckpt.pt")
    source = discover(tmp_path / "ckpt.pt")
    assert_same(read_all(source), expected)
    assert source.top_level[0] == {"iteration": 7}


def test_torch_files_are_opened_mmap_and_weights_only(llama_dir, tmp_path, monkeypatch):
    _, expected = llama_dir
    torch.save(expected, tmp_path / "w.bin")
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or real_load(*a, **kw))
    discover(tmp_path / "w.bin")
    assert [(kw["mmap"], kw["weights_only"]) for kw in calls] == [(True, True)]


def test_legacy_torch_file_loads_with_a_note(llama_dir, tmp_path):
    _, expected = llama_dir
    torch.save(expected, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    source = discover(tmp_path / "old.bin")
    assert_same(read_all(source), expected)
    assert any("legacy (non-zip) torch file" in note and "cannot be streamed" in note for note in source.notes)


def test_nested_dicts_are_flattened_and_non_tensors_kept_aside(tmp_path):
    state = {
        "language_model": {"embedding": {"word_embeddings": {"weight": torch.arange(6.0).reshape(3, 2)}}},
        "layer._extra_state": None,
    }
    torch.save({"model": state}, tmp_path / "m.pt")
    source = discover(tmp_path / "m.pt")
    assert list(source.ranks[0]) == ["language_model.embedding.word_embeddings.weight"]
    assert source.extras[0] == {"layer._extra_state": None}
