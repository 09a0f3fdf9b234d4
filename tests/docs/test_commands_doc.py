"""The ``reshard verify`` examples of docs/commands.md, run as written, print what the page shows."""

from __future__ import annotations

import re
import shlex

import pytest
from fixtures import ROOT

COMMANDS_DOC = ROOT / "docs" / "commands.md"


def test_verify_console_matches(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``$ reshard verify`` in docs/commands.md prints what it shows (``...`` elides the rest of a line)."""
    monkeypatch.chdir(ROOT)
    section = COMMANDS_DOC.read_text().split("## `reshard verify`", 1)[1]
    [console] = re.findall(r"```console\n(.*?)```", section.split("\n## ", 1)[0], flags=re.DOTALL)
    runs = re.split(r"^\$ ", console, flags=re.MULTILINE)[1:]
    assert len(runs) == 2
    for run in runs:
        command, *shown = run.rstrip("\n").split("\n")
        result = cli(*shlex.split(command)[1:])
        assert result.exit_code == (0 if shown[-1].endswith(": OK") else 1)
        actual = result.stdout.rstrip("\n").split("\n")
        assert actual[-1] == shown[-1]
        for want, got in zip(shown[:-1], actual, strict=False):
            if want == "...":
                break
            head = want.split("...")[0] if "..." in want else want
            assert " ".join(got.split()).startswith(" ".join(head.split())), (want, got)
