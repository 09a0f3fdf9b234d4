"""``python -m reshard``: the command line, as torchrun starts it (``torchrun ... -m reshard convert ...``)."""

from reshard.cli import run

if __name__ == "__main__":
    run()
