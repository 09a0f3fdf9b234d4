"""A mapping is a table: which source tensors become which target tensors, and by which transform.

Names are templates with ``{L}`` (a layer number) and ``{E}`` (an expert number): the entry
``Entry(("decoder.layers.{L}.mlp.linear_fc1.weight",), ("model.layers.{L}.mlp.gate_proj.weight",
"model.layers.{L}.mlp.up_proj.weight"), chunk)`` maps the SwiGLU fc1 of every layer. :meth:`Mapping.plan`
matches every source name against the table and returns the groups the engine moves together; it is
pure (names, shapes and the config in; groups out). What the table does not know is never passed through
half-mapped: a name no entry covers, a group with a part missing, or two sources for one target name is
an error naming the tensors (:class:`~reshard.errors.MappingError`). ``dropped`` names patterns known and
dropped on purpose (Transformer Engine's ``_extra_state``, rotary ``inv_freq`` buffers).

One table serves both directions: :meth:`Mapping.inverse` swaps sources and targets and inverts every
transform; entries marked ``alternative`` (another spelling of a source name, e.g. Megatron's local-spec
``input_layernorm`` beside Transformer Engine's ``linear_qkv.layer_norm_weight``) are only read, never
written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from collections.abc import Mapping as MappingType
from dataclasses import dataclass, field

from reshard.config import ModelConfig
from reshard.errors import MappingError, ReshardError, ShapeMismatchError
from reshard.mappings.transforms import Invertible, Rename

Shape = tuple[int, ...]
TransformFactory = Callable[[ModelConfig | None], Invertible]
_PLACEHOLDER = re.compile(r"\{([A-Z])\}")


def _regex(template: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(template)
    pattern = "".join(re.escape(p) if i % 2 == 0 else rf"(?P<{p}>\d+)" for i, p in enumerate(parts))
    return re.compile(f"^{pattern}$")


@dataclass(frozen=True)
class Entry:
    """One row of a mapping table: source templates -> target templates, and how the bytes change."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    transform: Invertible | TransformFactory = field(default_factory=Rename)
    alternative: bool = False

    def resolve(self, config: ModelConfig | None) -> Invertible:
        return self.transform(config) if callable(self.transform) else self.transform

    def inverse(self) -> Entry:
        def inverted(config: ModelConfig | None) -> Invertible:
            return self.resolve(config).inverse()

        return Entry(self.targets, self.sources, inverted)


def rename(source: str, target: str, *, alternative: bool = False) -> Entry:
    """A row that only renames."""
    return Entry((source,), (target,), Rename(), alternative)


@dataclass(frozen=True)
class MappedGroup:
    """Source tensors moved together and the target tensors they become (names, shapes, dtype code)."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    shapes: tuple[Shape, ...]
    transform: Invertible


@dataclass(frozen=True)
class Mapping:
    """A table of entries from one naming (``source_family``) to another (``target_family``)."""

    source_family: str
    target_family: str
    entries: tuple[Entry, ...]
    dropped: tuple[str, ...] = ()
    dropped_in_target: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.source_family} -> {self.target_family}"

    def inverse(self) -> Mapping:
        return Mapping(
            self.target_family,
            self.source_family,
            tuple(e.inverse() for e in self.entries if not e.alternative),
            self.dropped_in_target,
            self.dropped,
        )

    def plan(self, shapes: MappingType[str, Shape], config: ModelConfig | None) -> tuple[list[MappedGroup], list[str]]:
        """Group every source tensor (by name, with its canonical shape) into target tensors.

        Returns the groups and the names dropped on purpose.

        Raises:
            MappingError: names no entry covers, incomplete groups, or two sources for one target.
        """
        compiled = [[_regex(t) for t in entry.sources] for entry in self.entries]
        dropped_patterns = [re.compile(p) for p in self.dropped]
        found: dict[tuple[int, tuple[tuple[str, str], ...]], dict[int, str]] = {}
        unknown, dropped = [], []
        for name in shapes:
            if any(p.search(name) for p in dropped_patterns):
                dropped.append(name)
                continue
            hit = _match(compiled, name)
            if hit is None:
                unknown.append(name)
                continue
            index, slot, bindings = hit
            found.setdefault((index, bindings), {})[slot] = name
        problems: list[ReshardError] = []
        if unknown:
            problems.append(
                MappingError(
                    f"{len(unknown)} tensor(s) the {self.name} mapping does not know: {', '.join(unknown[:5])}"
                    + (" ..." if len(unknown) > 5 else ""),
                    tensor=unknown[0],
                    hint="keep the source's names with --keep-names, or give the model's config with --config",
                )
            )
        groups: list[MappedGroup] = []
        targets_seen: dict[str, str] = {}
        for (index, bindings), slots in found.items():
            entry = self.entries[index]
            fill = dict(bindings)
            if len(slots) != len(entry.sources):
                missing = [t.format(**fill) for i, t in enumerate(entry.sources) if i not in slots]
                problems.append(
                    MappingError(
                        f"is part of a group whose other part(s) are missing: {', '.join(missing)}",
                        tensor=next(iter(slots.values())),
                    )
                )
                continue
            sources = tuple(slots[i] for i in range(len(entry.sources)))
            targets = tuple(t.format(**fill) for t in entry.targets)
            for target in targets:
                if target in targets_seen:
                    problems.append(
                        MappingError(f"both {targets_seen[target]} and {sources[0]} map to {target}", tensor=target)
                    )
                targets_seen[target] = sources[0]
            try:
                transform = entry.resolve(config)
                target_shapes = transform.target_shapes([shapes[s] for s in sources])
            except (ShapeMismatchError, MappingError) as err:
                problems.append(MappingError(f"{err.detail}", tensor=sources[0], hint=err.hint))
                continue
            groups.append(MappedGroup(sources, targets, tuple(tuple(s) for s in target_shapes), transform))
        if problems:
            from reshard.errors import PlanError

            raise PlanError(problems)
        return groups, dropped


def _match(compiled: Sequence[Sequence[re.Pattern[str]]], name: str) -> tuple[int, int, tuple] | None:
    """The first entry and slot whose template matches ``name``, with the placeholder values."""
    for index, patterns in enumerate(compiled):
        for slot, pattern in enumerate(patterns):
            match = pattern.match(name)
            if match:
                return index, slot, tuple(sorted(match.groupdict().items()))
    return None
