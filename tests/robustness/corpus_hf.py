"""Damaged Hugging Face folders: safetensors headers and truncations, config.json, reshard.json, sharded indexes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from cases import case
from damage import (
    deep_json,
    edit_json,
    rewrite_header,
    split_safetensors,
    tensors_of,
    truncate,
)
from safetensors.torch import load_file, save_file

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
    "digest-number", lambda m: m["tensors"]["lm_head.weight"].__setitem__("blake3", 7), "lm_head.weight.blake3"
)
_manifest_case(
    "two-digests", lambda m: m["tensors"]["lm_head.weight"].__setitem__("sha256", "0" * 64), "lm_head.weight"
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
