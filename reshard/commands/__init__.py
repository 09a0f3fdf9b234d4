"""Commands: what ``reshard inspect``, ``check``, ``convert``, ``fix`` and ``verify`` do, as library calls."""
