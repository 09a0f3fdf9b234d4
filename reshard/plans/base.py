"""A plan is an ordered list of ``(name pattern, partition)`` rules: the first match wins."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from reshard.config import ModelConfig
from reshard.geometry import Partition

PartitionFactory = Callable[[ModelConfig | None], Partition]


@dataclass(frozen=True)
class Rule:
    """``pattern`` is a regular expression searched in the tensor name.

    ``partition`` is a partition, or a function of the config for partitions whose sizes come from
    the model (packed part sizes, head sizes).

    ``gathered``: the layer's output is all-gathered after it (transformers' ``colwise_gather_output``),
    so the modules after it see the full size, or its input arrives whole and the layer splits it itself
    (``rowwise_split_input``): either way no rank computes on a part of a head. ``implicit``: not a rule anyone
    wrote but a default (transformers replicates what its plan does not name); ``reshard check`` reports what it
    covers.
    """

    pattern: str
    partition: Partition | PartitionFactory
    gathered: bool = False
    implicit: bool = False
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "_regex", re.compile(self.pattern))
        except re.error as err:
            raise ValueError(f"bad rule pattern {self.pattern!r}: {err}") from err

    def matches(self, name: str) -> bool:
        return self._regex.search(name) is not None

    def resolve(self, config: ModelConfig | None) -> Partition:
        return self.partition(config) if callable(self.partition) else self.partition


@dataclass(frozen=True)
class Plan:
    """Rules for one model family (or a user's file), tried in order."""

    name: str
    rules: tuple[Rule, ...]

    def match(self, name: str) -> Rule | None:
        """The first rule whose pattern is found in ``name``, or None."""
        return next((rule for rule in self.rules if rule.matches(name)), None)

    def then(self, other: Plan) -> Plan:
        """This plan's rules first, ``other``'s after them."""
        return Plan(f"{self.name}+{other.name}", self.rules + other.rules)


EMPTY_PLAN = Plan("none", ())
