"""The one place commands write to the terminal: reports on stdout (JSON or text), messages on stderr."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click


def emit_json(report: Any) -> None:
    """One JSON document on stdout."""
    click.echo(json.dumps(report.to_dict(), indent=2, default=str))


def emit(report: Any, render: Callable[[Any], str], *, as_json: bool, quiet: bool = False) -> None:
    """A command's report: JSON for machines, text for people, nothing under ``--quiet``."""
    if as_json:
        emit_json(report)
    elif not quiet:
        click.echo(render(report))


def shape_list(shapes: list[list[int]]) -> str:
    """``2 x [16, 64]`` for equal rank shapes, else each shape."""
    if len(shapes) > 1 and all(s == shapes[0] for s in shapes):
        return f"{len(shapes)} x {shapes[0]}"
    return ", ".join(str(s) for s in shapes)


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain left-aligned text table."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)
