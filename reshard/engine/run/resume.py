"""What a resumed conversion still has to do (``convert --resume``; the journal is :mod:`reshard.io.journal`), and
the journal a run keeps.

Two facts decide it: the fingerprint (is the partial output of this very conversion?) and, per tensor, whether
the journal holds its manifest facts and every data file it is written into was found complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from reshard.engine.plan.planner import ConversionPlan, TensorPlan
from reshard.engine.run.workers import Group
from reshard.errors import OutputExistsError, ReshardError
from reshard.formats.file_plan import FilePlan
from reshard.io.journal import Journal, Resumed
from reshard.manifest import MANIFEST_NAME, Manifest, read_manifest
from reshard.options import ConvertOptions
from reshard.version import __version__

# Options that change no byte of the output: a resumed run may differ in them.
NEUTRAL_OPTIONS = ("progress", "jobs", "overwrite", "resume", "force", "allow_vocab_shrink")


def conversion_facts(ckpt: Path, conversion: ConversionPlan, layout: str, options: ConvertOptions) -> dict[str, Any]:
    """What the output's bytes depend on: the source files (names, sizes, modification times), the target layout,
    every target tensor (name, dtype, per-rank shapes) and the options that change bytes."""
    ckpt = Path(ckpt)
    files = [ckpt] if ckpt.is_file() else sorted(p for p in ckpt.rglob("*") if p.is_file())
    return {
        "source": [[p.relative_to(ckpt).as_posix() if p != ckpt else p.name, *_stat(p)] for p in files],
        "layout": layout,
        "tensors": sorted(
            [t.name, t.code, [list(shape) for shape in t.rank_shapes]]
            for plan in conversion.tensors
            for t in plan.targets
        ),
        "options": {name: _text(value) for name, value in _flat(options) if name not in NEUTRAL_OPTIONS},
    }


def _flat(options: ConvertOptions) -> list[tuple[str, Any]]:
    """Every option by the name its flag has: what to write, then how the source is read (``options.read``)."""
    written = [(f.name, getattr(options, f.name)) for f in dataclasses.fields(options) if f.name != "read"]
    return written + [(f.name, getattr(options.read, f.name)) for f in dataclasses.fields(options.read)]


def _text(value: Any) -> str:
    """An option as text that is the same in every process: a set's items sorted (a frozenset's order follows the
    process's string hashes, so ``--drop a,b`` would otherwise differ between a run and its ``--resume``)."""
    return str(sorted(value)) if isinstance(value, frozenset | set) else str(value)


def fingerprint(ckpt: Path, conversion: ConversionPlan, layout: str, options: ConvertOptions) -> str:
    """sha256 of :func:`conversion_facts`."""
    return _hash(conversion_facts(ckpt, conversion, layout, options))


def _hash(facts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def difference(before: Any, now: dict[str, Any]) -> str | None:
    """What differs between the facts an earlier run recorded (``before``, untrusted) and ``now``: the options
    (``--vocab 1000 -> 1001``), then the source files, then the target; None when ``before`` tells nothing."""
    if not isinstance(before, dict):
        return None
    said: list[str] = []
    options = before.get("options")
    old_options = options if isinstance(options, dict) else {}
    for name, value in now["options"].items():
        if name in old_options and old_options[name] != value:
            said.append(f"--{name.replace('_', '-')} {_short(old_options[name])} then, {_short(value)} now")
    source = before.get("source")
    old_source = source if isinstance(source, list) else []
    old_files = {str(entry[0]): entry[1:] for entry in old_source if isinstance(entry, list) and entry}
    new_files = {entry[0]: entry[1:] for entry in now["source"]}
    for name in sorted(old_files.keys() - new_files.keys())[:3]:
        said.append(f"source file {_short(name)} is gone")
    for name in sorted(new_files.keys() - old_files.keys())[:3]:
        said.append(f"source file {_short(name)} is new")
    for name in sorted(n for n in new_files.keys() & old_files.keys() if new_files[n] != old_files[n])[:3]:
        said.append(f"source file {_short(name)} changed (size or modification time)")
    if before.get("layout") != now["layout"]:
        said.append(f"target layout {_short(before.get('layout'))} then, {now['layout']} now")
    if not said and before.get("tensors") != now["tensors"]:
        said.append("the target tensors' names, dtypes or shapes differ")
    return "; ".join(said) or None


def _short(value: Any, limit: int = 60) -> str:
    """An untrusted value for a message, never longer than ``limit``."""
    text = ("unset" if value == "None" else value) if isinstance(value, str) else "?"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stat(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def still_to_do(conversion: ConversionPlan, file_plan: FilePlan, resumed: Resumed) -> ConversionPlan:
    """``conversion`` without the tensors an earlier run finished: journaled, and in kept files only."""
    if not resumed.files and not resumed.tensors:
        return conversion
    pending = file_plan.tensors_in(file for file in file_plan.files if file not in resumed.files)

    def finished(plan: TensorPlan) -> bool:
        return all(t.name in resumed.tensors and t.name not in pending for t in plan.targets)

    return dataclasses.replace(conversion, tensors=tuple(plan for plan in conversion.tensors if not finished(plan)))


def manifest_record(facts: dict[str, Any]) -> dict[str, Any]:
    """What the output's ``reshard.json`` keeps of the conversion's facts (``conversion``): its fingerprint, and
    what :func:`difference` names (the source files, the layout, the options), so a later ``--resume`` knows the
    output for this conversion's, or says what differs."""
    return {
        "fingerprint": _hash(facts),
        "source": facts["source"],
        "layout": facts["layout"],
        "options": facts["options"],
    }


def already_complete(out: Path, facts: dict[str, Any]) -> Manifest | None:
    """``--resume`` of an output that is already there: its manifest when it is this very conversion's (nothing to
    do); None when ``out`` holds no output of reshard (the usual refusal of a non-empty folder applies).

    Raises:
        OutputExistsError: ``out`` is a complete output of another conversion, naming what differs.
    """
    path = out / MANIFEST_NAME
    if not path.is_file():
        return None
    manifest = read_manifest(path)
    record = manifest.conversion or {}
    if record.get("fingerprint") == _hash(facts) and manifest.reshard_version == __version__:
        return manifest
    if not record:
        what: str | None = "its reshard.json records no conversion (an older reshard wrote it)"
    elif manifest.reshard_version != __version__:  # its digests and layout rules may differ from this version's
        what = f"written by reshard {_short(manifest.reshard_version)}, this is {__version__}"
    else:
        what = difference(record, facts)
    raise OutputExistsError(
        f"output is complete, but of another conversion: {what or 'the target tensors differ'}",
        path=out,
        hint="pass --overwrite to replace it, or choose another -o",
    )


def open_journal(
    staging: Path, facts: dict[str, Any], options: ConvertOptions, group: Group | None
) -> tuple[Journal | None, Resumed]:
    """With ``--resume``: this worker's journal in the staged folder, and what an earlier run left there that still
    checks out (rank 0 checks it and tells the others: all must agree on it). Nothing without ``--resume``.
    ``facts``: the conversion's (:func:`conversion_facts`)."""
    if not options.resume:
        return None, Resumed()
    mark = _hash(facts)

    def resume() -> tuple[Journal, Resumed]:
        return Journal.resume(staging, mark, facts=facts, describe=lambda before: difference(before, facts))

    if group is None:
        return resume()
    if group.rank == 0:
        try:
            journal, resumed = resume()
        except ReshardError as err:
            group.broadcast(err.one_line())
            raise
        group.broadcast(resumed)
        return journal, resumed
    resumed = group.broadcast(None)
    if isinstance(resumed, str):  # rank 0 found the partial output unusable, and says why
        raise ReshardError(resumed)
    return Journal.start(staging, mark, rank=group.rank, facts=facts), resumed
