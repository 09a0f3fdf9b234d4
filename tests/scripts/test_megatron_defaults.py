"""``scripts/megatron_defaults.py`` writes ``reshard/megatron/defaults.py``, the module the argument table reads, and
that module has the form the script gives it (its header, arguments in order, at most one default per release).

The values themselves come from Megatron-LM's git history, which the tests do not have: they are spot-checked
against Megatron-LM's source in ``tests/megatron/test_megatron_args.py`` (``test_the_defaults_are_megatron_lms``)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from reshard.megatron import defaults

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "megatron_defaults.py"


def _script():
    spec = importlib.util.spec_from_file_location("megatron_defaults_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_writes_the_module_reshard_reads() -> None:
    assert _script().OUT == Path(defaults.__file__).resolve()


def test_the_module_has_the_form_the_script_writes() -> None:
    """Rendered again from its own table (release i given each argument's i-th recorded default, or its last), the
    module is what the script writes, up to formatting (``ruff format`` rewrites its quotes)."""
    script = _script()
    per_tag = {
        tag: {name: values[min(i, len(values) - 1)] for name, values in defaults.DEFAULTS.items()}
        for i, tag in enumerate(defaults.RELEASES)
    }
    assert ast.dump(ast.parse(script.render(per_tag))) == ast.dump(ast.parse(script.OUT.read_text()))
