"""Where a conversion went: the part every report of a conversion (``convert``, ``fix``) starts with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Route:
    """Where a conversion went: the source, its layout and tp, and the output, its layout and tp."""

    source: str
    source_layout: str
    source_tp: int
    output: str
    layout: str
    tp: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
