"""Every module of the package can be the first one imported: no import cycle hides behind import order."""

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
