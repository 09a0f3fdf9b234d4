"""Every ``$ reshard ...`` example of README.md, run in order as a user would, prints what the README shows."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from fixtures import ROOT

README = ROOT / "README.md"


def console_runs(text: str) -> list[tuple[str, list[str]]]:
    """``(command, lines shown)`` of every ``$ `` command in the ```console blocks, in order."""
    runs = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.DOTALL):
        for run in re.split(r"^\$ ", block, flags=re.MULTILINE)[1:]:
            command, *shown = run.rstrip("\n").split("\n")
            runs.append((command, shown))
    return runs


def matches(shown: list[str], printed: list[str]) -> bool:
    """Each shown line starts the printed line at its place (white space folded); ``...`` alone skips
    lines up to the next shown line, ``...`` inside a line elides its end."""
    position = 0
    for index, want in enumerate(shown):
        if want.strip() == "...":
            following = shown[index + 1] if index + 1 < len(shown) else None
            if following is None:
                return True
            while position < len(printed) and not _line_matches(following, printed[position]):
                position += 1
            continue
        if position >= len(printed) or not _line_matches(want, printed[position]):
            return False
        position += 1
    return True


def _line_matches(want: str, got: str) -> bool:
    head = want.split("...")[0] if "..." in want else want
    return " ".join(got.split()).startswith(" ".join(head.split())) if "..." in want else got.split() == want.split()


def test_readme_examples_print_what_the_readme_shows(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sample_ckpts").symlink_to(ROOT / "sample_ckpts")
    monkeypatch.chdir(tmp_path)
    runs = console_runs(README.read_text())
    assert [shlex.split(command)[1] for command, _ in runs] == ["inspect", "check", "convert", "fix", "verify"]
    for command, shown in runs:
        result = cli(*shlex.split(command)[1:])
        assert result.exit_code in (0, 1), result.output
        printed = result.stdout.rstrip("\n").split("\n")
        assert matches(shown, printed), f"{command}\nshown:\n" + "\n".join(shown) + "\nprinted:\n" + result.stdout
