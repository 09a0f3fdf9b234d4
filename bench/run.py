"""Benchmark ``reshard convert`` against ``cp -r`` (the disk's own speed) and a naive load-everything script.

For every ``--sizes`` GB it makes a synthetic Llama-7B-shaped tp=8 checkpoint (``make_synthetic.py``)
and measures, each in a fresh process and ``--repeat`` times round-robin (the fastest run counts):

* ``cp -r`` of the checkpoint folder,
* ``reshard convert --tp 4`` and ``--tp 1``,
* the naive baseline (``naive.py``) ``--tp 4`` and ``--tp 1`` (skipped, with the reason, when the
  machine has not enough free memory for it),

in the ``hf-ranks`` (safetensors) and ``megatron`` layouts; a ``torch_dist`` source (Megatron-Core's
format, made from the megatron one by ``reshard convert --layout torch_dist``, untimed) is converted to
``hf-ranks`` (transformers' names: the fused QKV and fc1 split) and to ``megatron`` at tp 4 and 1, against
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (PyTorch's own converter, which loads the
whole checkpoint) as the naive baseline. ``--startup`` times what every run pays before its first read:
Python, ``import torch``, and ``reshard convert`` of a 16-tensor checkpoint. Before
each measurement the page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``) when the
process may, so every run reads the checkpoint from the disk (Python and torch are then imported once,
untimed, so the tool's own code is not counted); the wall time includes a final ``sync``, so every run
has also put its output on the disk. Peak resident memory comes from ``/usr/bin/time -v`` (or
``getrusage`` of a fresh child), and so do the CPU seconds (user + system) of each run. ``--tmpfs`` runs the
same cases with the checkpoint and the outputs in memory (under ``/dev/shm``; no page cache to drop, no naive
baseline): what is left is reshard's own CPU cost per byte, against ``cp -r``'s. Rows, each with the commit it
measured, accumulate in ``bench/results.json`` (tracked, so sizes can be run at different times and by different
clones; a skipped case keeps the row measured before) and ``bench/RESULTS.md`` is rewritten from all of them, its
hand-written sections kept (``--render`` rewrites it alone, measuring nothing).

Examples:
    python bench/run.py --sizes 2
    python bench/run.py --sizes 4 --layouts hf-ranks,megatron
    python bench/run.py --sizes 2 --layouts torch_dist
    python bench/run.py --startup
    python bench/run.py --sizes 4 --layouts hf-ranks --tmpfs --repeat 5
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
# Tracked beside RESULTS.md: a fresh clone re-renders every row measured so far, not only its own.
RESULTS_JSON = HERE / "results.json"
STARTUP_JSON = HERE / "startup.json"
RESULTS_MD = HERE / "RESULTS.md"
HAND_WRITTEN = re.compile(r"^## (Observations|.*hand-written)", re.MULTILINE)
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
    """Run ``command`` in a fresh process (plus ``sync``); wall seconds, CPU seconds (user + system, with
    ``/usr/bin/time``), peak RSS bytes, exit code."""
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
        text = stats.read_text()
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
        rss = int(match.group(1)) * 1024 if match else None
        times = re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", text)
        cpu = sum(float(t) for t in times) if len(times) == 2 else None
    else:
        probe = (
            "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]).returncode; "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r)"
        )
        proc = subprocess.run([python(), "-c", probe, *command], capture_output=True, text=True)
        os.sync()
        wall = time.perf_counter() - started
        rss = int(proc.stdout.split()[-1]) * 1024 if proc.stdout.split() else None
        cpu = None
    return {"wall": wall, "cpu": cpu, "rss": rss, "rc": proc.returncode, "stderr": proc.stderr[-2000:], "load": before}


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


Case = tuple[str, list[str] | None, str | None]  # name, command, the reason it is skipped


def cases(src: Path, layout: str, naive_max_gb: float, workers: int = 1, *, tmpfs: bool = False) -> list[Case]:
    out = output_folder()
    rows: list[Case] = [("cp -r", ["cp", "-r", str(src), str(out)], None)]
    unreadable = can_read(src)
    targets = TORCH_DIST_TARGETS if layout == "torch_dist" else [(f"8->{tp}", tp, None) for tp in (4, 1)]
    for label, tp, target_layout in targets:
        command = [*reshard(), "convert", str(src), "--tp", str(tp), "-o", str(out), "-q"]
        command += ["--layout", target_layout] if target_layout else []
        why = unreadable and f"reshard: {unreadable}"
        rows.append((f"reshard {label}", None if unreadable else command, why))
        if workers > 1 and layout != "torch_dist":  # the same conversion by several processes (peak RSS: per worker)
            shared = [*command, "--workers", str(workers)]
            rows.append((f"reshard {label} {workers} workers", None if unreadable else shared, why))
    size = folder_bytes(src)
    need = int(2.3 * size) + 2 * 10**9  # the model, one target rank, the bytes objects save_file makes
    reason = None
    if tmpfs:
        reason = "not run with --tmpfs"
    elif size > naive_max_gb * 1e9:
        reason = f"above --naive-max-gb {naive_max_gb:g} (it needs ~{need / 1e9:.0f} GB of memory)"
    elif need > mem_available():
        reason = f"needs ~{need / 1e9:.0f} GB free, {mem_available() / 1e9:.0f} GB available"
    if layout == "torch_dist":
        dcp = (
            "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            "dcp_to_torch_save(sys.argv[1], sys.argv[2])"
        )
        folder = next(src.glob("iter_*"))
        rows.append(("dcp_to_torch_save", [python(), "-c", dcp, str(folder), str(out)], reason))
        return rows
    naive = [python(), str(HERE / "naive.py"), str(src)]
    for tp in (4, 1):
        rows.append((f"naive 8->{tp}", [*naive, str(out), "--tp", str(tp), "--layout", layout], reason))
    return rows


# what a torch_dist checkpoint (global tensors) is converted to: a transformers tp 4 and Megatron tp 4 and 1
TORCH_DIST_TARGETS = [
    ("-> hf-ranks 4", 4, "hf-ranks"),
    ("-> megatron 4", 4, "megatron"),
    ("-> megatron 1", 1, "megatron"),
]


def make_source(src: Path, size_gb: float, layout: str) -> None:
    """The synthetic checkpoint (``make_synthetic.py``); a torch_dist one converted from the megatron one."""
    made = src.with_name(src.name + "-megatron") if layout == "torch_dist" else src
    synthetic = [python(), str(HERE / "make_synthetic.py"), str(made), "--size-gb", str(size_gb)]
    subprocess.run([*synthetic, "--layout", "megatron" if layout == "torch_dist" else layout], check=True)
    if made != src:
        to_torch_dist = [*reshard(), "convert", str(made), "--layout", "torch_dist", "--tp", "8", "-o", str(src), "-q"]
        subprocess.run(to_torch_dist, check=True)
        shutil.rmtree(made)


# Where checkpoints and outputs go: bench/out on the disk, or a folder in memory with --tmpfs.
WORK = [OUT]


def output_folder() -> Path:
    return WORK[0] / "run-output"


def remove_output() -> None:
    """Delete the last output: a folder, or the one file ``dcp_to_torch_save`` writes."""
    out = output_folder()
    if out.is_dir():
        shutil.rmtree(out)
    out.unlink(missing_ok=True)


def clear_output() -> None:
    """Delete the last output and let the file system settle (the disk is mounted with online discard)."""
    remove_output()
    os.sync()
    time.sleep(2)


def run_size(
    size_gb: float, layout: str, cold: bool, repeat: int, naive_max_gb: float, workers: int = 1, *, tmpfs: bool = False
) -> list[dict]:
    """Every case ``repeat`` times, round-robin (so each sees the same conditions); the fastest run of each, and
    the medians of every run's wall and CPU time."""
    src = WORK[0] / f"{layout}-{size_gb:g}g-tp8"
    if not src.exists():
        make_source(src, size_gb, layout)
    size = folder_bytes(src)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = code_commit()
    todo = cases(src, layout, naive_max_gb, workers, tmpfs=tmpfs)
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in todo}
    for _ in range(repeat):
        for name, command, reason in todo:
            if reason or (runs[name] and runs[name][-1]["rc"]):
                continue
            clear_output()
            runs[name].append(measure(command, cold=cold))
    clear_output()
    rows = []
    cp_wall = cp_median = None
    for name, _, reason in todo:
        row = {"layout": layout, "size_gb": size_gb, "bytes": size, "case": name, "when": when, "cold": cold}
        row["storage"] = "tmpfs" if tmpfs else "disk"
        row["commit"] = commit
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
                "median_wall": median([r["wall"] for r in runs[name]]),
                "cpus": [round(r["cpu"], 2) for r in runs[name] if r.get("cpu") is not None],
            }
            row["median_cpu"] = median(row["cpus"]) if row["cpus"] else None
            cp_wall = best["wall"] if name == "cp -r" else cp_wall
            cp_median = row["median_wall"] if name == "cp -r" else cp_median
            row["gbps"] = size / best["wall"] / 1e9
            row["vs_cp"] = cp_wall / best["wall"] if cp_wall else None
            row["median_vs_cp"] = cp_median / row["median_wall"] if cp_median else None
            print(
                f"{layout} {size / 1e9:.2f} GB {name:14s} {best['wall']:7.1f} s {row['gbps']:6.3f} GB/s "
                f"x{row['vs_cp'] or 0:.2f} of cp (medians x{row['median_vs_cp'] or 0:.2f})  "
                f"CPU {row['median_cpu'] or 0:.2f} s ({(row['median_cpu'] or 0) / (size / 1e9):.2f} s/GB)  "
                f"peak RSS {row['rss'] / 1e6:7.0f} MB  walls {row['walls']} (load {best['load']})",
                flush=True,
            )
        rows.append(row)
    return rows


STARTUP_CASES = {
    "python -c pass": [python(), "-c", "pass"],
    "python -c 'import torch'": [python(), "-c", "import torch"],
    "reshard --version": [*reshard(), "--version"],
    "reshard convert, 16 tensors": [
        *reshard(),
        *("convert", str(HERE.parent / "sample_ckpts" / "tiny-llama-tp2"), "--tp", "4", "-q"),
        *("-o", str(OUT / "run-output")),
    ],
}


def run_startup(repeat: int) -> list[dict]:
    """What every run pays before its first read, each case ``repeat`` times round-robin (warm page cache)."""
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = code_commit()
    walls: dict[str, list[float]] = {name: [] for name in STARTUP_CASES}
    for _ in range(repeat):
        for name, command in STARTUP_CASES.items():
            remove_output()
            started = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            walls[name].append(time.perf_counter() - started)
    remove_output()
    rows = []
    for name, runs in walls.items():
        runs.sort()
        row = {"case": name, "when": when, "commit": commit, "load": load(), "walls": [round(w, 3) for w in runs]}
        row |= {"best": runs[0], "median": runs[len(runs) // 2]}
        rows.append(row)
        print(f"startup {name:32s} best {runs[0]:.3f} s median {row['median']:.3f} s", flush=True)
    return rows


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def code_commit() -> str:
    """The commit the measured code is at, ``+changes`` when reshard's code differs from it (RESULTS.md and the
    rest of bench/ do not count); ``unknown`` outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--", "reshard", "pyproject.toml") else "")


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
    """The hand-written sections of the current RESULTS.md (from the first heading saying ``hand-written``, or
    ``## Observations``, to the end), kept across rewrites."""
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else ""
    found = HAND_WRITTEN.search(text)
    return "\n" + text[found.start() :] if found else ""


def render(rows: list[dict], startup: list[dict], info: dict, notes: list[str]) -> str:
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
        "Peak RSS bound for reshard, every layout and tp: "
        f"2 x largest tensor ({LARGEST_TENSOR / 1e6:.0f} MB) + 600 MB = "
        f"{BOUND / 1e6:.0f} MB. Throughput = source bytes / wall time (wall includes a final `sync`); "
        "each case is run `--repeat` times and the fastest run is reported (every run's wall in `all walls`, in "
        "the order they ran); "
        "peak RSS is the highest of those runs.",
        "",
        "| layout | storage | size | case | wall s | all walls s | GB/s | vs cp | median wall s (vs cp) "
        "| CPU s median | CPU s/GB | peak RSS MB | in bound | cache | load 1/5/15 min | when | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    layouts = ["hf-ranks", "megatron", "torch_dist"]
    storages = ["disk", "tmpfs"]
    for r in sorted(
        rows,
        key=lambda r: (
            storages.index(r.get("storage", "disk")),
            layouts.index(r["layout"]),
            r["size_gb"],
            _order(r["case"]),
        ),
    ):
        storage = r.get("storage", "disk")
        if r.get("skipped"):
            lines.append(
                f"| {r['layout']} | {storage} | {r['bytes'] / 1e9:.2f} GB | {r['case']} | skipped: {r['skipped']} "
                f"| | | | | | | | | | | {r['when']} | {r.get('commit', '')} |"
            )
            continue
        bound = ("yes" if r["rss"] <= BOUND else "no") if r["case"].startswith("reshard") else ""
        medians = f"{r['median_wall']:.2f} ({r['median_vs_cp'] or 0:.2f})" if r.get("median_wall") else ""
        cpu = r.get("median_cpu")
        per_gb = "" if cpu is None else f"{cpu / (r['bytes'] / 1e9):.2f}"
        lines.append(
            f"| {r['layout']} | {storage} | {r['bytes'] / 1e9:.2f} GB | {r['case']} | {r['wall']:.1f} | "
            f"{', '.join(f'{w:.1f}' for w in r['walls'])} | {r['gbps']:.3f} | {r['vs_cp'] or 0:.2f} | {medians} | "
            f"{'' if cpu is None else f'{cpu:.2f}'} | {per_gb} | "
            f"{r['rss'] / 1e6:.0f} | {bound} | {'cold' if r['cold'] else 'warm'} "
            f"| {r['load']} | {r['when']} | {r.get('commit', '')} |"
        )
    if startup:
        lines += [
            "",
            "## Start-up",
            "",
            "What every run pays before its first read (warm page cache; each case run round-robin, `walls` sorted).",
            "",
            "| case | best s | median s | walls | load 1/5/15 min | when | commit |",
            "|---|---|---|---|---|---|---|",
            *[
                f"| {r['case']} | {r['best']:.3f} | {r['median']:.3f} | {r['walls']} | {r['load']} | {r['when']} "
                f"| {r.get('commit', '')} |"
                for r in startup
            ],
        ]
    return "\n".join(lines) + "\n"


def _key(row: dict) -> tuple:
    return row["layout"], row.get("storage", "disk"), row["size_gb"], row["case"]


def _order(case: str) -> int:
    order = ["cp -r", "reshard 8->4", "reshard 8->1", *(f"reshard {label}" for label, _, _ in TORCH_DIST_TARGETS)]
    order += [f"reshard 8->{tp} {workers} workers" for tp in (4, 1) for workers in range(2, 65)]
    order += ["naive 8->4", "naive 8->1", "dcp_to_torch_save"]
    return order.index(case)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4", help="comma-separated checkpoint sizes in GB (default 4)")
    parser.add_argument("--layouts", default="hf-ranks,megatron", help="hf-ranks, megatron and/or torch_dist")
    parser.add_argument("--startup", action="store_true", help="time the start-up only (no checkpoint)")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite RESULTS.md from bench/out/*.json (measure nothing)"
    )
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache between runs")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints in bench/out")
    parser.add_argument(
        "--naive-max-gb", type=float, default=4.5, help="skip the naive baseline above this size (default 4.5)"
    )
    parser.add_argument("--repeat", type=int, default=2, help="runs per case; the fastest is reported (default 2)")
    parser.add_argument(
        "--workers", type=int, default=1, help="also time each reshard case with this many processes (--workers)"
    )
    parser.add_argument(
        "--tmpfs",
        nargs="?",
        const="/dev/shm",
        metavar="DIR",
        help="checkpoints and outputs in memory, in a folder under DIR (default /dev/shm); no naive baseline",
    )
    args = parser.parse_args(argv)
    OUT.mkdir(exist_ok=True)
    if args.tmpfs:
        WORK[0] = Path(args.tmpfs) / "reshard-bench"
        WORK[0].mkdir(exist_ok=True)
    notes = []
    cold = not (args.warm or args.tmpfs)
    if cold and not args.render:
        why = drop_caches()
        if why:
            notes.append(why)
            cold = False
    rows = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else []
    startup = json.loads(STARTUP_JSON.read_text()) if STARTUP_JSON.exists() else []
    if args.startup:
        startup = run_startup(max(args.repeat, 5))
        STARTUP_JSON.write_text(json.dumps(startup, indent=1))
    for size in () if args.startup or args.render else (float(s) for s in args.sizes.split(",")):
        for layout in args.layouts.split(","):
            new = run_size(size, layout, cold, args.repeat, args.naive_max_gb, args.workers, tmpfs=bool(args.tmpfs))
            measured = {_key(r) for r in rows if not r.get("skipped")}
            new = [r for r in new if not (r.get("skipped") and _key(r) in measured)]  # a skip keeps a measured row
            keys = {_key(r) for r in new}
            rows = [r for r in rows if _key(r) not in keys] + new
            RESULTS_JSON.write_text(json.dumps(rows, indent=1))
            if not args.keep:
                shutil.rmtree(WORK[0] / f"{layout}-{size:g}g-tp8")
    if args.tmpfs and not args.keep:
        shutil.rmtree(WORK[0], ignore_errors=True)
    notes.append("cache: cold = page cache dropped before each run; warm = source possibly in the page cache")
    notes.append(
        "storage: disk = bench/out on the disk above; tmpfs = checkpoint and output in memory (`--tmpfs`); CPU s = "
        "user + system seconds of the whole command (/usr/bin/time), the median of its runs"
    )
    spread = max((max(r["walls"]) / min(r["walls"]) for r in rows if r.get("walls")), default=1.0)
    notes.append(
        "the machine may be shared: the load average at the start of each fastest run is in the table; "
        f"walls of the same command varied by up to {spread:.1f}x between runs minutes apart "
        "(see `walls` in results.json)"
    )
    RESULTS_MD.write_text(render(rows, startup, machine(), notes) + kept_observations())
    print(f"wrote {RESULTS_MD}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
