"""Every exception reshard raises for bad input, in one module.

The library raises these; only ``cli.py`` turns them into an exit code (2) and a message on stderr.
A finding of ``verify`` or ``check`` is a result, not an exception.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# shown(): how much of an untrusted value a message may show (nodes visited, nesting, characters).
SHOWN_NODES, SHOWN_DEPTH, SHOWN_LENGTH = 200, 6, 80


def shown(value: Any, *, limit: int = SHOWN_LENGTH, as_json: bool = False) -> str:
    """``value`` for a message, bounded whatever it is: at most ``limit`` characters, :data:`SHOWN_DEPTH` levels
    and :data:`SHOWN_NODES` values visited; an integer too long to print is shown by its size, an object of
    another type by its type's name. ``repr``, ``str`` or ``json.dumps`` of an untrusted value is not: a
    reference bomb of 84 bytes (40 nested ``(x, x)``) would be walked 2^40 times, a 100,000-deep nesting raise
    ``RecursionError`` and a 5001-digit integer ``ValueError``. ``as_json`` spells values as JSON does.

    Example:
        >>> x = ()
        >>> for _ in range(40):
        ...     x = (x, x)
        >>> len(shown(x)) <= 80
        True
        >>> shown(10**5000)
        '<an integer of about 5001 digits>'
    """
    text = _shown(value, 0, [SHOWN_NODES], limit, as_json)
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def _shown(value: Any, depth: int, budget: list[int], limit: int, as_json: bool) -> str:
    budget[0] -= 1
    if budget[0] < 0:
        return "..."
    if value is None or isinstance(value, bool):
        return json.dumps(value) if as_json else repr(value)
    if isinstance(value, int):
        bits = int.bit_length(value)
        if bits > 128:  # str() of a long integer is slow, and refused past 4300 digits
            return f"<an integer of about {int(bits * 0.30103) + 1} digits>"
        return int.__repr__(value)
    if isinstance(value, float):
        return float.__repr__(value)
    if isinstance(value, str):
        head = str.__getitem__(value, slice(0, limit))
        text = json.dumps(head) if as_json else repr(head)
        return text + ("..." if len(value) > limit else "")
    if isinstance(value, (bytes, bytearray)):
        return repr(bytes(value[:limit])) + ("..." if len(value) > limit else "")
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        brackets: dict[type, tuple[str, str]] = {list: ("[", "]"), tuple: ("(", ")"), dict: ("{", "}")}
        opening, closing = brackets.get(type(value), ("{", "}"))
        if isinstance(value, list) or (as_json and isinstance(value, tuple)):
            opening, closing = "[", "]"
        if depth >= SHOWN_DEPTH:
            return f"{opening}...{closing}"
        items = value.items() if isinstance(value, dict) else value
        parts, length = [], 0
        for item in itertools.islice(items, 16):
            if isinstance(value, dict):
                key, inner = (_shown(part, depth + 1, budget, limit, as_json) for part in item)
                part = f"{key}: {inner}"
            else:
                part = _shown(item, depth + 1, budget, limit, as_json)
            parts.append(part)
            length += len(part) + 2
            if length > limit or budget[0] <= 0:
                break
        if len(parts) < len(value):
            parts.append(f"... {len(value)} items")
        comma = "," if isinstance(value, tuple) and len(value) == 1 and not as_json else ""
        return f"{opening}{', '.join(parts)}{comma}{closing}"
    return f"<{type(value).__name__}>"


class ReshardError(Exception):
    """A problem with the user's input: a file, a tensor, a shape or an option.

    Args:
        detail: what is wrong, in a few words.
        path: the file or folder concerned, if any.
        tensor: the tensor name concerned, if any.
        hint: what the user can do about it.
    """

    def __init__(
        self, detail: str, *, path: str | Path | None = None, tensor: str | None = None, hint: str | None = None
    ) -> None:
        self.detail = detail
        self.path = None if path is None else str(path)
        self.tensor = tensor
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        """``file: tensor: detail (hint)``, the form the CLI prints."""
        parts = [p for p in (self.path, self.tensor) if p]
        text = ": ".join([*parts, self.detail])
        return f"{text} ({self.hint})" if self.hint else text


class MissingRankError(ReshardError, FileNotFoundError):
    """A rank file or folder that the layout requires is absent."""


class ShapeMismatchError(ReshardError, ValueError):
    """Rank shapes that do not add up, or do not fit the config or the partition."""


class AmbiguousPartitionError(ReshardError):
    """No plan rule covers a tensor and its shapes do not tell how it was split."""


class DivergentReplicaError(ReshardError):
    """A tensor meant to be identical on every rank differs between ranks."""


class UnsafePickleError(ReshardError):
    """A torch file pickles an object outside the allow-list and ``--trust-pickle`` was not given."""


class CorruptFileError(ReshardError):
    """A file that cannot be read as what it claims to be (truncated safetensors, bad index)."""


class NoModelError(ReshardError):
    """A checkpoint that holds no model tensors, only training state (an optimizer's folder, ...)."""


class OutputExistsError(ReshardError, FileExistsError):
    """The output path exists and is not empty, and ``--overwrite`` was not given."""


class HubError(ReshardError):
    """A Hub repo, revision or file that cannot be had: unknown, gated or private without a token, missing at
    that revision, not in the cache offline, or a push the Hub refused."""


class MappingError(ReshardError, ValueError):
    """Source names a mapping does not know, a fused group with a part missing, or two sources for one name."""


class PlanError(ReshardError):
    """Several problems found while planning, reported together before any byte is written."""

    def __init__(
        self, problems: Iterable[ReshardError], *, unsplit: Iterable[ReshardError] = (), summary: str | None = None
    ) -> None:
        self.problems = list(problems)
        self.unsplit = [p for p in unsplit if p in self.problems]  # those that are a tensor the tp cannot split
        # summary: the message when some problems are said together (every tensor a tp cannot split, in one line)
        lines = [p.one_line() for p in self.problems] if summary is None else [summary]
        head = lines[0] if len(lines) == 1 else f"{len(lines)} problems:\n  " + "\n  ".join(lines)
        super().__init__(head)

    def one_line(self) -> str:
        return self.detail
