"""The package imports cleanly: every module can be the first one imported (no import cycle hides behind import
order), and its public names stay the functions once the command modules are imported."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import importlib, pkgutil, sys
import reshard
names = [m.name for m in pkgutil.walk_packages(reshard.__path__, "reshard.")]
failed = []
for name in names:
    for loaded in [m for m in sys.modules if m == "reshard" or m.startswith("reshard.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ImportError as err:
        failed.append(f"{name}: {err}")
print(len(names))
print(failed)
"""


def test_every_module_imports_on_its_own() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    count, failed = done.stdout.strip().splitlines()
    assert int(count) > 30
    assert failed == "[]"


def test_public_names_stay_the_functions_after_their_modules_are_imported():
    """The package loads its public names lazily; importing the command modules must leave ``reshard.convert``
    & co. the functions (their modules live in ``reshard.commands``, so no name is shared)."""
    probe = (
        "import reshard, reshard.commands.check, reshard.commands.convert, reshard.commands.fix\n"
        "import reshard.commands.verify, reshard.commands.inspect\n"
        "from reshard import check, convert, fix, verify\n"
        "assert all(callable(f) for f in (check, convert, fix, verify, reshard.check, reshard.convert))\n"
        "print(sorted(type(getattr(reshard, name)).__name__ for name in reshard.__all__))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "module" not in done.stdout and "function" in done.stdout
