"""Every exception reshard raises for bad input, in one module.

The library raises these; only ``cli.py`` turns them into an exit code (2) and a message on stderr.
A finding of ``verify`` or ``check`` is a result, not an exception.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


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
