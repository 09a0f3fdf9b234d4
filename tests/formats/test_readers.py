"""``reshard.formats.readers``: a file cut after it was opened is a named error; reading a torch file into a
buffer reads its bytes from their place in the file, or (a strided tensor) lets go of the pages its memory map
brought in; short strided rows are read in blocks of rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.tp import arange
from safetensors.torch import save_file

from reshard.errors import CorruptFileError
from reshard.formats import readers
from reshard.formats.readers import SafetensorsReader, TorchReader
from reshard.io.vectored import release_mapped


def test_read_into_a_file_cut_after_opening_is_a_corrupt_file_error(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    save_file({"w": arange((64, 64))}, path)
    reader = SafetensorsReader(path)
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size - 100)
    with pytest.raises(CorruptFileError, match=r"cut\.safetensors.*w.*file ends"):
        reader.read_into("w", torch.empty(64, 64))


def test_short_strided_rows_are_read_in_blocks_of_rows_into_their_column_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rank.safetensors"
    save_file({"pad": torch.ones(3), "w": arange((37, 48))}, path)  # rows of 192 bytes, the tensor not at offset 0
    monkeypatch.setattr(readers, "CHUNK_BYTES", 5 * 192 + 17)  # blocks of 5 rows; 8 blocks, the last of 2 rows
    reader = SafetensorsReader(path)
    gathered = torch.full((37, 96), -1.0)
    reader.read_into("w", gathered[:, 48:])  # the second rank's column block of a row-parallel weight
    assert torch.equal(gathered[:, 48:], arange((37, 48)))
    assert bool((gathered[:, :48] == -1).all())  # nothing outside the block was touched
    tail = torch.full((30, 96), -1.0)
    reader.read_into("w", tail[:, 10:58], start=7 * 192)  # rows 7.. of the tensor
    assert torch.equal(tail[:, 10:58], arange((37, 48))[7:])
    assert bool((tail[:, :10] == -1).all()) and bool((tail[:, 58:] == -1).all())


def _mapped_rss_kb(path: Path) -> int:
    """Resident kB of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) == 6 and fields[5] == str(path.resolve())
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_a_torch_files_contiguous_tensor_is_read_from_its_place_in_the_file_not_the_mapping(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    torch.save({"pad": torch.ones(3), "w": arange((1024, 2048))}, path)  # 8 MB, not at the first record
    reader = TorchReader(path)
    out = torch.empty(1024, 2048)
    reader.read_into("w", out)
    assert torch.equal(out, arange((1024, 2048)))
    assert _mapped_rss_kb(path) < 100  # no page of the mapping was touched
    half = torch.empty(512, 2048)
    reader.read_into("w", half, start=half.nbytes)  # the second half, from its offset
    assert torch.equal(half, arange((1024, 2048))[512:])


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_reading_a_strided_tensor_of_a_torch_file_lets_go_of_its_mapped_pages(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    torch.save({"w": arange((2048, 1024)).t()}, path)  # 8 MB, saved as a transposed view
    reader = TorchReader(path)
    out = torch.empty(1024, 2048)
    out.copy_(reader.get("w"))  # a plain read leaves the pages mapped and resident
    assert _mapped_rss_kb(path) > 4000
    reader.read_into("w", out)
    assert torch.equal(out, arange((2048, 1024)).t())
    assert _mapped_rss_kb(path) < 100
    assert torch.equal(reader.get("w"), arange((2048, 1024)).t())  # read again from the page cache
    anonymous = arange((1024, 2048))
    release_mapped(anonymous, [(0, 4096, 0)])  # memory outside the file's mappings is never dropped
    assert torch.equal(anonymous, arange((1024, 2048)))
