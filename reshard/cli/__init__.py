"""The ``reshard`` command line (click): the commands, their text rendering and the one output sink."""

from reshard.cli.main import main, run

__all__ = ["main", "run"]
