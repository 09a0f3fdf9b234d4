"""User plan files (``--plan FILE``), TOML or JSON.

```toml
name = "my-model"
extends = "llama"              # optional: a built-in plan tried after these rules
[[rules]]
pattern = 'mlp\\.fc1\\.weight$'  # regular expression searched in the tensor name
kind = "shard"                 # replicate | shard | grouped | vocab | packed | heads | replicated_heads
dim = 0
```
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from reshard.errors import ReshardError
from reshard.geometry import partition_from_dict
from reshard.plans.base import Plan, Rule
from reshard.schema import check_partition

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def load_plan_file(path: Path) -> tuple[Plan, str | None]:
    """Parse a plan file into a :class:`Plan` and the name of the built-in plan it extends, if any.

    Raises:
        ReshardError: unreadable file, or a rule with a bad pattern or partition (naming the rule).
    """
    try:
        text = path.read_text()
        data: Any = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ReshardError(f"cannot read the plan file: {str(err) or type(err).__name__}", path=path) from err
    if not isinstance(data, dict):
        raise ReshardError("a plan file holds an object with a 'rules' list", path=path)
    rules = []
    # A "rules": null raises TypeError here, not yet refused by name (left as it is).
    for i, entry in enumerate(data.get("rules", data.get("rule", []))):  # type: ignore[arg-type]
        try:
            fields = {k: v for k, v in entry.items() if k != "pattern"}
            partition = partition_from_dict(fields)
            check_partition(fields, path=path, key=f"rule {i + 1}")
            rules.append(Rule(entry["pattern"], partition))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ReshardError(f"rule {i + 1} ({entry!r}) is invalid: {err}", path=path) from err
    extends = data.get("extends")
    return Plan(str(data.get("name", path.stem)), tuple(rules)), extends
