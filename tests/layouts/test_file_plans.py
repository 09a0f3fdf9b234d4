"""Each writer's file plan (``CheckpointWriter.file_plan``) on plain data, and against what a conversion writes.

The plan is what resume and a worker's share filter (:mod:`reshard.engine.run.resume`,
:mod:`reshard.engine.run.worker_shares`): a data file it names that the writer does not write, or a tensor it places in
the wrong file, would make a resumed or shared run skip bytes. So it is pinned on hand-built specs (headers only,
no torch writes; every expected file worked out by hand) and compared with the files a real conversion wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fixtures.megatron import TINY

from reshard import ConvertOptions, ReadOptions, convert
from reshard.dtypes import TensorHeader
from reshard.engine.plan.open import open_checkpoint
from reshard.engine.plan.target import plan_target, target_spec
from reshard.errors import ReshardError
from reshard.formats.file_plan import FilePlan
from reshard.layouts.base import SourceCheckpoint, SourceFacts, TargetSpec
from reshard.layouts.dcp.torch_dist_writer import TorchDistWriter
from reshard.layouts.hf.folder import HFWriter
from reshard.layouts.hf.ranks import HFRanksWriter
from reshard.layouts.megatron.writer import MegatronWriter
from reshard.layouts.sat.checkpoint import SatFacts, SatWriter
from reshard.megatron.facts import MegatronFacts

SAMPLES = Path(__file__).resolve().parents[2] / "sample_ckpts"
Shape = tuple[int, ...]


def spec(
    ranks: list[dict[str, Shape]],
    *,
    facts: SourceFacts | None = None,
    max_shard_size: int | str = "5GB",
    pp: int = 1,
    megatron_args: Any = None,
) -> TargetSpec:
    """A spec of F32 tensors (4 bytes a value) with per-rank ``ranks`` shapes; the source is never read;
    ``megatron_args`` as a mapping makes them for a Megatron target."""
    source = SourceCheckpoint(Path("/nowhere"), "test", [{}], facts=facts or SourceFacts())
    return TargetSpec(
        tp=len(ranks),
        rank_headers=[{name: TensorHeader(shape, "F32") for name, shape in rank.items()} for rank in ranks],
        config=None,
        vocab_size=None,
        padded_vocab_size=None,
        max_shard_size=max_shard_size,
        source=source,
        layout_facts=None if megatron_args is None else MegatronFacts(args=megatron_args),
        pp=pp,
    )


SIX = {f"layer.{i}.weight": (64,) for i in range(6)}  # 256 bytes each


def test_hf_splits_shards_greedily_in_safetensors_order() -> None:
    """600 bytes a shard: two 256-byte tensors fit, a third would not."""
    plan = HFWriter.file_plan(spec([SIX], max_shard_size=600))
    assert dict(plan.files) == {
        "model-00001-of-00003.safetensors": frozenset({"layer.0.weight", "layer.1.weight"}),
        "model-00002-of-00003.safetensors": frozenset({"layer.2.weight", "layer.3.weight"}),
        "model-00003-of-00003.safetensors": frozenset({"layer.4.weight", "layer.5.weight"}),
    }
    ((folder, shards),) = plan.folders
    assert folder == "" and shards.metadata == {"total_size": 6 * 256}
    assert shards.filenames[-1] == "model.safetensors.index.json"
    assert shards.index["weight_map"]["layer.5.weight"] == "model-00003-of-00003.safetensors"


def test_hf_fits_one_file_without_an_index_and_refuses_ranks() -> None:
    plan = HFWriter.file_plan(spec([SIX]))
    assert dict(plan.files) == {"model.safetensors": frozenset(SIX)}
    assert plan.folders[0][1].index is None
    assert dict(HFWriter.file_plan(spec([{}])).files) == {"model.safetensors": frozenset()}
    with pytest.raises(ReshardError, match="the hf layout holds one full checkpoint, not 2 ranks"):
        HFWriter.file_plan(spec([SIX, SIX]))


def test_hf_ranks_splits_each_rank_s_own_slices() -> None:
    """Rank 0's slices are larger than rank 1's (an uneven split): rank 0 needs two shards, rank 1 one."""
    rank0 = {"a": (64,), "b": (64,)}  # 512 bytes
    rank1 = {"a": (32,), "b": (32,)}  # 256 bytes
    plan = HFRanksWriter.file_plan(spec([rank0, rank1], max_shard_size=300))
    assert dict(plan.files) == {
        "rank_00/model-00001-of-00002.safetensors": frozenset({"a"}),
        "rank_00/model-00002-of-00002.safetensors": frozenset({"b"}),
        "rank_01/model.safetensors": frozenset({"a", "b"}),
    }
    assert [folder for folder, _ in plan.folders] == ["rank_00", "rank_01"]


MEGATRON_NAMES = {
    "embedding.word_embeddings.weight": (16, 4),
    "decoder.layers.0.mlp.linear_fc1.weight": (8, 4),
    "decoder.layers.1.mlp.linear_fc1.weight": (8, 4),
    "decoder.final_layernorm.weight": (4,),
}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_megatron_with_two_stages_puts_layers_and_the_tied_head_by_stage(tied: bool) -> None:
    """Stage 0 gets the embedding and layer 0, stage 1 layer 1 and the final norm, plus (tied) its own copy of
    the embedding, Megatron's output layer on the last stage."""
    args = {"num_layers": 2, "untie_embeddings_and_output_weights": not tied}
    facts = MegatronFacts(iteration=7, checkpoint_version=3.0)
    plan = MegatronWriter.file_plan(spec([MEGATRON_NAMES] * 2, facts=facts, pp=2, megatron_args=args))
    first = {"embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"}
    last = {"decoder.layers.1.mlp.linear_fc1.weight", "decoder.final_layernorm.weight"}
    last |= {"embedding.word_embeddings.weight"} if tied else set()
    assert dict(plan.files) == {
        f"iter_0000007/mp_rank_{rank:02d}_{stage:03d}/model_optim_rng.pt": frozenset(names)
        for rank in range(2)
        for stage, names in enumerate([first, last])
    }
    assert [[path for path, _ in files] for files in plan.ranks] == [
        [
            f"iter_0000007/mp_rank_{rank:02d}_000/model_optim_rng.pt",
            f"iter_0000007/mp_rank_{rank:02d}_001/model_optim_rng.pt",
        ]
        for rank in range(2)
    ]


def test_megatron_refuses_unequal_rank_shapes_and_a_source_without_args() -> None:
    args = {"num_layers": 2}
    uneven = [MEGATRON_NAMES, {**MEGATRON_NAMES, "embedding.word_embeddings.weight": (15, 4)}]
    with pytest.raises(ReshardError, match="embedding.word_embeddings.weight would differ between ranks"):
        MegatronWriter.file_plan(spec(uneven, megatron_args=args))
    with pytest.raises(ReshardError, match="the megatron layout needs Megatron args"):
        MegatronWriter.file_plan(spec([MEGATRON_NAMES]))


def test_sat_has_one_file_per_rank_in_the_iteration_folder() -> None:
    plan = SatWriter.file_plan(spec([{"a": (2,)}, {"a": (2,)}], facts=SatFacts(iteration="30")))
    assert dict(plan.files) == {
        "30/mp_rank_00_model_states.pt": frozenset({"a"}),
        "30/mp_rank_01_model_states.pt": frozenset({"a"}),
    }


def dense_llama(layers: int = 2) -> dict[str, Shape]:
    """Megatron-Core names of a tiny dense model at tp 1 (the torch_dist writer's input)."""
    shapes: dict[str, Shape] = {"embedding.word_embeddings.weight": (128, 8)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        shapes |= {
            p + "self_attention.linear_qkv.layer_norm_weight": (8,),
            p + "self_attention.linear_qkv.weight": (16, 8),
            p + "self_attention.linear_proj.weight": (8, 8),
            p + "mlp.linear_fc1.layer_norm_weight": (8,),
            p + "mlp.linear_fc1.weight": (24, 8),
            p + "mlp.linear_fc2.weight": (8, 12),
        }
    return shapes | {"decoder.final_layernorm.weight": (8,), "output_layer.weight": (128, 8)}


TORCH_DIST_ARGS = {"num_layers": 2, "untie_embeddings_and_output_weights": True}


def test_torch_dist_places_every_chunk_once_back_to_back() -> None:
    """One large file holds every incoming tensor; at one byte a file, every archive gets a file of its own."""
    facts = MegatronFacts(release=True)
    whole = TorchDistWriter.file_plan(spec([dense_llama()], facts=facts, megatron_args=TORCH_DIST_ARGS))
    assert dict(whole.files) == {"release/__0_0.distcp": frozenset(dense_llama())}
    apart = TorchDistWriter.file_plan(
        spec([dense_llama()], facts=facts, megatron_args=TORCH_DIST_ARGS, max_shard_size=1)
    )
    assert len(apart.archives.names) == len(apart.archives.where) == len(whole.archives.where)
    assert sorted(name for held in apart.files.values() for name in held) == sorted(dense_llama())
    for plan in (whole, apart):
        by_file: dict[int, list[tuple[int, int]]] = {}
        for index, position, length in plan.archives.where.values():
            by_file.setdefault(index, []).append((position, length))
        for index, places in by_file.items():
            places.sort()
            assert places[0][0] == 0
            assert all(p + n == q for (p, n), (q, _) in zip(places, places[1:], strict=False))
            assert places[-1][0] + places[-1][1] == plan.archives.sizes[index]
    assert whole.args["ckpt_format"] == "torch_dist"


def test_torch_dist_is_planned_at_tp_1_only() -> None:
    with pytest.raises(ValueError, match="plan the conversion at tp 1, not 2"):
        TorchDistWriter.file_plan(spec([dense_llama()] * 2, megatron_args=TORCH_DIST_ARGS))


def planned(ckpt: Path, options: ConvertOptions) -> FilePlan:
    opened = open_checkpoint(ckpt, options.read, target_tp=1 if options.layout == "torch_dist" else options.tp)
    target = plan_target(opened, options)
    return target.layout.writer.file_plan(target_spec(target, options))


def safetensors_names(path: Path) -> frozenset[str]:
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return frozenset(json.loads(data[8 : 8 + length])) - {"__metadata__"}


@pytest.mark.parametrize(
    ("sample", "options"),
    [
        ("tiny-llama-tp2", ConvertOptions(layout="hf", max_shard_size="40KB")),
        ("tiny-llama-tp2", ConvertOptions(layout="hf-ranks", tp=4, max_shard_size="20KB")),
        ("tiny-megatron-tp8", ConvertOptions(layout="megatron", tp=2, pp=2, read=ReadOptions(vocab=TINY.vocab))),
        (
            "tiny-megatron-tp8",
            ConvertOptions(layout="torch_dist", tp=2, read=ReadOptions(vocab=TINY.vocab), max_shard_size="20KB"),
        ),
    ],
    ids=["hf", "hf-ranks", "megatron-pp2", "torch_dist"],
)
def test_the_plan_names_exactly_the_data_files_a_conversion_writes(
    tmp_path: Path, sample: str, options: ConvertOptions
) -> None:
    options = ConvertOptions(**{**options.__dict__, "progress": False})
    plan = planned(SAMPLES / sample, options)
    out = tmp_path / "out"
    convert(SAMPLES / sample, out, options)
    written = {
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if p.name.endswith((".safetensors", ".distcp", "model_optim_rng.pt"))
    }
    assert len(plan.files) > 1 and set(plan.files) == written
    for file, names in plan.files.items():
        if file.endswith(".safetensors"):
            assert safetensors_names(out / file) == names, file
