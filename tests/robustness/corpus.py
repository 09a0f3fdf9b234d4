"""The corpus: broken and hostile checkpoints, each a copy of a base (``bases.py``) with one thing damaged.

A case names the fragments its error must contain (the damaged file, and the tensor or key where there is
one) and the exit code of every command that differs from 2: ``inspect`` and ``check`` read headers only,
so damage inside tensor bytes is theirs to miss (exit 0), and ``verify`` reports a finding (exit 1) where
the files are there but do not match their ``reshard.json``.
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from damage import (
    deep_json,
    edit_json,
    move_chunk,
    patch_first_numel,
    payload,
    rewrite_header,
    rewrite_metadata,
    rezip,
    split_safetensors,
    storage_of,
    tensors_of,
    torch_edit,
    truncate,
    zip_with_pickle,
)
from safetensors.torch import load_file, save_file

Damage = Callable[[Path, Path], None]  # (checkpoint folder, marker a payload would create)


@dataclass(frozen=True)
class Case:
    name: str
    base: str
    damage: Damage = field(repr=False)
    names: tuple[str, ...]
    exits: dict[str, int] = field(default_factory=dict)
    several: bool = False  # a list of problems ("N problems:") is the expected error

    def exit_code(self, command: str) -> int:
        return self.exits.get(command, 2)


CASES: list[Case] = []


def case(name: str, base: str, *names: str, several: bool = False, **exits: int) -> Callable[[Damage], Damage]:
    def register(damage: Damage) -> Damage:
        CASES.append(Case(name, base, damage, names, exits, several))
        return damage

    return register


ST = "model.safetensors"
NORM0, NORM1 = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"


def header_text(ckpt: Path) -> str:
    header, _ = split_safetensors(ckpt / ST)
    return json.dumps(header)


# ---------------------------------------------------------------- safetensors (hf)


@case("st-truncated-in-length", "hf", ST, "no header length")
def _(ckpt, marker):
    truncate(ckpt / ST, 5)


@case("st-truncated-in-header", "hf", ST, "truncated or corrupt safetensors header")
def _(ckpt, marker):
    truncate(ckpt / ST, 8 + len(header_text(ckpt)) // 2)


@case("st-truncated-after-header", "hf", ST, "truncated file?")
def _(ckpt, marker):
    length = int.from_bytes((ckpt / ST).read_bytes()[:8], "little")
    truncate(ckpt / ST, 8 + length)


@case("st-truncated-in-data", "hf", ST, "truncated file?")
def _(ckpt, marker):
    truncate(ckpt / ST, 0.6)


@case("st-one-byte-short", "hf", ST, "truncated file?")
def _(ckpt, marker):
    truncate(ckpt / ST, (ckpt / ST).stat().st_size - 1)


@case("st-trailing-bytes", "hf", ST, "not fully covered")
def _(ckpt, marker):
    with (ckpt / ST).open("ab") as handle:
        handle.write(b"\x01" * 16)


@case("st-header-length-huge", "hf", ST, "header too large")
def _(ckpt, marker):
    raw = bytearray((ckpt / ST).read_bytes())
    raw[:8] = (1 << 63).to_bytes(8, "little")
    (ckpt / ST).write_bytes(bytes(raw))


@case("st-overlapping-offsets", "hf", ST, "overlap")
def _(ckpt, marker):
    def alias(header):
        header[NORM1]["data_offsets"] = header[NORM0]["data_offsets"]
        return header

    rewrite_header(ckpt / ST, alias)


@case("st-negative-offset", "hf", ST, "data_offsets")
def _(ckpt, marker):
    def negative(header):
        first = tensors_of(header)[0]
        start, stop = header[first]["data_offsets"]
        header[first]["data_offsets"] = [start - 256, stop - 256]
        return header

    rewrite_header(ckpt / ST, negative)


@case("st-negative-shape", "hf", ST, "lm_head.weight", "non-negative integers")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: h["lm_head.weight"].update(shape=[-s for s in h["lm_head.weight"]["shape"]]))


@case("st-float-shape", "hf", ST, "lm_head.weight", "non-negative integers")
def _(ckpt, marker):
    rewrite_header(
        ckpt / ST, lambda h: h["lm_head.weight"].update(shape=[float(s) for s in h["lm_head.weight"]["shape"]])
    )


@case("st-bool-shape", "hf", ST, "model.norm.weight", "non-negative integers")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: h["model.norm.weight"].update(shape=[True] * 64))


@case("st-metadata-list", "hf", ST, "__metadata__")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: h.update(__metadata__=["format", "pt"]))


@case("st-metadata-not-strings", "hf", ST, "__metadata__")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: h.update(__metadata__={"format": 1}))


@case("st-deep-nesting", "hf", ST, "nests deeper")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: b'{"a": ' + deep_json(200_000) + b"}")


@case("st-unknown-dtype", "hf", ST, "model.norm.weight", "unknown dtype")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: h["model.norm.weight"].update(dtype="F128"))


@case("st-not-utf8", "hf", ST, "not UTF-8")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: header_text(ckpt).replace('"lm_head', '"\xff', 1).encode("latin-1"))


@case("st-duplicate-name", "hf", ST, "appears twice")
def _(ckpt, marker):
    text = header_text(ckpt)
    rewrite_header(ckpt / ST, lambda h: (text[:-1] + ', "model.norm.weight": {"dtype": "F32"}}').encode())


@case("st-gap-before-a-tensor", "hf", ST, "to no tensor")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: h.pop(tensors_of(h)[0]) and h)


@case("st-wrong-byte-count", "hf", ST, "model.norm.weight", "needs")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: h["model.norm.weight"].update(shape=[63]))


@case("st-nan-in-header", "hf", ST, "NaN")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: header_text(ckpt).replace("[64]", "[NaN]", 1).encode())


@case("st-header-is-a-list", "hf", ST, "not an object")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: b"[]")


@case("st-entry-without-dtype", "hf", ST, "model.norm.weight", "no dtype")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: h["model.norm.weight"].pop("dtype") and h)


@case("st-three-offsets", "hf", ST, "model.norm.weight", "data_offsets")
def _(ckpt, marker):
    rewrite_header(ckpt / ST, lambda h: h["model.norm.weight"]["data_offsets"].append(0))


@case("hf-weights-symlink-loop", "hf", "ckpt", verify=1)
def _(ckpt, marker):
    (ckpt / ST).unlink()
    (ckpt / ST).symlink_to(ST)


# ---------------------------------------------------------------- config.json


def _config_case(name: str, key: str, value: object) -> None:
    @case(f"config-{name}", "hf", "config.json", key)
    def _(ckpt, marker):
        edit_json(ckpt / "config.json", lambda c: c.__setitem__(key, value))


for _name, _key, _value in [
    ("vocab-word", "vocab_size", "abc"),
    ("vocab-fraction", "vocab_size", 999.5),
    ("vocab-negative", "vocab_size", -5),
    ("vocab-zero", "vocab_size", 0),
    ("vocab-bool", "vocab_size", True),
    ("heads-word", "num_attention_heads", "eight"),
    ("text-config-string", "text_config", "llama"),
]:
    _config_case(_name, _key, _value)


@case("config-not-json", "hf", "config.json", "cannot read the config")
def _(ckpt, marker):
    (ckpt / "config.json").write_text('{"vocab_size": 1001,')


@case("config-a-list", "hf", "config.json", "not a JSON object")
def _(ckpt, marker):
    (ckpt / "config.json").write_text("[1001]")


@case("config-deep-nesting", "hf", "config.json", "cannot read the config")
def _(ckpt, marker):
    (ckpt / "config.json").write_bytes(deep_json(100_000))


# ---------------------------------------------------------------- reshard.json


def _manifest_case(name: str, change: Callable[[dict], object], *names: str) -> None:
    @case(f"manifest-{name}", "hf", "reshard.json", *names)
    def _(ckpt, marker):
        edit_json(ckpt / "reshard.json", change)


_manifest_case("original-word", lambda m: m["vocab"].__setitem__("original", "abc"), "vocab.original")
_manifest_case("tp-word", lambda m: m["target"].__setitem__("tp", "two"), "target.tp")
_manifest_case("tp-absurd", lambda m: m["target"].__setitem__("tp", 10**12), "target.tp")
_manifest_case("layout-unknown", lambda m: m["target"].__setitem__("layout", "nope"), "target.layout")
_manifest_case(
    "sha-number", lambda m: m["tensors"]["lm_head.weight"].__setitem__("sha256", 7), "lm_head.weight.sha256"
)
_manifest_case(
    "partition-kind", lambda m: m["tensors"]["lm_head.weight"]["partition"].__setitem__("kind", "colwise"), "partition"
)
_manifest_case(
    "partition-dim", lambda m: m["tensors"]["lm_head.weight"]["partition"].__setitem__("dim", 99), "partition.dim"
)
_manifest_case("tensors-a-list", lambda m: m.__setitem__("tensors", []), "tensors")


@case("manifest-not-json", "hf", "reshard.json", "not a reshard manifest")
def _(ckpt, marker):
    (ckpt / "reshard.json").write_text("{")


@case("manifest-deep-nesting", "hf", "reshard.json", "not a reshard manifest")
def _(ckpt, marker):
    (ckpt / "reshard.json").write_bytes(deep_json(100_000))


# ---------------------------------------------------------------- sharded hf + index


INDEX = "model.safetensors.index.json"


def shards(ckpt: Path) -> list[str]:
    return sorted(set(json.loads((ckpt / INDEX).read_text())["weight_map"].values()))


@case("index-not-json", "hf_sharded", INDEX, "corrupt index")
def _(ckpt, marker):
    (ckpt / INDEX).write_text('{"weight_map": ')


@case("index-path-traversal", "hf_sharded", INDEX, "unsafe file")
def _(ckpt, marker):
    edit_json(ckpt / INDEX, lambda i: i["weight_map"].__setitem__("lm_head.weight", "../../etc/passwd.safetensors"))


@case("index-names-a-missing-shard", "hf_sharded", INDEX, "does not exist", verify=1)
def _(ckpt, marker):
    edit_json(
        ckpt / INDEX, lambda i: i["weight_map"].__setitem__("lm_head.weight", "model-00099-of-00099.safetensors")
    )


@case("index-names-the-wrong-shard", "hf_sharded", INDEX, "lm_head.weight", "does not")
def _(ckpt, marker):
    other = next(s for s in shards(ckpt) if "lm_head.weight" not in load_file(ckpt / s))
    edit_json(ckpt / INDEX, lambda i: i["weight_map"].__setitem__("lm_head.weight", other))


@case("shard-deleted", "hf_sharded", "00002-of-", verify=1)
def _(ckpt, marker):
    (ckpt / shards(ckpt)[1]).unlink()


@case("shard-truncated", "hf_sharded", "00002-of-", "truncated")
def _(ckpt, marker):
    truncate(ckpt / shards(ckpt)[1], 0.5)


@case("tensor-in-two-shards", "hf_sharded", "lm_head.weight", verify=1)
def _(ckpt, marker):
    first, second = shards(ckpt)[:2]
    state = load_file(ckpt / second)
    state["lm_head.weight"] = torch.arange(1001 * 64, dtype=torch.float32).reshape(1001, 64)
    save_file(state, ckpt / second, metadata={"format": "pt"})


@case("index-deep-nesting", "hf_sharded", INDEX, "corrupt index")
def _(ckpt, marker):
    (ckpt / INDEX).write_bytes(deep_json(100_000))


# ---------------------------------------------------------------- pytorch_model.bin


BIN = "pytorch_model.bin"


def _bin_payload(name: str, kind: str, culprit: str, **save: object) -> None:
    @case(f"bin-payload-{name}", "bin", BIN, culprit)
    def _(ckpt, marker):
        torch_edit(ckpt / BIN, lambda sd: sd.__setitem__("evil", payload(marker, kind)), **save)


_bin_payload("system", "system", "posix.system")
_bin_payload("exec", "exec", "pickles exec")
_bin_payload("legacy-format", "open", "open", _use_new_zipfile_serialization=False)


@case("bin-raw-pickle-payload", "bin", BIN, "weights-only unpickler")
def _(ckpt, marker):
    (ckpt / BIN).write_bytes(pickle.dumps(payload(marker)))


@case("bin-truncated", "bin", BIN, "truncated")
def _(ckpt, marker):
    truncate(ckpt / BIN, 0.5)


@case("bin-storage-past-its-record", "bin", BIN, "the record holds")
def _(ckpt, marker):
    rezip(ckpt / BIN, pickled=lambda data: patch_first_numel(data, lambda n: n * 4))


@case("bin-tensor-past-its-storage", "bin", BIN, "of a storage of")
def _(ckpt, marker):
    rezip(ckpt / BIN, pickled=lambda data: patch_first_numel(data, lambda n: n // 2))


@case("bin-compressed-record", "bin", BIN, "compressed")
def _(ckpt, marker):
    rezip(ckpt / BIN, compress=True)


@case("bin-holds-safetensors", "bin", BIN, "holds safetensors data")
def _(ckpt, marker):
    save_file({"x": torch.arange(4.0)}, ckpt / BIN)


@case("bin-garbage", "bin", BIN, "not a torch.save file")
def _(ckpt, marker):
    (ckpt / BIN).write_bytes(b"GARBAGE!" * 64)


@case("bin-empty", "bin", BIN, "not a torch.save file")
def _(ckpt, marker):
    (ckpt / BIN).write_bytes(b"")


# ---------------------------------------------------------------- hf-ranks


R1 = "rank_01/model.safetensors"


def _edit_state(path: Path, change: Callable[[dict], object]) -> None:
    state = load_file(path)
    change(state)
    save_file(state, path, metadata={"format": "pt"})


@case("ranks-missing-rank-0", "hf_ranks", "rank_00", verify=1)
def _(ckpt, marker):
    shutil.rmtree(ckpt / "rank_00")


@case("ranks-extra-rank-2", "hf_ranks", "rank_02/", "tp=2")
def _(ckpt, marker):
    shutil.copytree(ckpt / "rank_01", ckpt / "rank_02")


@case("ranks-absurd-rank-number", "hf_ranks", "rank_999999999")
def _(ckpt, marker):
    shutil.copytree(ckpt / "rank_01", ckpt / "rank_999999999")


@case("ranks-rank-twice", "hf_ranks", "rank_01 and rank_1", "both carry rank 1")
def _(ckpt, marker):
    shutil.copytree(ckpt / "rank_01", ckpt / "rank_1")


@case("ranks-recorded-tp-3", "hf_ranks", "rank_02", verify=1)
def _(ckpt, marker):
    edit_json(ckpt / "reshard.json", lambda m: m["target"].__setitem__("tp", 3))


@case("ranks-dtypes-disagree", "hf_ranks", "rank_0", "model.norm.weight", inspect=0, verify=1)
def _(ckpt, marker):
    _edit_state(ckpt / R1, lambda s: s.__setitem__("model.norm.weight", s["model.norm.weight"].half()))


@case("ranks-tensor-missing-on-one", "hf_ranks", "rank_0", "model.norm.weight", inspect=0, verify=1)
def _(ckpt, marker):
    _edit_state(ckpt / R1, lambda s: s.pop("model.norm.weight"))


@case("ranks-tensor-extra-on-one", "hf_ranks", "rank_0", "model.extra.weight", inspect=0, verify=1)
def _(ckpt, marker):
    _edit_state(ckpt / R1, lambda s: s.__setitem__("model.extra.weight", torch.arange(6.0)))


@case("ranks-shapes-disagree", "hf_ranks", "rank_0", "up_proj", inspect=0, verify=1)
def _(ckpt, marker):
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_state(ckpt / R1, lambda s: s.__setitem__(name, s[name][:-1].clone()))


@case("ranks-replicas-differ", "hf_ranks", "model.norm.weight", inspect=0, check=0, verify=1)
def _(ckpt, marker):
    _edit_state(ckpt / R1, lambda s: s.__setitem__("model.norm.weight", s["model.norm.weight"] + 1))


@case("ranks-folder-symlink-loop", "hf_ranks", "rank_01", verify=1)
def _(ckpt, marker):
    shutil.rmtree(ckpt / "rank_01")
    (ckpt / "rank_01").symlink_to("rank_01")


@case("ranks-weights-are-a-folder", "hf_ranks", "rank_01", verify=1)
def _(ckpt, marker):
    (ckpt / R1).unlink()
    (ckpt / R1).mkdir()


# ---------------------------------------------------------------- loose rank files


L0, L1 = "pytorch_model_rank0.bin", "pytorch_model_rank1.bin"


@case("loose-extra-rank-copied", "loose", "pytorch_model_rank2.bin", "a copy of another rank")
def _(ckpt, marker):
    shutil.copy(ckpt / L1, ckpt / "pytorch_model_rank2.bin")


@case("loose-missing-rank-0", "loose", L0, "missing")
def _(ckpt, marker):
    (ckpt / L0).unlink()


@case("loose-absurd-rank-number", "loose", "pytorch_model_rank999999999.bin")
def _(ckpt, marker):
    shutil.copy(ckpt / L1, ckpt / "pytorch_model_rank999999999.bin")


@case("loose-payload", "loose", L1, "posix.system")
def _(ckpt, marker):
    torch_edit(ckpt / L1, lambda sd: sd.__setitem__("evil", payload(marker)))


@case("loose-legacy-payload", "loose", L1, "pickles exec")
def _(ckpt, marker):
    torch_edit(
        ckpt / L1, lambda sd: sd.__setitem__("evil", payload(marker, "exec")), _use_new_zipfile_serialization=False
    )


@case("loose-rank-holds-safetensors", "loose", L1, "holds safetensors data")
def _(ckpt, marker):
    save_file({"x": torch.arange(4.0)}, ckpt / L1)


@case("loose-rank-truncated", "loose", L1, "truncated")
def _(ckpt, marker):
    truncate(ckpt / L1, 0.7)


@case("loose-pipeline-rank", "loose", "pytorch_model_pp_rank1.bin", "not a tensor-parallel rank")
def _(ckpt, marker):
    shutil.copy(ckpt / L1, ckpt / "pytorch_model_pp_rank1.bin")


# ---------------------------------------------------------------- megatron


ITER = "iter_0000100"


def mg(rank: int) -> str:
    return f"{ITER}/mp_rank_{rank:02d}/model_optim_rng.pt"


@case("megatron-payload", "megatron", mg(0), "posix.system")
def _(ckpt, marker):
    torch_edit(ckpt / mg(0), lambda obj: obj.__setitem__("evil", payload(marker)))


@case("megatron-missing-rank", "megatron", "mp_rank_03", "missing")
def _(ckpt, marker):
    shutil.rmtree(ckpt / ITER / "mp_rank_03")


@case("megatron-extra-rank", "megatron", ITER, "tensor_model_parallel_size=8")
def _(ckpt, marker):
    shutil.copytree(ckpt / ITER / "mp_rank_07", ckpt / ITER / "mp_rank_08")


@case("megatron-heads-zero", "megatron", mg(0), "args.num_attention_heads")
def _(ckpt, marker):
    torch_edit(ckpt / mg(0), lambda obj: setattr(obj["args"], "num_attention_heads", 0))


@case("megatron-hidden-word", "megatron", mg(0), "args.hidden_size")
def _(ckpt, marker):
    torch_edit(ckpt / mg(0), lambda obj: setattr(obj["args"], "hidden_size", "sixty-four"))


@case("megatron-rank-truncated", "megatron", mg(2), "truncated")
def _(ckpt, marker):
    truncate(ckpt / mg(2), 0.5)


@case("megatron-tracker-garbage", "megatron", "latest_checkpointed_iteration.txt", "not an iteration")
def _(ckpt, marker):
    (ckpt / "latest_checkpointed_iteration.txt").write_text("latest?")


@case("megatron-storage-overrun", "megatron", mg(1), "the record holds")
def _(ckpt, marker):
    rezip(ckpt / mg(1), pickled=lambda data: patch_first_numel(data, lambda n: n * 8))


# ---------------------------------------------------------------- sat


def sat(rank: int) -> str:
    return f"1/mp_rank_{rank:02d}_model_states.pt"


@case("sat-payload", "sat", sat(0), "posix.system")
def _(ckpt, marker):
    torch_edit(ckpt / sat(0), lambda obj: obj.__setitem__("evil", payload(marker)))


@case("sat-missing-rank", "sat", "mp_rank_05_model_states.pt", "missing")
def _(ckpt, marker):
    (ckpt / sat(5)).unlink()


@case("sat-extra-rank", "sat", "model_config.json", "model_parallel_size is 8")
def _(ckpt, marker):
    shutil.copy(ckpt / sat(7), ckpt / sat(8))


@case("sat-parallel-size-word", "sat", "model_config.json", "model_parallel_size")
def _(ckpt, marker):
    edit_json(ckpt / "model_config.json", lambda c: c.__setitem__("model_parallel_size", "eight"))


@case("sat-rank-truncated", "sat", sat(3), "truncated")
def _(ckpt, marker):
    truncate(ckpt / sat(3), 0.5)


@case("sat-latest-escapes", "sat", "latest", "does not name an iteration folder")
def _(ckpt, marker):
    (ckpt / "latest").write_text("../../etc")


@case("sat-config-not-json", "sat", "model_config.json", "cannot read the config")
def _(ckpt, marker):
    (ckpt / "model_config.json").write_text("{model_parallel_size: 8}")


@case("sat-rank-copied", "sat", "mp_rank_03_model_states.pt", "a copy of another rank")
def _(ckpt, marker):
    shutil.copy(ckpt / sat(2), ckpt / sat(3))


# ---------------------------------------------------------------- dcp


EMBED, DATA = "model.embed_tokens.weight", "__0_0.distcp"


@case("dcp-payload-in-metadata", "dcp", ".metadata", "posix.system")
def _(ckpt, marker):
    rewrite_metadata(ckpt, lambda md: setattr(md, "planner_data", {"evil": payload(marker)}))


@case("dcp-payload-in-chunk", "dcp", DATA, "model.norm.weight", "posix.system", inspect=0, check=0)
def _(ckpt, marker):
    archive = zip_with_pickle("archive", pickle.dumps(payload(marker), protocol=2), {"0": bytes(256)})
    offset = (ckpt / DATA).stat().st_size
    with (ckpt / DATA).open("ab") as handle:
        handle.write(archive)

    def point(md):
        _, info = storage_of(md, "model.norm.weight")
        info.offset, info.length = offset, len(archive)

    rewrite_metadata(ckpt, point)


@case("dcp-metadata-truncated", "dcp", ".metadata", "cannot read DCP metadata")
def _(ckpt, marker):
    truncate(ckpt / ".metadata", 0.5)


@case("dcp-metadata-garbage", "dcp", ".metadata", "cannot read DCP metadata")
def _(ckpt, marker):
    (ckpt / ".metadata").write_bytes(b"not a pickle at all")


@case("dcp-data-truncated", "dcp", DATA, "truncated?")
def _(ckpt, marker):
    truncate(ckpt / DATA, 0.5)


@case("dcp-data-missing", "dcp", DATA, "data file missing")
def _(ckpt, marker):
    (ckpt / DATA).unlink()


@case("dcp-box-outside-the-shape", "dcp", ".metadata", EMBED, "outside the global shape")
def _(ckpt, marker):
    rewrite_metadata(ckpt, lambda md: move_chunk(md, EMBED, (1, 0)))


@case("dcp-box-leaves-a-gap", "dcp", ".metadata", EMBED, "no chunk box covers")
def _(ckpt, marker):
    rewrite_metadata(
        ckpt, lambda md: setattr(md.state_dict_metadata[EMBED].chunks[0], "sizes", torch.Size([1000, 64]))
    )


@case("dcp-boxes-overlap", "dcp", ".metadata", EMBED, "overlap")
def _(ckpt, marker):
    rewrite_metadata(
        ckpt, lambda md: md.state_dict_metadata[EMBED].chunks.append(md.state_dict_metadata[EMBED].chunks[0])
    )


@case("dcp-negative-shape", "dcp", ".metadata", EMBED, "not a tensor's shape")
def _(ckpt, marker):
    rewrite_metadata(ckpt, lambda md: setattr(md.state_dict_metadata[EMBED], "size", torch.Size([-1001, 64])))


@case("dcp-storage-too-short", "dcp", DATA, EMBED, "fewer than its")
def _(ckpt, marker):
    rewrite_metadata(ckpt, lambda md: setattr(storage_of(md, EMBED)[1], "length", 100))


@case("dcp-unsafe-data-path", "dcp", ".metadata", "unsafe file")
def _(ckpt, marker):
    rewrite_metadata(ckpt, lambda md: setattr(storage_of(md, EMBED)[1], "relative_path", "../../outside.distcp"))


assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"
