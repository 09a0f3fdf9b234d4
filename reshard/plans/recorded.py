"""The plan a ``reshard.json`` recorded: every tensor read the way reshard wrote it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from reshard.manifest import Manifest
from reshard.plans.base import EMPTY_PLAN, Plan, Rule


@dataclass(frozen=True)
class RecordedPlan(Plan):
    """The partitions a ``reshard.json`` recorded, by exact tensor name; ``fallback`` for names it lacks.

    A checkpoint reshard wrote is read the way it was written, even if that took a ``--plan`` file the
    verifying user does not pass again.
    """

    recorded: dict[str, Rule] = field(default_factory=dict)
    fallback: Plan = EMPTY_PLAN

    @classmethod
    def of(cls, manifest: Manifest, *, fallback: Plan) -> RecordedPlan:
        rules = {name: Rule(f"^{re.escape(name)}$", entry.partition) for name, entry in manifest.tensors.items()}
        return cls(f"reshard.json+{fallback.name}", tuple(rules.values()), rules, fallback)

    def match(self, name: str) -> Rule | None:
        return self.recorded.get(name) or self.fallback.match(name)
