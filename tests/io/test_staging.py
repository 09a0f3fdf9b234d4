"""``reshard.io.staging``: an output appears whole or not at all, as an ordinary folder, never over its input."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from fixtures import SAMPLES

from reshard.errors import OutputExistsError, ReshardError
from reshard.io.staging import check_output, staged_output


def test_output_folder_is_an_ordinary_folder(tmp_path: Path, cli) -> None:
    assert cli("convert", SAMPLES / "tiny-llama-tp2", "--tp", 1, "-o", tmp_path / "out", "-q").exit_code == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask


def test_a_finished_output_replaces_the_old_one_and_a_failed_one_leaves_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="midway"), staged_output(out) as staging:
        (staging / "new.txt").write_text("new")
        raise RuntimeError("midway")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["old.txt"]
    with staged_output(out) as staging:
        (staging / "new.txt").write_text("new")
        assert not (out / "new.txt").exists()  # nothing shows before the end
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["new.txt"]


def test_an_output_over_its_input_or_a_non_empty_one_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    (source / "rank_00").mkdir(parents=True)
    for out in (source, source / "sub", tmp_path):
        with pytest.raises(ReshardError, match="overlaps the input"):
            check_output(out, source=source, overwrite=True)
    (tmp_path / "out").mkdir()
    check_output(tmp_path / "out", source=source, overwrite=False)  # empty: fine
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="output exists and is not empty"):
        check_output(tmp_path / "out", source=source, overwrite=False)
    check_output(tmp_path / "out", source=source, overwrite=True)
