"""Damaged hf-ranks folders (missing, extra, duplicated and disagreeing ranks) and DCP checkpoints."""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from cases import case
from damage import (
    edit_json,
    move_chunk,
    payload,
    rewrite_metadata,
    storage_of,
    truncate,
    zip_with_pickle,
)
from safetensors.torch import load_file, save_file

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


# Hostile values: a few bytes that would hang, exhaust memory or raise through repr/str/int of their whole.


def _bomb(levels: int) -> tuple:
    """``levels`` nested ``(x, x)``: 2^levels leaves for ``repr``, a few bytes pickled (every level shared)."""
    x: tuple = ()
    for _ in range(levels):
        x = (x, x)
    return x


class _Reduced:
    """Pickles as ``func(*args)`` without calling it (what a hostile file holds)."""

    def __init__(self, func: object, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


def _splice(ckpt: Path, change: Callable[[object, str], object], opcodes: bytes) -> None:
    """Put ``opcodes`` (a pickled value built without memo) where ``change`` put a marker string in ``.metadata``."""
    marker = "RESHARD-SPLICE-MARKER"
    rewrite_metadata(ckpt, lambda md: change(md, marker))
    data = (ckpt / ".metadata").read_bytes()
    pickled = b"\x8c" + bytes([len(marker)]) + marker.encode()  # SHORT_BINUNICODE (protocol 4); its MEMOIZE stays
    assert data.count(pickled) == 1
    (ckpt / ".metadata").write_bytes(data.replace(pickled, opcodes))


@case("dcp-size-reference-bomb", "dcp", ".metadata", EMBED, "is not a list of integers")
def _(ckpt, marker):
    rewrite_metadata(ckpt, lambda md: setattr(md.state_dict_metadata[EMBED], "size", _bomb(40)))


@case("dcp-size-nested-100000-deep", "dcp", ".metadata", EMBED, "is not a list of integers")
def _(ckpt, marker):
    deep = b"(" * 100_000 + b"]" + b"l" * 100_000  # [[[...[]...]]], built without recursion
    _splice(ckpt, lambda md, m: setattr(md.state_dict_metadata[EMBED], "size", m), deep)


@case("dcp-size-5001-digits", "dcp", ".metadata", EMBED, "beyond 64 bits")
def _(ckpt, marker):
    rewrite_metadata(ckpt, lambda md: setattr(md.state_dict_metadata[EMBED], "size", [10**5000, 64]))


@case("dcp-offset-5001-digits", "dcp", ".metadata", EMBED, "beyond 64 bits")
def _(ckpt, marker):
    rewrite_metadata(ckpt, lambda md: setattr(md.state_dict_metadata[EMBED].chunks[0], "offsets", [10**5000, 0]))


@case("dcp-storage-offset-5001-digits", "dcp", ".metadata", EMBED, "bytes at <an integer of about 5001 digits>")
def _(ckpt, marker):
    rewrite_metadata(ckpt, lambda md: setattr(storage_of(md, EMBED)[1], "offset", 10**5000))


@case("dcp-path-reference-bomb", "dcp", ".metadata", "cannot read DCP metadata", "other than strings")
def _(ckpt, marker):
    import pathlib

    rewrite_metadata(ckpt, lambda md: setattr(md, "planner_data", {"p": _Reduced(pathlib.PosixPath, _bomb(40))}))
