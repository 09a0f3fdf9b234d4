"""Docstrings say why, docs hold the numbers (issue 43): no benchmark figure, timing or before/after history in the
comments and docstrings of ``reshard/``. A measurement that justifies a choice lives in ``docs/performance.md``
("Measurements behind the code's choices"), with the command and the machine that made it; the code says why in a
line and points there. Figures go stale as the code and the machines change, and one copy in the docs is the one
that gets corrected."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "reshard"

# What a measurement looks like in prose. Sizes that are design (a 4 KB phase, 8 MB blocks, a 32 MB bound) and
# defaults (10 s) are not figures; a timing, a rate, a ratio of two runs, a machine, a profile's share are.
FIGURES = re.compile(
    "|".join(
        [
            r"\bCPU[- ](?:s|ms)\b",  # 0.46 CPU-s, 64 CPU-ms
            r"\bbench (?:VM|machine)\b",
            r"\b[KMG]i?B/s\b",  # 1.84 GB/s, 2.7 MB/s
            r"\bminor faults\b",
            r"\bpaired runs?\b|\bpairs of \d",
            r"\d ?x the (?:CPU|wall|time)\b",  # 0.85 x the CPU
            r"\d ?% of (?:the|its|a) (?:samples|CPU|wall|run)\b",
            r"\d(?:\.\d+)? ?(?:ms|ns|µs)\b",  # 14 ms, 0.7 ns
            r"\d\.\d+(?:-\d+(?:\.\d+)?)? s\b|\d-\d+ s\b|~\d+(?:\.\d+)? s\b",  # 1.6 s, 2-3 s, ~12 s (not "10 s")
            r"\bpeak(?:ed)? (?:at|of) ~?\d",
            r"\bfrom ~?\d[\d.,]* to ~?\d[\d.,]* ?[KMG]i?B\b",  # memory from ~800 to ~280 MB
            r"\bbefore[,:)].*\bnow\b",  # "8.4 CPU-s and 4.3 GB before, 0.04 CPU-s ... now"
        ]
    )
)


def prose_lines(source: str) -> list[tuple[int, str]]:
    """``(line number, text)`` of every comment and docstring line of a module's source."""
    lines: list[tuple[int, str]] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines.append((token.start[0], token.string))
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) or not body:
            continue
        first = body[0]
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            lines += [(first.lineno + i, text) for i, text in enumerate(first.value.value.splitlines())]
    return sorted(lines)


def figures_in(source: str) -> list[tuple[int, str]]:
    """The comment and docstring lines of ``source`` that quote a measurement."""
    return [(number, text.strip()) for number, text in prose_lines(source) if FIGURES.search(text)]


@pytest.mark.parametrize(
    "line",
    [
        "(4.17 GB hf-ranks tp 8 -> 4 on the 2-core bench VM: 0.46 CPU-s of faults, 1.0 of BLAKE3 and 0.36 of the check",  # noqa: E501
        "that is the difference between 0.77-0.80 and 1.84-1.90 GB/s for a cold read of 436 MB with 8 MB requests, the",  # noqa: E501
        "  string misses. About 200 files: 1-2 ms.",
        "import yaml  # here, not at the top: every command imports this module, few read a NeMo checkpoint (~14 ms)",
        "planning, with no import; this check needs transformers, whose import costs about 2.5 s of CPU, so a conversion",  # noqa: E501
        "# pieces in 1.9 s), so a hostile file costs at most ~12 s.",
        "fresh buffers: 517,000 minor faults instead of 344,000, 100 MB more memory.",
        "for both checks. A 4.17 GB tp 4 output in tmpfs: 8.4 CPU-s and 4.3 GB before, 0.04 CPU-s and no torch now.",
        "work on a loaded machine (1 thread: 0.7 ns a weight element; 2 per caller: 7-9 ns under load 10). OpenMP's",
        "bench VM: ``rwsem_spin_on_owner`` 4 % of the samples); here it sleeps.",
    ],
    ids=["CPU-s", "GB/s", "ms", "~ms", "s of CPU", "~s", "minor faults", "before-now", "ns", "% of samples"],
)
def test_the_scan_flags_a_line_the_code_once_had(line: str) -> None:
    """Lines ``reshard/`` held before issue 43, in a comment and in a docstring: each is a figure."""
    assert figures_in(f"# {line}\n") != []
    assert figures_in(f'def f():\n    """{line}"""\n') != []


@pytest.mark.parametrize(
    "line",
    [
        "is put on the 4 KB phase of the file offset it is written to, in 8 MB blocks",
        "connect and ``HF_HUB_DOWNLOAD_TIMEOUT`` seconds of silence while reading or writing (10 s each by default).",
        "cached bytes are read again from memory, not from the device (measured: docs/performance.md).",
        "MAX_FILE_BYTES = 256 << 20  # the largest tokenizer file in use is 33 MB",
    ],
    ids=["design sizes", "a default", "a pointer", "a bound"],
)
def test_the_scan_leaves_design_sizes_defaults_and_pointers_alone(line: str) -> None:
    assert figures_in(f"# {line}\n") == []


def test_the_scan_reads_comments_and_docstrings_not_code() -> None:
    """A message the code builds may name a unit; only prose is held to the rule."""
    source = 'def f(took):\n    """Why."""\n    return f"took {took:.1f} s before, 2 ms now"\n'
    assert figures_in(source) == []


def test_no_benchmark_figure_in_the_code() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, text in figures_in(path.read_text(encoding="utf-8"))
    ]
    assert found == [], "say why in one line and point to docs/performance.md, where the figure lives with its command"
