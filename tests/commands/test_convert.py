"""``reshard convert``: round trips of real transformers models through every tp, checked bit for bit and by
logits, against rank slices computed independently of reshard (``fixtures.trainer``)."""

from __future__ import annotations

import json

import blake3
import pytest
import torch
from fixtures.hf import load_folder, load_rank
from fixtures.models import logits, tiny_llama, tiny_qwen3
from fixtures.shapes import llama_kind
from fixtures.trainer import rank_states

VOCAB = 1001


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = (tiny_llama if request.param == "llama" else tiny_qwen3)(path / "orig", vocab=VOCAB)
    (path / "orig" / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return path, model


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_round_trip_is_bit_identical_and_slices_are_tp_exact(model_dir, tp, cli):
    path, model = model_dir
    original = load_folder(path / "orig")
    assert all(llama_kind(name) != "rep" or name.endswith("norm.weight") for name in original)
    expected = rank_states(original, tp, pad_multiple=1, junk_seed=None)  # vocab zero-padded to a multiple of tp
    assert cli("convert", path / "orig", "--tp", tp, "-o", path / f"tp{tp}", "-q").exit_code == 0
    for rank in range(tp):
        ranked = load_rank(path / f"tp{tp}", rank)
        assert sorted(ranked) == sorted(original)
        for name, want in expected[rank].items():
            assert torch.equal(ranked[name], want), (name, rank)

    result = cli("convert", path / f"tp{tp}", "--tp", 1, "-o", path / f"back{tp}", "-q")
    assert result.exit_code == 0, result.output
    back = path / f"back{tp}"
    assert (back / "model.safetensors").read_bytes() == (path / "orig" / "model.safetensors").read_bytes()
    assert (back / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    reloaded = type(model).from_pretrained(back).eval()
    assert torch.equal(logits(reloaded, VOCAB), logits(model, VOCAB))


def test_manifest_records_vocab_partitions_and_hashes(model_dir, cli):
    path, _ = model_dir
    out = path / "manifested"
    assert cli("convert", path / "orig", "--tp", 4, "-o", out, "-q").exit_code == 0
    manifest = json.loads((out / "reshard.json").read_text())
    assert manifest["format"] == "reshard/1"
    assert manifest["source"]["tp"] == 1 and manifest["target"] == {"layout": "hf-ranks", "tp": 4}
    assert manifest["vocab"] == {"original": VOCAB, "padded": 1004, "pad_multiple": 4}
    original = load_folder(path / "orig")
    for name, tensor in original.items():
        entry = manifest["tensors"][name]
        assert entry["shape"] == list(tensor.shape)
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        assert entry["blake3"] == blake3.blake3(raw).hexdigest(), name  # the reference implementation
    assert manifest["tensors"]["lm_head.weight"]["partition"] == {"kind": "vocab", "dim": 0}
    assert manifest["tensors"]["model.layers.0.mlp.down_proj.weight"]["partition"] == {"kind": "shard", "dim": 1}


def test_tp_to_tp_directly_equals_going_through_full(model_dir, cli):
    path, _ = model_dir
    for args in [("orig", 8, "d8"), ("d8", 2, "d8to2"), ("orig", 2, "d1to2")]:
        assert cli("convert", path / args[0], "--tp", args[1], "-o", path / args[2], "-q").exit_code == 0
    for rank in range(2):
        direct = (path / "d8to2" / f"rank_{rank:02d}" / "model.safetensors").read_bytes()
        assert direct == (path / "d1to2" / f"rank_{rank:02d}" / "model.safetensors").read_bytes()


def test_tied_embeddings_bfloat16_and_sharded_output(tmp_path, cli):
    model = tiny_llama(tmp_path / "orig", vocab=VOCAB, tie=True, dtype=torch.bfloat16)
    assert "lm_head.weight" not in load_folder(tmp_path / "orig")
    assert cli("convert", tmp_path / "orig", "--tp", 2, "-o", tmp_path / "tp2", "-q").exit_code == 0
    result = cli("convert", tmp_path / "tp2", "--tp", 1, "-o", tmp_path / "back", "--max-shard-size", "100KB", "-q")
    assert result.exit_code == 0, result.output
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    original, back = load_folder(tmp_path / "orig"), load_folder(tmp_path / "back")
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    # Compare with the original as loaded from disk: casting a model in memory also casts its rotary buffers.
    reference = type(model).from_pretrained(tmp_path / "orig").eval()
    reloaded = type(model).from_pretrained(tmp_path / "back").eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert reloaded.dtype == torch.bfloat16
    assert torch.equal(logits(reloaded, VOCAB), logits(reference, VOCAB))


def test_uneven_split_follows_torch_chunk_without_padding(tmp_path, cli):
    tiny_llama(tmp_path / "orig", vocab=VOCAB)
    assert cli("convert", tmp_path / "orig", "--tp", 4, "--uneven", "-o", tmp_path / "u", "-q").exit_code == 0
    rows = [load_rank(tmp_path / "u", r)["lm_head.weight"].shape[0] for r in range(4)]
    assert rows == [251, 251, 251, 248]
    assert cli("convert", tmp_path / "u", "--tp", 1, "--uneven", "-o", tmp_path / "b", "-q").exit_code == 0
    assert load_folder(tmp_path / "b").keys() == load_folder(tmp_path / "orig").keys()
    assert all(torch.equal(v, load_folder(tmp_path / "orig")[k]) for k, v in load_folder(tmp_path / "b").items())


def test_uneven_checkpoint_reads_back_without_the_flag(tmp_path, cli):
    tiny_llama(tmp_path / "orig", vocab=VOCAB)
    assert cli("convert", tmp_path / "orig", "--tp", 4, "--uneven", "-o", tmp_path / "u", "-q").exit_code == 0
    report = json.loads(cli("inspect", tmp_path / "u", "--json").stdout)
    assert report["problems"] == []
    assert cli("convert", tmp_path / "u", "--tp", 1, "-o", tmp_path / "b", "-q").exit_code == 0
    original, back = load_folder(tmp_path / "orig"), load_folder(tmp_path / "b")
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
