"""Benchmark ``reshard convert`` against ``cp -r`` (the disk's own speed) and a naive load-everything script.

For every ``--sizes`` GB it makes a synthetic Llama-7B-shaped tp=8 checkpoint (``make_synthetic.py``)
and measures, each in a fresh process and ``--repeat`` times round-robin (the fastest run counts):

* ``cp -r`` of the checkpoint folder,
* ``reshard convert --tp 4`` and ``--tp 1``,
* the naive baseline (``naive.py``) ``--tp 4`` and ``--tp 1`` (skipped, with the reason, when the
  machine has not enough free memory for it),

in both the ``hf-ranks`` (safetensors) and, when reshard can read it, the ``megatron`` layout. Before
each measurement the page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``) when the
process may, so every run reads the checkpoint from the disk (Python and torch are then imported once,
untimed, so the tool's own code is not counted); the wall time includes a final ``sync``, so every run
has also put its output on the disk. Peak resident memory comes from ``/usr/bin/time -v`` (or
``getrusage`` of a fresh child). Rows accumulate in ``bench/out/results.json`` (so sizes can be run
at different times) and ``bench/RESULTS.md`` is rewritten from all of them.

Examples:
    python bench/run.py --sizes 2
    python bench/run.py --sizes 4 --layouts hf-ranks,megatron
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the model sizes of the tests' builders

from fixtures.shapes import llama_7b_config  # noqa: E402

OUT = HERE / "out"
RESULTS_JSON = OUT / "results.json"
RESULTS_MD = HERE / "RESULTS.md"
OBSERVATIONS = "## Observations"
LLAMA_7B = llama_7b_config(1)
LARGEST_TENSOR = LLAMA_7B["vocab_size"] * LLAMA_7B["hidden_size"] * 2  # the bf16 embedding (and lm_head) of Llama-7B
BOUND = 2 * LARGEST_TENSOR + 600 * 10**6
TIME = Path("/usr/bin/time")


def python() -> str:
    return sys.executable


def reshard() -> list[str]:
    """The ``reshard`` of this Python environment."""
    exe = Path(sys.executable).parent / "reshard"
    return [str(exe)] if exe.exists() else [python(), "-c", "from reshard.cli import main; main()"]


def drop_caches() -> str | None:
    """Drop the page cache; returns why not when it cannot."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return None
    except OSError as err:
        return f"cannot drop caches ({err.strerror or err}); runs read from a warm page cache"


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(command: list[str], *, cold: bool) -> dict:
    """Run ``command`` in a fresh process (plus ``sync``); wall seconds, peak RSS bytes, exit code."""
    if cold:
        drop_caches()
        # the tool's own code (Python, torch) is read back before the clock starts: only the checkpoint is cold
        subprocess.run([python(), "-c", "import reshard.cli, safetensors.torch"], check=True)
    before = load()
    stats = OUT / "time.txt"
    started = time.perf_counter()
    if TIME.exists():
        proc = subprocess.run([str(TIME), "-v", "-o", str(stats), *command], capture_output=True, text=True)
        os.sync()
        wall = time.perf_counter() - started
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stats.read_text())
        rss = int(match.group(1)) * 1024 if match else None
    else:
        probe = (
            "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]).returncode; "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r)"
        )
        proc = subprocess.run([python(), "-c", probe, *command], capture_output=True, text=True)
        os.sync()
        wall = time.perf_counter() - started
        rss = int(proc.stdout.split()[-1]) * 1024 if proc.stdout.split() else None
    return {"wall": wall, "rss": rss, "rc": proc.returncode, "stderr": proc.stderr[-2000:], "load": before}


def can_read(src: Path) -> str | None:
    """None when ``reshard inspect`` reads the checkpoint, else its error line."""
    proc = subprocess.run([*reshard(), "inspect", str(src), "--json"], capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def cases(src: Path, layout: str, naive_max_gb: float) -> list[tuple[str, list[str] | None, str | None]]:
    """(name, command, reason it is skipped)."""
    naive = [python(), str(HERE / "naive.py"), str(src)]
    out = OUT / "run-output"
    rows: list[tuple[str, list[str] | None, str | None]] = [("cp -r", ["cp", "-r", str(src), str(out)], None)]
    unreadable = can_read(src)
    for tp in (4, 1):
        command = [*reshard(), "convert", str(src), "--tp", str(tp), "-o", str(out), "-q"]
        rows.append((f"reshard 8->{tp}", None if unreadable else command, unreadable and f"reshard: {unreadable}"))
    size = folder_bytes(src)
    for tp in (4, 1):
        need = int(2.3 * size) + 2 * 10**9  # the model, one target rank, the bytes objects save_file makes
        reason = None
        if size > naive_max_gb * 1e9:
            reason = f"above --naive-max-gb {naive_max_gb:g} (it needs ~{need / 1e9:.0f} GB of memory)"
        elif need > mem_available():
            reason = f"needs ~{need / 1e9:.0f} GB free, {mem_available() / 1e9:.0f} GB available"
        rows.append((f"naive 8->{tp}", [*naive, str(out), "--tp", str(tp), "--layout", layout], reason))
    return rows


def clear_output() -> None:
    """Delete the last output and let the file system settle (the disk is mounted with online discard)."""
    shutil.rmtree(OUT / "run-output", ignore_errors=True)
    os.sync()
    time.sleep(2)


def run_size(size_gb: float, layout: str, cold: bool, repeat: int, naive_max_gb: float) -> list[dict]:
    """Every case ``repeat`` times, round-robin (so each sees the same conditions); the fastest run of each."""
    src = OUT / f"{layout}-{size_gb:g}g-tp8"
    if not src.exists():
        subprocess.run(
            [python(), str(HERE / "make_synthetic.py"), str(src), "--size-gb", str(size_gb), "--layout", layout],
            check=True,
        )
    size = folder_bytes(src)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    todo = cases(src, layout, naive_max_gb)
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in todo}
    for _ in range(repeat):
        for name, command, reason in todo:
            if reason or (runs[name] and runs[name][-1]["rc"]):
                continue
            clear_output()
            runs[name].append(measure(command, cold=cold))
    clear_output()
    rows = []
    cp_wall = None
    for name, _, reason in todo:
        row = {"layout": layout, "size_gb": size_gb, "bytes": size, "case": name, "when": when, "cold": cold}
        row["command"] = "python bench/run.py " + " ".join(sys.argv[1:])
        failed = [r for r in runs[name] if r["rc"]]
        if reason:
            row["skipped"] = reason
            print(f"{layout} {size / 1e9:.2f} GB {name:14s} skipped: {reason}", flush=True)
        elif failed:
            row["skipped"] = f"failed (exit {failed[0]['rc']}): {failed[0]['stderr'].strip().splitlines()[-1:]}"
            print(f"{layout} {size / 1e9:.2f} GB {name:14s} FAILED: {failed[0]['stderr'][-500:]}", flush=True)
        else:
            best = min(runs[name], key=lambda r: r["wall"])
            row |= best | {
                "rss": max(r["rss"] or 0 for r in runs[name]),
                "walls": [round(r["wall"], 2) for r in runs[name]],
            }
            cp_wall = best["wall"] if name == "cp -r" else cp_wall
            row["gbps"] = size / best["wall"] / 1e9
            row["vs_cp"] = cp_wall / best["wall"] if cp_wall else None
            print(
                f"{layout} {size / 1e9:.2f} GB {name:14s} {best['wall']:7.1f} s {row['gbps']:6.3f} GB/s "
                f"x{row['vs_cp'] or 0:.2f} of cp  peak RSS {row['rss'] / 1e6:7.0f} MB  walls {row['walls']} "
                f"(load {best['load']})",
                flush=True,
            )
        rows.append(row)
    return rows


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), platform.processor())
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    mem = next(line.split()[1] for line in meminfo if line.startswith("MemTotal"))
    fs = subprocess.run(["df", "-hT", str(OUT)], capture_output=True, text=True).stdout.splitlines()[-1].split()
    import torch  # noqa: PLC0415 (only for the version)

    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "memory": f"{int(mem) / 1e6:.1f} GB",
        "disk": f"{fs[0]} ({fs[1]}), {fs[2]}",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def kept_observations() -> str:
    """The hand-written ``## Observations`` section of the current RESULTS.md, kept across rewrites."""
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else ""
    start = text.find(OBSERVATIONS)
    return "\n" + text[start:] if start >= 0 else ""


def render(rows: list[dict], info: dict, notes: list[str]) -> str:
    lines = [
        "# reshard benchmark results",
        "",
        "Written by `bench/run.py` (how to run it: docs/performance.md).",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in info.items()],
        *[f"- {n}" for n in notes],
        "",
        "## Commands",
        "",
        *[f"    {c}" for c in dict.fromkeys(r.get("command", "python bench/run.py") for r in rows)],
        "",
        "## Results",
        "",
        "Peak RSS bound for reshard writing safetensors (hf-ranks rows; a megatron output is written with "
        "`torch.save`, which holds one target rank's state dict): "
        f"2 x largest tensor ({LARGEST_TENSOR / 1e6:.0f} MB) + 600 MB = "
        f"{BOUND / 1e6:.0f} MB. Throughput = source bytes / wall time (wall includes a final `sync`); "
        "each case is run `--repeat` times and the fastest run is reported (all walls in `bench/out/results.json`); "
        "peak RSS is the highest of those runs.",
        "",
        "| layout | size | case | wall s | GB/s | vs cp | peak RSS MB | in bound | cache | load 1/5/15 min | when |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["layout"] != "hf-ranks", r["size_gb"], _order(r["case"]))):
        if r.get("skipped"):
            lines.append(
                f"| {r['layout']} | {r['bytes'] / 1e9:.2f} GB | {r['case']} | skipped: {r['skipped']} "
                f"| | | | | | | {r['when']} |"
            )
            continue
        bound = "yes" if r["rss"] <= BOUND else "no"
        if r["layout"] == "megatron":  # torch.save needs one target rank's state dict: the bound is not claimed
            bound = f"n/a ({bound})"
        bound = bound if r["case"].startswith("reshard") else ""
        lines.append(
            f"| {r['layout']} | {r['bytes'] / 1e9:.2f} GB | {r['case']} | {r['wall']:.1f} | {r['gbps']:.3f} | "
            f"{r['vs_cp'] or 0:.2f} | {r['rss'] / 1e6:.0f} | {bound} | {'cold' if r['cold'] else 'warm'} "
            f"| {r['load']} | {r['when']} |"
        )
    return "\n".join(lines) + "\n"


def _order(case: str) -> int:
    return ["cp -r", "reshard 8->4", "reshard 8->1", "naive 8->4", "naive 8->1"].index(case)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4", help="comma-separated checkpoint sizes in GB (default 4)")
    parser.add_argument("--layouts", default="hf-ranks,megatron", help="hf-ranks and/or megatron")
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache between runs")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints in bench/out")
    parser.add_argument(
        "--naive-max-gb", type=float, default=4.5, help="skip the naive baseline above this size (default 4.5)"
    )
    parser.add_argument("--repeat", type=int, default=2, help="runs per case; the fastest is reported (default 2)")
    args = parser.parse_args(argv)
    OUT.mkdir(exist_ok=True)
    notes = []
    cold = not args.warm
    if cold:
        why = drop_caches()
        if why:
            notes.append(why)
            cold = False
    rows = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else []
    for size in (float(s) for s in args.sizes.split(",")):
        for layout in args.layouts.split(","):
            new = run_size(size, layout, cold, args.repeat, args.naive_max_gb)
            keys = {(r["layout"], r["size_gb"], r["case"]) for r in new}
            rows = [r for r in rows if (r["layout"], r["size_gb"], r["case"]) not in keys] + new
            RESULTS_JSON.write_text(json.dumps(rows, indent=1))
            if not args.keep:
                shutil.rmtree(OUT / f"{layout}-{size:g}g-tp8")
    notes.append("cache: cold = page cache dropped before each run; warm = source possibly in the page cache")
    spread = max((max(r["walls"]) / min(r["walls"]) for r in rows if r.get("walls")), default=1.0)
    notes.append(
        "the machine may be shared: the load average at the start of each fastest run is in the table; "
        f"walls of the same command varied by up to {spread:.1f}x between runs minutes apart "
        "(see `walls` in results.json)"
    )
    RESULTS_MD.write_text(render(rows, machine(), notes) + kept_observations())
    print(f"wrote {RESULTS_MD}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
