"""The corpus's ``torch_dist`` cases: a checkpoint Megatron-Core 0.16.1 wrote (the oracle, ``tests/oracles/``), damaged
one thing at a time and run through every command, with the promises of ``test_corpus.py``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from damage import deep_json, payload, rewrite_metadata, torch_edit, truncate
from harness import COMMANDS, Workspace, clear_outputs, judge, run, snapshot
from oracles.variants import Spec

pytestmark = pytest.mark.oracle

ARGS = {
    "inspect": [],
    "check": ["--tp", "2"],
    "convert": ["--tp", "2"],
    "fix": [],
    "verify": [],  # against itself (below): a round trip would compare transformers names with Megatron's
}
QKV = "decoder.layers.self_attention.linear_qkv.weight"


@pytest.fixture(scope="module")
def torch_dist(mcore_oracle) -> Path:
    """The tiny Llama Megatron-Core saved at tp 2 in its ``torch_dist`` format (root with the tracker)."""
    (checkpoint,) = mcore_oracle.checkpoints(Spec("llama", tp=2))
    return checkpoint.torch_dist


def iteration(ckpt: Path) -> Path:
    return next(p for p in ckpt.iterdir() if p.is_dir() and (p / "metadata.json").is_file())


def data_file(ckpt: Path) -> Path:
    return sorted(iteration(ckpt).glob("*.distcp"))[0]


def stacked_size(size: tuple[int, ...]) -> Callable[[object], None]:
    """The stacked QKV declared with global ``size``, its one chunk at the origin covering it (others dropped)."""

    def change(metadata) -> None:
        entry = metadata.state_dict_metadata[QKV]
        entry.chunks = [c for c in entry.chunks if not any(c.offsets)][:1]
        entry.size = entry.chunks[0].sizes = torch.Size(size)

    return change


NEMO_CONFIG = """_target_: nemo.collections.llm.gpt.model.llama.LlamaModel
config:
  num_layers: 4
  hidden_size: 64
  ffn_hidden_size: 96
  num_attention_heads: 8
  num_query_groups: 2
  kv_channels: 8
  normalization: RMSNorm
  gated_linear_unit: true
  add_bias_linear: false
  share_embeddings_and_output_weights: false
  position_embedding_type: rope
  rotary_base: 10000
  seq_length: 64
"""
# A YAML alias bomb: 9 levels of 9 references, a few hundred bytes that str() or json.dumps would walk 9^9 times.
ALIAS_BOMB = "optim:\n  l0: &l0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10)
)


def as_nemo(config: str, extra: str = "") -> Callable[[Path, Path], None]:
    """The checkpoint made a NeMo 2 one (Megatron-Core's files under ``weights/``, ``context/model.yaml``),
    with ``config`` as the model's config lines (``extra`` before them: YAML anchors)."""

    def damage(ckpt: Path, marker: Path) -> None:
        weights = ckpt.parent / "weights"
        iteration(ckpt).rename(weights)
        shutil.rmtree(ckpt)
        ckpt.mkdir()
        weights.rename(ckpt / "weights")
        (ckpt / "weights" / "common.pt").unlink()
        (ckpt / "context").mkdir()
        (ckpt / "context" / "model.yaml").write_text(extra + config)

    return damage


def zero_heads(common: dict) -> None:
    common["args"].num_attention_heads = 0


CASES: dict[str, tuple[Callable[[Path, Path], None], tuple[str, ...], dict[str, int]]] = {
    "metadata-json-not-json": (lambda c, m: (iteration(c) / "metadata.json").write_text("{"), ("metadata.json",), {}),
    "metadata-json-deep": (
        lambda c, m: (iteration(c) / "metadata.json").write_bytes(deep_json(100_000)),
        ("metadata.json",),
        {},
    ),
    "backend-zarr": (
        lambda c, m: (iteration(c) / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"})),
        ("metadata.json", "zarr"),
        {},
    ),
    "common-payload": (
        lambda c, m: torch_edit(
            iteration(c) / "common.pt", lambda o: o.__setitem__("evil", payload(m)), megatron=True
        ),
        ("common.pt", "posix.system"),
        {},
    ),
    "common-heads-zero": (
        lambda c, m: torch_edit(iteration(c) / "common.pt", zero_heads, megatron=True),
        ("common.pt", "args.num_attention_heads"),
        {},
    ),
    "tracker-not-text": (
        lambda c, m: (c / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe"),
        ("latest_checkpointed_iteration.txt",),
        {},
    ),
    "metadata-payload": (
        lambda c, m: rewrite_metadata(iteration(c), lambda md: setattr(md, "planner_data", {"evil": payload(m)})),
        (".metadata", "posix.system"),
        {},
    ),
    "data-truncated": (lambda c, m: truncate(data_file(c), 0.5), ("distcp", "truncated?"), {}),
    "stacked-without-layers": (
        lambda c, m: rewrite_metadata(iteration(c), stacked_size((0, 0, 64))),
        (QKV,),
        {},
    ),
    "nemo-activation-alias-bomb": (
        as_nemo(NEMO_CONFIG + "  activation_func:\n    _target_: *l9\n", ALIAS_BOMB),
        ("model.yaml", "activation_func is [[[[["),
        {},
    ),
    "nemo-size-alias-bomb": (
        as_nemo(NEMO_CONFIG.replace("hidden_size: 64", "hidden_size: *l9"), ALIAS_BOMB),
        ("model.yaml", "config.hidden_size", "[[[[[", "not a single value"),
        {},
    ),
    "nemo-unknown-field-alias-bomb": (
        as_nemo(NEMO_CONFIG + "  a_newer_field: *l9\n", ALIAS_BOMB),
        ("model.yaml", "config.a_newer_field", "[[[[[", "larger or deeper than a config's value"),
        {},
    ),
    "nemo-size-5001-digits": (
        as_nemo(NEMO_CONFIG.replace("hidden_size: 64", "hidden_size: 1" + "0" * 5000)),
        ("model.yaml", "unreadable model config", "4300 digits"),
        {},
    ),
    "stacked-a-million-layers": (
        lambda c, m: rewrite_metadata(iteration(c), stacked_size((1_000_000, 0, 64))),
        (QKV, "leading layer or expert axis"),
        {},
    ),
}


def arguments(command: str, ws: Workspace) -> list[str]:
    return [str(ws.ckpt)] if command == "verify" else ARGS[command]


def test_the_base_passes_every_command(torch_dist: Path, tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    shutil.copytree(torch_dist, ws.ckpt)
    before = snapshot(ws.ckpt)
    for command in COMMANDS:
        assert judge(run(command, ws.ckpt, arguments(command, ws), ws), ws, before, exit_code=0) == []
        clear_outputs(ws)


@pytest.mark.parametrize("name", sorted(CASES))
def test_damaged_torch_dist(torch_dist: Path, tmp_path: Path, name: str) -> None:
    damage, names, exits = CASES[name]
    ws = Workspace(tmp_path)
    shutil.copytree(torch_dist, ws.ckpt)
    damage(ws.ckpt, ws.marker)
    before = snapshot(ws.ckpt)
    broken = []
    for command in COMMANDS:
        outcome = run(command, ws.ckpt, arguments(command, ws), ws)
        broken += judge(outcome, ws, before, exit_code=exits.get(command, 2), names=names)
        clear_outputs(ws)
    assert broken == []
