"""``reshard convert --layout torch_dist``: Megatron checkpoints (TP=2, Transformer Engine ``_extra_state``) and
transformers models written as Megatron-Core's ``torch_dist``, read back with the real ``torch.distributed.checkpoint``
(no process group) and checked against tensors computed independently in ``fixtures.megatron``.

That Megatron-Core itself loads the output at other tp/pp with the writer's logits is ``test_torch_dist_oracle.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fixtures.dcp_read import read_dcp
from fixtures.megatron import (
    ITERATION,
    TINY,
    full_model,
    megatron_importable,
    megatron_qkv,
    rank_state,
    te_extra_state,
    write_megatron,
)
from fixtures.models import tiny_llama
from fixtures.tp import pad_rows

Full = dict[str, torch.Tensor]
ITER = f"iter_{ITERATION:07d}"
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


@pytest.fixture(scope="module")
def full() -> Full:
    return full_model(TINY)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory, full: Full) -> Path:
    return write_megatron(tmp_path_factory.mktemp("megatron") / "tp2", full, 2)


def stacked(flat: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """Megatron-Core's global tensors from tp-1 tensors: ``decoder.layers.{i}.<rest>`` stacked on a layer axis."""
    out = {k: v for k, v in flat.items() if not k.startswith("decoder.layers.")}
    rests = {k.split(".", 3)[3] for k in flat if k.startswith("decoder.layers.")}
    for rest in rests:
        out[f"decoder.layers.{rest}"] = torch.stack([flat[f"decoder.layers.{i}.{rest}"] for i in range(layers)])
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_tp2_becomes_global_stacked_tensors(cli, tp2: Path, full: Full, tmp_path: Path, tp: int) -> None:
    """Global tensors whatever --tp says; --tp sets the args' tensor-parallel size and the vocab padding (4 * tp,
    from the true size: the source's pad rows are cut)."""
    out = tmp_path / "td"
    result = cli("convert", tp2, "--tp", tp, "--layout", "torch_dist", "-o", out, "--json", "--vocab", TINY.vocab)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["layout"], report["tp"]) == ("torch_dist", 1)
    folder = out / ITER
    assert sorted(p.name for p in out.iterdir()) == [ITER, "latest_checkpointed_iteration.txt", "reshard.json"]
    assert (out / "latest_checkpointed_iteration.txt").read_text() == str(ITERATION)
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert json.loads((folder / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }

    rows = TINY.padded_vocab(tp)
    flat = rank_state(full, TINY, 1, 0, extra_state=None)
    flat |= {
        name: pad_rows(full[part], rows)
        for name, part in (("embedding.word_embeddings.weight", "emb"), ("output_layer.weight", "out"))
    }
    expected = stacked(flat, TINY.layers)
    got = read_dcp(folder)
    tensors = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
    assert sorted(tensors) == sorted(expected)
    for name, want in expected.items():
        assert tensors[name].dtype == want.dtype and torch.equal(tensors[name], want), name

    # _extra_state: TP rank 0's values carried, None for the Transformer Engine modules the source had none for.
    objects = {k: v for k, v in got.items() if not isinstance(v, torch.Tensor)}
    want_objects = {"decoder.final_layernorm._extra_state/shard_0_1": None}
    for i in range(TINY.layers):
        source = te_extra_state(i, 0, 2)
        for module in (*LINEARS, "self_attention.core_attention"):
            want_objects[f"decoder.layers.{module}._extra_state/shard_{i}_{TINY.layers}"] = source.get(module)
    assert sorted(objects) == sorted(want_objects)
    for key, want in want_objects.items():
        (value,) = objects[key]
        if isinstance(want, io.BytesIO):
            assert value.getvalue() == want.getvalue(), key
        elif isinstance(want, torch.Tensor):
            assert torch.equal(value, want), key
        else:
            assert value is None, key

    with megatron_importable():
        common = torch.load(folder / "common.pt", weights_only=False)
    assert list(common) == ["args", "checkpoint_version", "iteration", "content_metadata"]
    assert (common["checkpoint_version"], common["iteration"]) == (3.0, ITERATION)
    assert common["content_metadata"] == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    args = common["args"]
    assert (args.tensor_model_parallel_size, args.padded_vocab_size, args.ckpt_format) == (tp, rows, "torch_dist")
    assert type(args.model_type).__module__ == "megatron.core.enums"  # Megatron's own enum, as Megatron wrote it


def test_chunks_are_torch_save_archives_and_files_split_at_max_shard_size(cli, tp2: Path, tmp_path: Path) -> None:
    one, split = tmp_path / "one", tmp_path / "split"
    assert cli("convert", tp2, "--tp", 1, "--layout", "torch_dist", "-o", one, "-q").exit_code == 0
    result = cli("convert", tp2, "--tp", 1, "--layout", "torch_dist", "-o", split, "-q", "--max-shard-size", "8KB")
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (split / ITER).glob("*.distcp"))
    assert len(files) > 3 and files[:2] == ["__0_0.distcp", "__0_1.distcp"]
    held: dict[str, int] = {}
    for info in dcp.FileSystemReader(split / ITER).read_metadata().storage_data.values():
        held[info.relative_path] = held.get(info.relative_path, 0) + 1
    assert sorted(held) == files  # an archive larger than the limit has a file of its own
    assert all((split / ITER / f).stat().st_size <= 8000 or held[f] == 1 for f in files)
    a, b = read_dcp(one / ITER), read_dcp(split / ITER)
    assert a.keys() == b.keys()
    assert all(torch.equal(v, b[k]) for k, v in a.items() if isinstance(v, torch.Tensor))
    md = dcp.FileSystemReader(one / ITER).read_metadata()
    data = (one / ITER / "__0_0.distcp").read_bytes()
    for info in md.storage_data.values():  # each a whole torch.save archive, as DCP writes one to its stream
        piece = data[info.offset : info.offset + info.length]
        buffer = io.BytesIO()
        torch.save(torch.load(io.BytesIO(piece), weights_only=False), buffer)
        assert buffer.getvalue() == piece


def test_the_output_does_not_depend_on_jobs(cli, tp2: Path, tmp_path: Path) -> None:
    digests = []
    for jobs in (1, 4):
        out = tmp_path / f"j{jobs}"
        assert cli("convert", tp2, "--tp", 1, "--layout", "torch_dist", "-o", out, "-q", "--jobs", jobs).exit_code == 0
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (out / ITER).iterdir()})
    assert digests[0] == digests[1]


def test_pipeline_stages_only_go_into_the_args(cli, tp2: Path, tmp_path: Path) -> None:
    out = tmp_path / "pp"
    assert cli("convert", tp2, "--tp", 1, "--pp", 2, "--layout", "torch_dist", "-o", out, "-q").exit_code == 0
    with megatron_importable():
        args = torch.load(out / ITER / "common.pt", weights_only=False)["args"]
    assert args.pipeline_model_parallel_size == 2 and sorted(p.name for p in (out / ITER).glob("*.distcp")) == [
        "__0_0.distcp"
    ]


def test_legacy_names_are_refused(cli, full: Full, tmp_path: Path) -> None:
    src = write_megatron(tmp_path / "legacy", full, 2, legacy=True)
    out = tmp_path / "out"
    result = cli("convert", src, "--tp", 1, "--layout", "torch_dist", "-o", out)
    assert result.exit_code == 2 and not out.exists()
    assert "torch_dist holds Megatron-Core's names" in result.output
    assert "language_model.embedding.word_embeddings.weight" in result.output


def test_a_transformers_llama_gets_megatron_s_names_and_global_forms(cli, tmp_path: Path) -> None:
    """QKV interleaved per query group, fc1 [gate; up], the vocab padded to 128 * tp, Transformer Engine's names
    and objects (the args say transformer_engine), a release checkpoint."""
    model = tiny_llama(tmp_path / "hf", num_key_value_heads=2, vocab=1001)
    out = tmp_path / "td"
    result = cli("convert", tmp_path / "hf", "--tp", 2, "--layout", "torch_dist", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    got = read_dcp(out / "release")
    hf = {k: v.detach() for k, v in model.state_dict().items()}
    layers = model.config.num_hidden_layers
    q, k, v = (hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(got["decoder.layers.self_attention.linear_qkv.weight"][1], megatron_qkv(q, k, v, 2))
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(got["decoder.layers.mlp.linear_fc1.weight"][0], torch.cat([gate, up]))
    assert torch.equal(
        got["decoder.layers.mlp.linear_fc1.layer_norm_weight"],
        torch.stack([hf[f"model.layers.{i}.post_attention_layernorm.weight"] for i in range(layers)]),
    )
    assert torch.equal(got["output_layer.weight"], pad_rows(hf["lm_head.weight"], 1024))
    objects = sorted(k for k, v in got.items() if not isinstance(v, torch.Tensor))
    assert objects == sorted(
        [f"decoder.layers.{m}._extra_state/shard_{i}_{layers}" for m in LINEARS for i in range(layers)]
        + ["decoder.final_layernorm._extra_state/shard_0_1"]
    )
    with torch.serialization.safe_globals([argparse.Namespace]):  # no Megatron enum in args built from a config
        common = torch.load(out / "release" / "common.pt", weights_only=True)
    args = common["args"]
    assert (args.transformer_impl, args.tensor_model_parallel_size, args.padded_vocab_size, args.vocab_size) == (
        "transformer_engine",
        2,
        1024,
        1001,
    )
    assert common["iteration"] == 0
