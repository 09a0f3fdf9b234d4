"""``reshard.layouts.megatron.reader``: Megatron-LM checkpoints at TP=8 (mcore names, GQA 8 heads / 2 groups, SwiGLU,
padded vocab, args Namespace, ``_extra_state``) converted to TP=4/2/1 and back, checked tensor by tensor against
slices computed independently in ``fixtures.megatron``."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fixtures import SAMPLES, load_script
from fixtures.megatron import (
    ITERATION,
    LEGACY,
    MCORE,
    PAD_FILL,
    TINY,
    ModelType,
    NotAllowed,
    full_model,
    megatron_args,
    megatron_importable,
    megatron_qkv,
    rank_state,
    te_extra_state,
    write_megatron,
)
from safetensors.torch import load_file

from reshard.layouts.base import SourceCheckpoint
from reshard.layouts.megatron.file import MegatronFile
from reshard.layouts.megatron.writer import MegatronWriter
from reshard.megatron.facts import MegatronFacts

V = TINY.vocab
Full = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def full() -> Full:
    return full_model(TINY)


@pytest.fixture(scope="module")
def tp8(tmp_path_factory: pytest.TempPathFactory, full: Full) -> Path:
    return write_megatron(tmp_path_factory.mktemp("megatron") / "tp8", full, 8)


def load_rank(root: Path, rank: int) -> dict:
    """Load a rank file the way Megatron does (full unpickling, Megatron importable)."""
    with megatron_importable():
        path = root / f"iter_{ITERATION:07d}" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        return torch.load(path, weights_only=False)


def flat_model(obj: dict) -> dict:
    out = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[prefix + key] = value

    walk(obj["model"], "")
    return out


def check_ranks(root: Path, full: Full, tp: int, *, via: int | None = None, fill: float = 0.0) -> None:
    """Every rank file at ``tp``: tensors, extra state, args, version, iteration.

    ``_extra_state`` of target rank r comes from the source rank whose rows it starts with
    (``r * source_tp // tp``); ``via`` is the tp of an intermediate conversion from the TP=8 fixture.
    """
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERATION)
    folders = sorted(p.name for p in (root / f"iter_{ITERATION:07d}").iterdir())
    assert folders == [f"mp_rank_{r:02d}" for r in range(tp)]
    for r in range(tp):
        obj = load_rank(root, r)
        assert sorted(obj) == ["args", "checkpoint_version", "iteration", "model"]
        assert obj["checkpoint_version"] == 3.0 and obj["iteration"] == ITERATION
        args = obj["args"]
        assert args.tensor_model_parallel_size == tp
        assert args.padded_vocab_size == TINY.padded_vocab(tp)
        assert args.model_type is ModelType.encoder_or_decoder
        assert args.num_query_groups == 2 and args.swiglu is True
        model = flat_model(obj)
        expected = rank_state(full, TINY, tp, r, pad_fill=fill)
        tensors = {k: v for k, v in model.items() if not k.endswith("_extra_state")}
        assert list(tensors) == list(expected), "names and their order are kept"
        for name, want in expected.items():
            assert tensors[name].dtype == want.dtype and torch.equal(tensors[name], want), (tp, r, name)
        extras = {k: v for k, v in model.items() if k.endswith("_extra_state")}
        origin = r * 8 // tp if via is None else (r * via // tp) * 8 // via
        source = rank_state(full, TINY, 8, origin, extra_state=te_extra_state)
        source_extras = {k: v for k, v in source.items() if k.endswith("_extra_state")}
        assert list(extras) == list(source_extras)
        for name, want in source_extras.items():
            got = extras[name]
            if isinstance(want, torch.Tensor):
                assert torch.equal(got, want), name
            else:
                assert (got is None and want is None) or got.getvalue() == want.getvalue(), name


@pytest.mark.parametrize("tp", [4, 2, 1])
def test_tp8_to_smaller_tp_and_back(cli, tp8: Path, full: Full, tmp_path: Path, tp: int) -> None:
    down = tmp_path / f"tp{tp}"
    result = cli("convert", tp8, "-o", down, "--tp", tp, "--vocab", V)
    assert result.exit_code == 0, result.output
    check_ranks(down, full, tp)
    manifest = json.loads((down / "reshard.json").read_text())
    assert manifest["vocab"]["original"] == V and manifest["vocab"]["padded"] == TINY.padded_vocab(tp)
    assert manifest["tensors"]["decoder.layers.0.self_attention.linear_qkv.weight"]["partition"] == {
        "kind": "grouped",
        "dim": 0,
        "groups": 2,
    }

    back = tmp_path / "back"
    result = cli("convert", down, "-o", back, "--tp", 8)  # the true vocab comes from the manifest now
    assert result.exit_code == 0, result.output
    check_ranks(back, full, 8, via=tp)
    source = [flat_model(load_rank(tp8, r)) for r in range(8)]
    for r in range(8):
        got = flat_model(load_rank(back, r))
        for name, original in source[r].items():
            if name.endswith("_extra_state"):
                continue
            if name in (MCORE["emb"], MCORE["out"]):  # pad rows are not data: zero after the trip
                data = max(0, min(original.shape[0], V - r * original.shape[0]))
                assert torch.equal(got[name][:data], original[:data])
                assert not got[name][data:].any()
            else:
                assert torch.equal(got[name], original), (r, name)


def test_without_true_vocab_the_padded_table_is_kept_at_the_same_tp(
    cli, tp8: Path, full: Full, tmp_path: Path
) -> None:
    """At the tp it was padded for, Megatron pads the same way again: the table is kept, pad rows included."""
    out = tmp_path / "tp8"
    result = cli("convert", tp8, "-o", out, "--tp", 8)
    assert result.exit_code == 0, result.output
    assert "padded vocab table is kept as is" in result.output
    check_ranks(out, full, 8, fill=PAD_FILL)


def test_iteration_folder_and_inspect(cli, tp8: Path) -> None:
    result = cli("inspect", tp8 / f"iter_{ITERATION:07d}", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["layout"] == "megatron" and report["tp"] == 8 and report["plan"] == "megatron"
    parts = {t["name"]: t["partition"]["kind"] for t in report["tensors"]}
    assert parts[MCORE["emb"]] == "vocab"
    assert parts["decoder.layers.1.mlp.linear_fc1.weight"] == "packed"
    assert parts["decoder.layers.1.self_attention.linear_qkv.weight"] == "grouped"
    assert parts["decoder.layers.1.self_attention.linear_proj.weight"] == "shard"
    assert parts["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"] == "replicate"
    assert not report["problems"]
    assert any("optimizer, rng_state" in n for n in report["notes"])


def test_to_hf_with_megatron_names_at_tp1_and_hf_ranks(cli, tp8: Path, full: Full, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    result = cli("convert", tp8, "-o", hf, "--tp", 1, "--layout", "hf", "--vocab", V, "--keep-names")
    assert result.exit_code == 0, result.output
    tensors = load_file(hf / "model.safetensors")
    t = full
    assert torch.equal(tensors[MCORE["emb"]], t["emb"])  # unpadded to the true vocab
    qkv = megatron_qkv(t["0.q"], t["0.k"], t["0.v"], TINY.groups)  # groups interleaved: [q_g0; k_0; v_0; q_g1; ...]
    assert torch.equal(tensors["decoder.layers.0.self_attention.linear_qkv.weight"], qkv)
    assert torch.equal(tensors["decoder.layers.1.mlp.linear_fc1.weight"], torch.cat([t["1.gate"], t["1.up"]]))
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "megatron" and config["vocab_size"] == V and config["num_key_value_heads"] == 2

    ranks = tmp_path / "ranks"
    result = cli("convert", hf, "-o", ranks, "--tp", 2, "--layout", "hf-ranks")
    assert result.exit_code == 0, result.output
    for r in range(2):
        got = load_file(ranks / f"rank_{r:02d}" / "model.safetensors")
        for name, want in rank_state(full, TINY, 2, r, pad_fill=0.0).items():
            if name in (MCORE["emb"], MCORE["out"]):  # hf-ranks pads to a multiple of tp only: 50 = 2 x 25
                want = (t["emb"] if name == MCORE["emb"] else t["out"]).chunk(2)[r]
            assert torch.equal(got[name], want), name

    refused = tmp_path / "refused"
    result = cli("convert", hf, "-o", refused, "--tp", 2, "--layout", "megatron")
    assert result.exit_code == 2
    assert "the megatron layout needs Megatron args" in result.output and not refused.exists()


def test_to_transformers_names(cli, tp8: Path, full: Full, tmp_path: Path) -> None:
    """The fused QKV is split per query group and fc1 into gate and up: each transformers tensor is the
    canonical part the Megatron ranks were cut from; the config states the family and the true vocab."""
    hf = tmp_path / "hf"
    result = cli("convert", tp8, "-o", hf, "--tp", 1, "--layout", "hf", "--vocab", V, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["mapping"]["to"] == "llama"
    tensors, t = load_file(hf / "model.safetensors"), full
    assert torch.equal(tensors["model.embed_tokens.weight"], t["emb"])
    assert torch.equal(tensors["lm_head.weight"], t["out"])
    for i in range(2):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for part in "qkv":
            assert torch.equal(tensors[f"{attn}{part}_proj.weight"], t[f"{i}.{part}"])
            assert torch.equal(tensors[f"{attn}{part}_proj.bias"], t[f"{i}.{part}_b"])
        assert torch.equal(tensors[f"{attn}o_proj.weight"], t[f"{i}.proj"])
        assert torch.equal(tensors[f"{mlp}gate_proj.weight"], t[f"{i}.gate"])
        assert torch.equal(tensors[f"{mlp}up_proj.weight"], t[f"{i}.up"])
        assert torch.equal(tensors[f"{mlp}up_proj.bias"], t[f"{i}.up_b"])
        assert torch.equal(tensors[f"{mlp}down_proj.weight"], t[f"{i}.fc2"])
        assert torch.equal(tensors[f"model.layers.{i}.input_layernorm.weight"], t[f"{i}.in_norm"])
        assert torch.equal(tensors[f"model.layers.{i}.post_attention_layernorm.weight"], t[f"{i}.mlp_norm"])
    config = json.loads((hf / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["num_key_value_heads"]) == ("llama", V, 2)
    assert config["attention_bias"] and config["mlp_bias"] and not config["tie_word_embeddings"]
    manifest = json.loads((hf / "reshard.json").read_text())["mapping"]
    qkv = manifest["tensors"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]

    back = tmp_path / "back"  # and to Megatron's names at tp 4: the ranks the fixture cuts for tp 4
    result = cli("convert", hf, "-o", back, "--tp", 4, "--layout", "megatron")
    assert result.exit_code == 0, result.output
    result = cli("verify", tp8, back, "--json")
    differences = [d for c in json.loads(result.stdout)["checks"] for d in c["differences"]]
    assert {d["tensor"] for d in differences} == {MCORE["emb"], MCORE["out"]}  # tp8 keeps its pad rows
    assert all(d["kind"] == "reshaped" for d in differences)


def test_legacy_names_and_nesting(cli, full: Full, tmp_path: Path) -> None:
    src = write_megatron(tmp_path / "legacy", full, 2, legacy=True)
    one, back = tmp_path / "one", tmp_path / "back"
    assert cli("convert", src, "-o", one, "--tp", 1, "--vocab", V).exit_code == 0
    result = cli("convert", one, "-o", back, "--tp", 2)
    assert result.exit_code == 0, result.output
    model = load_rank(one, 0)["model"]
    encoder = model["language_model"]["encoder"]
    t = full
    assert torch.equal(encoder["layers.0.mlp.dense_h_to_4h.weight"], torch.cat([t["0.gate"], t["0.up"]]))
    table = model["language_model"]["embedding"]["word_embeddings"]["weight"]
    assert table.shape[0] == TINY.padded_vocab(1) == 52
    assert torch.equal(table[:V], t["emb"]) and not table[V:].any()
    for r in range(2):
        original, got = load_rank(src, r)["model"], load_rank(back, r)["model"]
        assert original.keys() == got.keys() and original["language_model"].keys() == got["language_model"].keys()
        expected = rank_state(full, TINY, 2, r, names=LEGACY, pad_fill=0.0)
        flat = flat_model({"model": got})
        assert list(flat) == list(expected)
        for name, want in expected.items():
            assert torch.equal(flat[name], want), name


def test_pickled_object_outside_allow_list(cli, full: Full, tmp_path: Path) -> None:
    src = write_megatron(tmp_path / "unsafe", full, 2, args=megatron_args(TINY, 2, custom=NotAllowed()))
    out = tmp_path / "out"
    result = cli("convert", src, "-o", out, "--tp", 1)
    assert result.exit_code == 2
    assert "fixtures.megatron.NotAllowed" in result.output and "--trust-pickle" in result.output
    assert "mp_rank_0" in result.output and "model_optim_rng.pt" in result.output
    assert "Traceback" not in result.output and not out.exists()
    result = cli("convert", src, "-o", out, "--tp", 1, "--trust-pickle", "--vocab", V)
    assert result.exit_code == 0, result.output
    args = load_rank(out, 0)["args"]
    assert isinstance(args.custom, NotAllowed) and args.custom.value == 3
    assert args.model_type is ModelType.encoder_or_decoder  # read without Megatron, written back as its global


def test_safe_loading_reads_args_without_megatron(tp8: Path) -> None:
    reader = MegatronFile(tp8 / f"iter_{ITERATION:07d}" / "mp_rank_03" / "model_optim_rng.pt")
    args = reader.top_level["args"]
    assert args.num_query_groups == 2 and args.params_dtype is torch.float32
    assert args.model_type.path == "megatron.core.enums.ModelType" and args.model_type.value == 1
    assert "megatron" not in sys.modules


@pytest.mark.parametrize("legacy", [False, True], ids=["mcore", "legacy"])
def test_pipeline_stages_merge_into_global_layers(cli, full: Full, tmp_path: Path, legacy: bool) -> None:
    """Stage-local layer numbers become global ones: the pp=2 checkpoint is the same model as the pp=1 one."""
    names = LEGACY if legacy else MCORE
    staged, flat = write_megatron(tmp_path / "pp2", full, 2, stages=2, legacy=legacy), tmp_path / "pp1"
    write_megatron(flat, full, 2, legacy=legacy)
    result = cli("inspect", staged, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert {t["name"] for t in report["tensors"]} == {
        t["name"] for t in json.loads(cli("inspect", flat, "--json").output)["tensors"]
    }
    assert any("merged 2 pipeline stage(s)" in n for n in report["notes"])
    result = cli("verify", staged, flat, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["checks"][0]["tensors"] == len(report["tensors"])
    assert names["emb"] in {t["name"] for t in report["tensors"]}


def _load(path: Path) -> dict:
    """A Megatron rank file, unpickled with reshard's allow-list (Megatron itself is not installed)."""
    from reshard.formats.readers import load_torch_file
    from reshard.layouts.megatron.args import SAFE_GLOBALS

    return load_torch_file(path, trust_pickle=False, notes=[], allowed=SAFE_GLOBALS)


def test_writing_pipeline_stages(cli, tp8: Path, full: Full, tmp_path: Path) -> None:
    """--pp 2 writes Megatron's stage folders with stage-local layer numbers; reading them back merges
    them into the same model."""
    out = tmp_path / "pp2"
    result = cli("convert", tp8, "-o", out, "--tp", 2, "--pp", 2, "--layout", "megatron", "--vocab", V)
    assert result.exit_code == 0, result.output
    folder = out / f"iter_{ITERATION:07d}"
    assert sorted(p.name for p in folder.iterdir()) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
        "mp_rank_01_000",
        "mp_rank_01_001",
    ]
    last = _load(folder / "mp_rank_01_001" / "model_optim_rng.pt")
    assert "decoder.layers.0.mlp.linear_fc2.weight" in last["model"] and "output_layer.weight" in last["model"]
    assert "embedding.word_embeddings.weight" not in last["model"]
    assert last["args"].pipeline_model_parallel_size == 2 and last["args"].tensor_model_parallel_size == 2
    first = _load(folder / "mp_rank_00_000" / "model_optim_rng.pt")
    assert (
        "embedding.word_embeddings.weight" in first["model"]
        and "decoder.layers.1.mlp.linear_fc2.weight" not in first["model"]
    )
    back = tmp_path / "back"  # the same model as tp8 (cut to the true vocab): read back and compared
    assert cli("convert", out, "-o", back, "--tp", 8, "--layout", "megatron", "--vocab", V).exit_code == 0
    result = cli("verify", out, back, "--json")
    assert result.exit_code == 0, result.output
    result = cli("convert", tp8, "-o", tmp_path / "odd", "--tp", 2, "--pp", 3, "--layout", "megatron", "--vocab", V)
    assert result.exit_code == 2 and "do not split evenly into 3 pipeline stages" in result.output
    result = cli("convert", tp8, "-o", tmp_path / "hf", "--tp", 1, "--pp", 2, "--layout", "hf", "--vocab", V)
    assert result.exit_code == 2 and "no pipeline stages" in result.output


def test_missing_rank_and_infeasible_tp(cli, tp8: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tp8, broken)
    shutil.rmtree(broken / f"iter_{ITERATION:07d}" / "mp_rank_05")
    result = cli("convert", broken, "-o", tmp_path / "o1", "--tp", 4)
    assert result.exit_code == 2 and "mp_rank_05/model_optim_rng.pt" in result.output
    shutil.rmtree(broken / f"iter_{ITERATION:07d}" / "mp_rank_07")  # the last rank: only the args tell
    shutil.copytree(tp8 / f"iter_{ITERATION:07d}" / "mp_rank_05", broken / f"iter_{ITERATION:07d}" / "mp_rank_05")
    result = cli("inspect", broken)
    assert result.exit_code == 2 and "tensor_model_parallel_size=8, but only 7 are here" in result.output
    result = cli("convert", tp8, "-o", tmp_path / "o2", "--tp", 3, "--vocab", V)
    assert result.exit_code == 2 and not (tmp_path / "o2").exists()
    assert "linear_qkv.weight" in result.output and "holds 2 groups: tp=3" in result.output


def test_the_sample_converts_to_tp4(cli, tmp_path: Path) -> None:
    """sample_ckpts/tiny-megatron-tp8 (its regeneration is checked in test_samples.py): fc1 re-paired at tp 4."""
    out = tmp_path / "tp4"
    result = cli("convert", SAMPLES / "tiny-megatron-tp8", "--tp", 4, "-o", out, "--vocab", 500)
    assert result.exit_code == 0, result.output
    model, r = load_script(SAMPLES / "make_megatron_sample.py").model(), 1
    rank_file = out / "iter_0000100" / f"mp_rank_{r:02d}" / "model_optim_rng.pt"
    fc1 = torch.load(rank_file, weights_only=False)["model"]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([model["0.gate"].chunk(4)[r], model["0.up"].chunk(4)[r]]))


def test_release_folder_and_bad_tracker(cli, full: Full, tmp_path: Path) -> None:
    src = write_megatron(tmp_path / "rel", full, 2, model_type=False)
    (src / f"iter_{ITERATION:07d}").rename(src / "release")
    (src / "latest_checkpointed_iteration.txt").write_text("release\n")
    out = tmp_path / "out"
    assert cli("convert", src, "-o", out, "--tp", 1, "--vocab", V).exit_code == 0
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release\n"
    assert (out / "release" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    (src / "latest_checkpointed_iteration.txt").write_text("latest?\n")
    result = cli("inspect", src)
    assert (
        result.exit_code == 2 and "latest_checkpointed_iteration.txt" in result.output and "'latest?'" in result.output
    )


def test_virtual_pipeline_chunks_merge_into_global_layers(cli, full: Full, tmp_path: Path) -> None:
    """Each virtual chunk (model0, model1) numbers its layers from 0; chunk 1 of the one stage holds layer 1."""
    root, flat = tmp_path / "vpp", tmp_path / "flat"
    write_megatron(flat, full, 2)
    for r in range(2):
        state = rank_state(full, TINY, 2, r)
        chunks = {
            f"model{i}": {
                k.replace(".layers.1.", ".layers.0."): v for k, v in state.items() if (".layers.1." in k) == bool(i)
            }
            for i in range(2)
        }
        folder = root / f"iter_{ITERATION:07d}" / f"mp_rank_{r:02d}"
        folder.mkdir(parents=True)
        torch.save(
            {"args": megatron_args(TINY, 2), "checkpoint_version": 3.0, "iteration": ITERATION, **chunks},
            folder / "model_optim_rng.pt",
        )
    (root / "latest_checkpointed_iteration.txt").write_text(f"{ITERATION}\n")
    report = json.loads(cli("inspect", root, "--json").output)
    names = [t["name"] for t in report["tensors"]]
    assert MCORE["emb"] in names and "decoder.layers.1.mlp.linear_fc1.weight" in names
    assert any("2 virtual chunk(s)" in n for n in report["notes"])
    result = cli("verify", root, flat, "--json")
    assert result.exit_code == 0, result.output


def test_uneven_is_refused_for_the_megatron_layout(cli, tp8: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = cli("convert", tp8, "-o", out, "--tp", 4, "--vocab", V - 1, "--uneven")
    assert result.exit_code == 2 and "equal shapes" in result.output and not out.exists()


def test_expert_parallel_ranks_merge_into_global_experts(cli, tmp_path: Path) -> None:
    """Expert-parallel rank e holds local_experts 0..n-1 of the global experts e*n..; the other tensors are the
    same on every expert rank and are read once."""
    root = tmp_path / "ep"
    args = megatron_args(replace(TINY, layers=1), 1, num_experts=4, expert_model_parallel_size=2)  # one layer held
    router = torch.arange(4 * TINY.hidden, dtype=torch.float32).reshape(4, TINY.hidden)
    experts = {
        e: torch.arange(2 * TINY.ffn * TINY.hidden, dtype=torch.float32).reshape(2 * TINY.ffn, TINY.hidden) + 1000 * e
        for e in range(4)
    }
    for ep in range(2):
        model = {"decoder.layers.0.mlp.router.weight": router}
        model |= {
            f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight": experts[2 * ep + e] for e in range(2)
        }
        folder = root / f"iter_{ITERATION:07d}" / f"mp_rank_00_{ep:03d}"
        folder.mkdir(parents=True)
        torch.save(
            {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": model},
            folder / "model_optim_rng.pt",
        )
    (root / "latest_checkpointed_iteration.txt").write_text(f"{ITERATION}\n")
    out = tmp_path / "out"
    result = cli("convert", root, "-o", out, "--tp", 1, "--layout", "hf", "--keep-names")
    assert result.exit_code == 0, result.output
    tensors = load_file(out / "model.safetensors")
    for e in range(4):
        assert torch.equal(tensors[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"], experts[e])
    assert torch.equal(tensors["decoder.layers.0.mlp.router.weight"], router) and len(tensors) == 5


def test_a_padded_size_that_depends_on_an_unknown_vocab_is_refused(cli, tp8: Path, tmp_path: Path) -> None:
    """Megatron-LM recomputes the padded vocab from the tokenizer at start-up: at another tp the rows could
    pad to several sizes, and the wrong one fails to load. Same tp: nothing to recompute."""
    out = tmp_path / "tp4"
    result = cli("convert", tp8, "-o", out, "--tp", 4, "--layout", "megatron")
    assert result.exit_code == 2 and not out.exists()
    assert "the true vocab size is unknown" in result.output and "pass --vocab N" in result.output
    rows = TINY.padded_vocab(8)
    assert f"{TINY.padded_vocab(4)} rows" in result.output and f"{rows} rows for a true size of" in result.output
    assert cli("convert", tp8, "-o", tmp_path / "same", "--tp", 8, "--layout", "megatron").exit_code == 0


def test_the_true_vocab_comes_from_the_tokenizer_s_vocab_file(cli, full: Full, tmp_path: Path) -> None:
    vocab_file = tmp_path / "vocab.json"
    vocab_file.write_text(json.dumps({f"token{i}": i for i in range(V)}))
    src = write_megatron(tmp_path / "src", full, 2, args=megatron_args(TINY, 2, vocab_file=str(vocab_file)))
    report = json.loads(cli("inspect", src, "--json").output)
    assert report["vocab"]["original"] == V and any(str(vocab_file) in n for n in report["notes"])
    out = tmp_path / "tp1"
    result = cli("convert", src, "-o", out, "--tp", 1, "--layout", "megatron", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["vocab"]["target_padded"] == TINY.padded_vocab(1)


def test_pad_multiple_is_megatron_s() -> None:
    args = megatron_args(replace(TINY, multiple=128), 8)
    source = SourceCheckpoint(Path("x"), "megatron", [], facts=MegatronFacts(args=args))
    assert MegatronWriter.pad_multiple(4, source, None) == 512
    assert MegatronWriter.pad_multiple(1, source, None) == 128
