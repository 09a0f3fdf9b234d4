"""A ``torch.save`` archive read in place: checked, its ``data.pkl`` read by the structure-only unpickler, and where
each storage record's bytes start in the file, so that a layout reads any tensor's bytes straight from the file
(DeepSpeed's files, verl's rank files) without running the pickle or loading a tensor."""

from __future__ import annotations

import pickle
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError, ReshardError
from reshard.formats.torch_zip.checks import check_torch_file
from reshard.formats.torch_zip.structure import data_start, read_structure


def read_archive(
    file: Path, *, refuse: Callable[[str, str], ReshardError | None], max_pickle: int | None = None
) -> tuple[Any, dict[str, int]]:
    """What ``file``'s ``data.pkl`` pickles (:func:`read_structure` with ``refuse``), and each storage record's key
    with the file position its bytes start at.

    Raises:
        ReshardError: what ``refuse`` builds for a global it does not tolerate.
        CorruptFileError: not a torch zip archive (a legacy torch file too), a ``data.pkl`` above ``max_pickle``
            bytes, or records that do not hold what the pickle says.
    """
    root = check_torch_file(file)
    if root is None:
        raise CorruptFileError("a legacy (non-zip) torch file: its tensors cannot be read in place", path=file)
    prefix = f"{root}/" if root else ""
    try:
        with file.open("rb") as handle, zipfile.ZipFile(handle) as archive:
            pickled = archive.getinfo(f"{prefix}data.pkl")
            if max_pickle is not None and pickled.file_size > max_pickle:
                raise CorruptFileError(f"a data.pkl of {pickled.file_size} bytes: not a state dict", path=file)
            obj = read_structure(archive.read(pickled), refuse=refuse)
            records = [info for info in archive.infolist() if info.filename.startswith(f"{prefix}data/")]
            found = {info.filename[len(f"{prefix}data/") :]: data_start(handle.fileno(), info) for info in records}
    except ReshardError:
        raise
    except (
        pickle.UnpicklingError,
        zipfile.BadZipFile,
        KeyError,
        OSError,
        EOFError,
        ValueError,
        TypeError,
        struct.error,
    ) as err:
        raise CorruptFileError(f"not a readable torch file: {err}", path=file) from err
    except (RecursionError, MemoryError, OverflowError) as err:
        raise CorruptFileError(f"not a readable torch file: {type(err).__name__}", path=file) from err
    starts = {key: start for key, start in found.items() if start is not None}
    if len(starts) != len(found):
        raise CorruptFileError("not a readable torch zip archive: a record has no local header", path=file)
    return obj, starts
