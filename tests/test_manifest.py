"""``reshard.manifest``: ``reshard.json`` read back as written, found beside a folder or a file, refused when it is
not one; every tensor's entry records that its values were finite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures import SAMPLES

from reshard.errors import CorruptFileError
from reshard.manifest import MANIFEST_NAME, find_manifest, read_manifest, write_manifest, written_uneven

SAMPLE = SAMPLES / "tiny-llama-tp2"


def test_a_manifest_reads_back_as_written(tmp_path: Path) -> None:
    manifest = read_manifest(SAMPLE / MANIFEST_NAME)
    assert manifest.to_dict() == json.loads((SAMPLE / MANIFEST_NAME).read_text())
    write_manifest(tmp_path, manifest)
    again = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert again["created"] != "2026-01-01T00:00:00+00:00"  # stamped when written
    assert {k: v for k, v in again.items() if k != "created"} == {
        k: v for k, v in manifest.to_dict().items() if k != "created"
    }


def test_manifest_records_finite() -> None:
    tensors = read_manifest(SAMPLE / MANIFEST_NAME).tensors
    assert len(tensors) == 21 and all(entry.finite is True for entry in tensors.values())


def test_the_manifest_beside_a_folder_or_a_file_is_found(tmp_path: Path) -> None:
    assert find_manifest(SAMPLE).vocab.original == 1001
    assert find_manifest(SAMPLE / "config.json").vocab.original == 1001
    assert find_manifest(SAMPLES / "tiny-llama-65535-tp2") is None
    assert not written_uneven(find_manifest(SAMPLE)) and not written_uneven(None)


@pytest.mark.parametrize(
    ("text", "match"),
    [("{not json", "not a reshard manifest"), ('{"format": "other/2"}', "format is 'other/2'")],
    ids=["not-json", "other-format"],
)
def test_a_file_that_is_not_a_manifest_is_refused(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / MANIFEST_NAME).write_text(text)
    with pytest.raises(CorruptFileError, match=match):
        find_manifest(tmp_path)
