"""reshard's version, in a module of its own: the manifest and the model card stamp it without importing the
package's public surface (which imports them)."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's version
