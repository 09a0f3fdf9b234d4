"""The unseen corpus: a few hundred randomly damaged checkpoints the test suite never runs, counted, not asserted.

    .venv/bin/python tests/robustness/fuzz_unseen.py [--count 300] [--seed 7919] [--report report.json]

Each checkpoint is a copy of one of the bases (``bases.py``) with one to three random changes (bytes flipped,
a file cut short, grown, deleted, copied to another rank's name, replaced by a hostile pickle, a JSON field or
a safetensors header field set to a random value, DCP metadata fields scrambled, symlink loops, renamed ranks),
run through every command. Printed: how many tracebacks, partial outputs (an output or a temporary file left
after a failure), modified inputs and executed payloads there were (the target is 0 of each), plus hangs,
exit codes outside 0/1/2 and error messages that are not one line. Not collected by pytest (no ``test_``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
from bases import ARGS, build_bases, copy_base  # noqa: E402
from damage import payload, rewrite_metadata, split_safetensors  # noqa: E402
from harness import COMMANDS, Workspace, clear_outputs, run, snapshot  # noqa: E402

MEMORY_LIMIT = 8 << 30  # a memory bomb becomes a MemoryError (a traceback, counted), not a stalled machine
CASE_SECONDS = 120


def random_json(rng: random.Random, depth: int = 0):
    kinds = ["int", "neg", "big", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(0, 5000)
    if kind == "neg":
        return -rng.randint(1, 5000)
    if kind == "big":
        return rng.choice([2**63, 10**12, 2**64 + 1, 10**30])
    if kind == "float":
        return rng.choice([0.5, 999.5, -1.0, 1e308])
    if kind == "str":
        return rng.choice(["", "abc", "../x", "rank_01", "F32", "\x00", "é" * 3])
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "null":
        return None
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "shape", "dtype", "tp"]): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def files_of(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and not p.is_symlink())


def set_random_field(rng: random.Random, data, value):
    """Set a random key (at any depth) of a JSON value to ``value``; returns the changed value."""
    if isinstance(data, dict) and data:
        key = rng.choice(sorted(data, key=str))
        if rng.random() < 0.5 and isinstance(data[key], (dict, list)) and data[key]:
            data[key] = set_random_field(rng, data[key], value)
        else:
            data[key] = value
        return data
    if isinstance(data, list) and data:
        index = rng.randrange(len(data))
        data[index] = set_random_field(rng, data[index], value) if rng.random() < 0.5 else value
        return data
    return value


def mutate(rng: random.Random, ckpt: Path, marker: Path) -> str:
    """Apply one random change; returns what it did."""
    files = files_of(ckpt)
    path = rng.choice(files)
    relative = path.relative_to(ckpt)
    kind = rng.choice(
        ["flip", "truncate", "grow", "delete", "copy-rank", "json", "header", "hostile", "metadata", "loop", "rename"]
    )
    if kind == "flip":
        raw = bytearray(path.read_bytes())
        for _ in range(rng.randint(1, 8)):
            if raw:
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
    elif kind == "truncate":
        os.truncate(path, rng.randrange(path.stat().st_size + 1))
    elif kind == "grow":
        with path.open("ab") as handle:
            handle.write(rng.randbytes(rng.randint(1, 64)))
    elif kind == "delete":
        path.unlink()
    elif kind == "copy-rank":
        numbered = [p for p in ckpt.rglob("*") if any(c.isdigit() for c in p.name) and p.exists()]
        source = rng.choice(numbered) if numbered else path
        digits = "".join(c for c in source.name if c.isdigit())
        target = source.with_name(source.name.replace(digits, str(int(digits or 0) + rng.choice([1, 2, 999999]))))
        if not target.exists():
            if source.is_dir():
                shutil.copytree(source, target, symlinks=True)
            else:
                shutil.copy(source, target, follow_symlinks=False)
        relative = target.relative_to(ckpt)
    elif kind == "json":
        jsons = [f for f in files if f.suffix == ".json"] or [path]
        path = rng.choice(jsons)
        relative = path.relative_to(ckpt)
        try:
            data = json.loads(path.read_text())
            path.write_text(json.dumps(set_random_field(rng, data, random_json(rng))))
        except (ValueError, UnicodeDecodeError):
            path.write_text(json.dumps(random_json(rng)))
    elif kind == "header":
        tensors = [f for f in files if f.suffix == ".safetensors"] or [path]
        path = rng.choice(tensors)
        relative = path.relative_to(ckpt)
        try:
            header, data = split_safetensors(path)
            text = json.dumps(set_random_field(rng, header, random_json(rng))).encode()
            path.write_bytes(struct.pack("<Q", len(text)) + text + data)
        except (ValueError, struct.error, UnicodeDecodeError):
            path.write_bytes(path.read_bytes()[:4])
    elif kind == "hostile":
        torch_files = [f for f in files if f.suffix in (".pt", ".bin", ".distcp")] or [path]
        path = rng.choice(torch_files)
        relative = path.relative_to(ckpt)
        evil = payload(marker, rng.choice(["system", "exec", "open"]))
        if path.suffix == ".distcp" or rng.random() < 0.3:
            path.write_bytes(pickle.dumps(evil, protocol=rng.choice([2, 4])))
        else:
            try:
                obj = torch.load(path, weights_only=False)
                if isinstance(obj, dict):
                    obj[rng.choice(["evil", "model", "args"])] = evil
                fresh = path.with_name(path.name + ".new")  # never rewrite a file its own tensors may map
                torch.save(obj, fresh, _use_new_zipfile_serialization=rng.random() < 0.7)
                os.replace(fresh, path)
            except Exception:  # noqa: BLE001 - already damaged by an earlier change: replace it outright
                path.write_bytes(pickle.dumps(evil))
    elif kind == "metadata" and (ckpt / ".metadata").is_file():
        relative = Path(".metadata")

        def scramble(md):
            entry = md.state_dict_metadata[rng.choice(sorted(md.state_dict_metadata))]
            target = rng.choice(["size", "chunk", "storage", "properties"])
            if target == "size":
                entry.size = torch.Size([rng.randint(-5, 2000) for _ in range(rng.randint(0, 3))])
            elif target == "chunk" and entry.chunks:
                setattr(entry.chunks[0], rng.choice(["offsets", "sizes"]), torch.Size([rng.randint(-5, 2000)]))
            elif target == "storage":
                info = rng.choice(list(md.storage_data.values()))
                setattr(info, rng.choice(["offset", "length", "relative_path"]), random_json(rng))
            else:
                entry.properties.dtype = rng.choice([torch.complex128, torch.int8, None])

        try:
            rewrite_metadata(ckpt, scramble)
        except Exception:  # noqa: BLE001 - the metadata is already damaged: cut it short instead
            os.truncate(ckpt / ".metadata", 10)
    elif kind == "loop":
        path.unlink()
        path.symlink_to(path.name)
    else:  # rename: a rank number changed, or a name that is no longer one
        digits = "".join(c for c in path.name if c.isdigit())
        new = path.name.replace(digits, str(rng.choice([0, 3, 10**9]))) if digits else path.name + ".old"
        if not (path.parent / new).exists():
            path.rename(path.parent / new)
            relative = (path.parent / new).relative_to(ckpt)
    return f"{kind}:{relative}"


def safely_mutate(rng: random.Random, ckpt: Path, marker: Path) -> str:
    """:func:`mutate`, or what kept it from applying (a file an earlier change removed or looped)."""
    try:
        return mutate(rng, ckpt, marker)
    except (OSError, IndexError, shutil.Error, ValueError) as err:
        return f"not applied ({type(err).__name__})"


class Hang(Exception):
    pass


def on_alarm(signum, frame):
    raise Hang(f"no answer in {CASE_SECONDS} s")


def one_case(rng: random.Random, bases: dict[str, Path], root: Path) -> dict:
    base = rng.choice(sorted(bases))
    ws = Workspace(root)
    copy_base(bases[base], ws.ckpt)
    changes = [safely_mutate(rng, ws.ckpt, ws.marker) for _ in range(rng.randint(1, 3))]
    ws.marker.unlink(missing_ok=True)  # a second hostile change loads the first one fully: that run is the fuzzer's
    before = snapshot(ws.ckpt)
    record = {"base": base, "changes": changes, "results": {}, "problems": []}
    for command in COMMANDS:
        signal.alarm(CASE_SECONDS)
        try:
            outcome = run(command, ws.ckpt, ARGS[base][command], ws)
        except Hang as err:
            record["problems"].append(("hang", command, str(err)))
            continue
        finally:
            signal.alarm(0)
        record["results"][command] = outcome.exit_code
        if isinstance(outcome.exception, Hang):
            record["problems"].append(("hang", command, str(outcome.exception)))
        elif outcome.exception is not None or "Traceback" in outcome.stderr:
            what = f"{type(outcome.exception).__name__}: {outcome.exception}" if outcome.exception else "printed"
            record["problems"].append(("traceback", command, what[:300]))
        if outcome.exit_code not in (0, 1, 2):
            record["problems"].append(("exit-code", command, outcome.exit_code))
        lines = outcome.stderr.strip().splitlines()
        listed = lines and lines[0].startswith("Error: ") and all(x.startswith("  ") for x in lines[1:])
        if outcome.exit_code == 2 and not listed:
            record["problems"].append(("error-line", command, outcome.stderr.strip()[:300]))
        if outcome.exit_code != 0 and any(ws.outs.iterdir()):
            record["problems"].append(("partial-output", command, sorted(p.name for p in ws.outs.iterdir())))
        if any(ws.tmp.iterdir()):
            record["problems"].append(("partial-output", command, sorted(p.name for p in ws.tmp.iterdir())))
            shutil.rmtree(ws.tmp)
            ws.tmp.mkdir()
        if snapshot(ws.ckpt) != before:
            record["problems"].append(("modified-input", command, ""))
            before = snapshot(ws.ckpt)
        if ws.marker.exists():
            record["problems"].append(("payload-ran", command, ""))
            ws.marker.unlink()
        clear_outputs(ws)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7919)  # the corpus and the property tests use others
    parser.add_argument("--report", type=Path, help="write every case and its results as JSON here")
    parser.add_argument("--progress", action="store_true", help="name each case on stderr as it is done")
    args = parser.parse_args()
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    signal.signal(signal.SIGALRM, on_alarm)
    rng = random.Random(args.seed)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="reshard-fuzz-") as work:
        bases = build_bases(Path(work) / "bases")
        records = []
        for number in range(args.count):
            records.append(one_case(rng, bases, Path(work) / f"case{number:04d}"))
            if args.progress:
                print(f"case {number}: {records[-1]['base']} {records[-1]['changes']}", file=sys.stderr, flush=True)
            shutil.rmtree(Path(work) / f"case{number:04d}", ignore_errors=True)
    kinds = Counter(kind for r in records for kind, _, _ in r["problems"])
    exits = Counter(f"{c}={code}" for r in records for c, code in r["results"].items())
    summary = {
        "cases": len(records),
        "commands run": sum(len(r["results"]) for r in records),
        "seconds": round(time.monotonic() - start, 1),
        "tracebacks": kinds["traceback"],
        "partial outputs": kinds["partial-output"],
        "modified inputs": kinds["modified-input"],
        "executed payloads": kinds["payload-ran"],
        "hangs": kinds["hang"],
        "exit codes outside 0/1/2": kinds["exit-code"],
        "errors not one line": kinds["error-line"],
        "cases with a problem": sum(1 for r in records if r["problems"]),
        "exit codes": dict(sorted(exits.items())),
    }
    print(json.dumps(summary, indent=2))
    for record in (r for r in records if r["problems"]):
        print(json.dumps({k: record[k] for k in ("base", "changes", "problems")})[:1500])
    if args.report:
        args.report.write_text(json.dumps({"summary": summary, "cases": records}, indent=1, default=str))
    return 0 if not any(kinds.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
