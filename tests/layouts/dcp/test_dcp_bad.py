"""Hostile and broken DCP checkpoints (each a copy of a real one with one thing changed): exit code 2, one line
naming the file and the tensor, no traceback, nothing written, and no payload ever runs."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from fractions import Fraction
from pathlib import Path

import pytest
from fixtures.checks import assert_refused
from fixtures.dcp import rewrite_metadata, storage_key

from reshard.formats.dcp_metadata.read import read_index

EMBED = "model.embed_tokens.weight"


def refused_everywhere(cli, ckpt: Path, tmp_path: Path, *fragments: str) -> None:
    """``inspect``, ``check`` and ``convert`` all refuse it the same way."""
    assert_refused(cli("inspect", ckpt), None, *fragments)
    assert_refused(cli("check", ckpt, "--tp", 2), None, *fragments)
    out = tmp_path / "out"
    assert_refused(cli("convert", ckpt, "--tp", 2, "-o", out, "-q"), out, *fragments)


class Payload:
    """Unpickling this calls ``call(*args)``: what a hostile checkpoint would do."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def payloads(marker: Path) -> dict[str, Payload]:
    return {
        "posix.system": Payload(os.system, f"touch {marker}"),
        "io.open": Payload(open, str(marker), "w"),
        "builtins.exec": Payload(exec, f"open({str(marker)!r}, 'w').close()"),
    }


@pytest.mark.parametrize("culprit", ["posix.system", "io.open", "builtins.exec"])
def test_hostile_metadata_never_runs(dcp_copy, tmp_path, cli, culprit):
    ckpt, marker = dcp_copy("tp2"), tmp_path / "pwned"
    evil = payloads(marker)[culprit]
    rewrite_metadata(ckpt, lambda md: md.planner_data.__setitem__("evil", evil))
    refused_everywhere(cli, ckpt, tmp_path, f"{ckpt / '.metadata'}: ", culprit, "refused", "--trust-pickle")
    assert not marker.exists()


def test_hostile_pickle_as_the_whole_metadata(dcp_copy, tmp_path, cli):
    ckpt, marker = dcp_copy("tp4_bf16_nocoll"), tmp_path / "pwned"
    (ckpt / "__1.metadata").write_bytes(pickle.dumps(payloads(marker)["posix.system"]))
    refused_everywhere(cli, ckpt, tmp_path, "__1.metadata: ", "posix.system", "--trust-pickle")
    assert not marker.exists()


def test_hostile_chunk_archive_never_runs(dcp_copy, tmp_path, cli):
    """A chunk whose torch.save archive pickles a payload instead of a tensor: refused when it is read."""
    ckpt, marker = dcp_copy("tp2"), tmp_path / "pwned"
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps(payloads(marker)["posix.system"], protocol=2))
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/data/0", bytes(64 * 4))
    data_file = ckpt / "__0_0.distcp"
    offset = data_file.stat().st_size
    with data_file.open("ab") as handle:
        handle.write(archive.getvalue())

    def point(md):
        md.storage_data[storage_key(md, "model.norm.weight", (0,))].relative_path = "__0_0.distcp"
        md.storage_data[storage_key(md, "model.norm.weight", (0,))].offset = offset
        md.storage_data[storage_key(md, "model.norm.weight", (0,))].length = len(archive.getvalue())

    rewrite_metadata(ckpt, point)
    out = tmp_path / "out"
    assert_refused(
        cli("convert", ckpt, "--tp", 1, "-o", out, "-q"), out, "__0_0.distcp: model.norm.weight: ", "posix.system"
    )
    assert not marker.exists()


def test_unknown_but_trusted_class_is_read_with_trust_pickle(dcp_copy, cli):
    ckpt = dcp_copy("tp2")
    rewrite_metadata(ckpt, lambda md: md.planner_data.__setitem__("ratio", Fraction(1, 3)))
    assert_refused(cli("inspect", ckpt), None, "fractions.Fraction", "--trust-pickle")
    assert cli("inspect", ckpt, "--trust-pickle").exit_code == 0


def embed_chunk(md, row: int):
    return next(c for c in md.state_dict_metadata[EMBED].chunks if c.offsets[0] == row)


def test_chunk_box_outside_the_global_shape(dcp_copy, tmp_path, cli):
    ckpt = dcp_copy("tp2")
    rewrite_metadata(
        ckpt, lambda md: setattr(embed_chunk(md, 501), "sizes", type(md.state_dict_metadata[EMBED].size)([600, 64]))
    )
    refused_everywhere(
        cli, ckpt, tmp_path, f".metadata: {EMBED}: ", "[501:1101, 0:64] lies outside the global shape [1001, 64]"
    )


def test_overlapping_chunk_boxes(dcp_copy, tmp_path, cli):
    ckpt = dcp_copy("tp2")

    def shift(md):
        size = type(md.state_dict_metadata[EMBED].size)
        key = storage_key(md, EMBED, (501, 0))
        info = md.storage_data.pop(key)
        embed_chunk(md, 501).offsets = size([500, 0])
        embed_chunk(md, 500).sizes = size([501, 64])
        key = type(key)(EMBED, size([500, 0]), 1)
        md.storage_data[key] = info

    rewrite_metadata(ckpt, shift)
    refused_everywhere(cli, ckpt, tmp_path, f".metadata: {EMBED}: ", "overlap in [500:501, 0:64]")


def test_missing_chunk_box(dcp_copy, tmp_path, cli):
    ckpt = dcp_copy("tp2")
    rewrite_metadata(ckpt, lambda md: md.state_dict_metadata[EMBED].chunks.remove(embed_chunk(md, 501)))
    refused_everywhere(cli, ckpt, tmp_path, f".metadata: {EMBED}: ", "no chunk box covers [501:1001, 0:64]")


def test_truncated_data_file(dcp_copy, tmp_path, cli):
    ckpt = dcp_copy("tp2")
    chunk = next(c for c in read_index(ckpt).tensors[EMBED].chunks if c.box.offsets[0] == 501)
    os.truncate(chunk.file, chunk.position + 100)
    refused_everywhere(
        cli,
        ckpt,
        tmp_path,
        f"{chunk.file}: {EMBED}: ",
        f"ends at byte {chunk.position + 100}, inside chunk [501:1001, 0:64]",
        "truncated?",
    )


def test_missing_data_file(dcp_copy, tmp_path, cli):
    ckpt = dcp_copy("tp2")
    chunk = next(c for c in read_index(ckpt).tensors[EMBED].chunks if c.box.offsets[0] == 501)
    chunk.file.unlink()
    refused_everywhere(cli, ckpt, tmp_path, f"{chunk.file}: {EMBED}: ", "data file missing", "and chunks of 32 other")


def test_compressed_chunks_are_refused(dcp_copy, tmp_path, cli):
    ckpt = dcp_copy("tp2")
    rewrite_metadata(
        ckpt,
        lambda md: setattr(
            md.storage_data[storage_key(md, EMBED, (0, 0))], "transform_descriptors", ["stream.zstd/1"]
        ),
    )
    refused_everywhere(cli, ckpt, tmp_path, f"{EMBED}: ", "stored compressed (stream.zstd/1): not supported")


def test_corrupt_chunk_archive(dcp_copy, tmp_path, cli):
    ckpt = dcp_copy("tp2")
    chunk = next(c for c in read_index(ckpt).tensors[EMBED].chunks if c.box.offsets[0] == 501)
    with chunk.file.open("r+b") as handle:  # wipe the archive's directory at its end
        handle.seek(chunk.position + chunk.length - 200)
        handle.write(bytes(200))
    out = tmp_path / "out"
    assert_refused(
        cli("convert", ckpt, "--tp", 1, "-o", out, "-q"), out, f"{chunk.file}: {EMBED}: ", "torch.save archive"
    )


def test_missing_rank_metadata(dcp_copy, tmp_path, cli):
    ckpt = dcp_copy("tp4_bf16_nocoll")
    (ckpt / "__1.metadata").unlink()
    refused_everywhere(cli, ckpt, tmp_path, "__1.metadata is missing (found 3 of 4)")


def test_hf_shard_without_sharding_info(dcp_copy, tmp_path, cli):
    from safetensors.torch import load_file, save_file

    ckpt = dcp_copy("hf_sharded")
    shard = ckpt / "shard-00002-model-00002-of-00002.safetensors"
    save_file(load_file(shard), shard, metadata={"format": "pt"})
    refused_everywhere(cli, ckpt, tmp_path, f"{shard}: ", "no usable DCP_SHARDING_INFO")


def test_hf_shard_file_missing(dcp_copy, cli):
    """Without metadata, a lost shard file shows as gaps: every tensor that lost a box is listed."""
    ckpt = dcp_copy("hf_sharded")
    (ckpt / "shard-00001-model-00001-of-00002.safetensors").unlink()
    result = cli("inspect", ckpt)
    assert result.exit_code == 2 and result.stdout == ""
    head, *lines = result.stderr.strip().splitlines()
    assert head == f"Error: {len(lines)} problems:" and lines and "Traceback" not in result.stderr
    for line in lines:
        assert (
            line.startswith(f"  {ckpt}: model.") and "no chunk box covers" in line and "a shard file missing?" in line
        )
