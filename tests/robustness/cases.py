"""The corpus's cases: a damaged copy of a base checkpoint (``bases.py``), the fragments its error must name (the
damaged file, and the tensor or key where there is one) and the exit code of every command that differs from 2:
``inspect`` and ``check`` read headers only, so damage inside tensor bytes is theirs to miss (exit 0; ``inspect``
also reports a tensor it cannot plan, with exit 0), and ``verify`` reports a finding (exit 1) where the files are
there but do not match their ``reshard.json``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

Damage = Callable[[Path, Path], None]  # (checkpoint folder, marker a payload would create)


@dataclass(frozen=True)
class Case:
    name: str
    base: str
    damage: Damage = field(repr=False)
    names: tuple[str, ...]
    exits: dict[str, int] = field(default_factory=dict)
    several: bool = False  # a list of problems ("N problems:") is the expected error

    def exit_code(self, command: str) -> int:
        return self.exits.get(command, 2)


CASES: list[Case] = []


def case(name: str, base: str, *names: str, several: bool = False, **exits: int) -> Callable[[Damage], Damage]:
    def register(damage: Damage) -> Damage:
        CASES.append(Case(name, base, damage, names, exits, several))
        return damage

    return register
