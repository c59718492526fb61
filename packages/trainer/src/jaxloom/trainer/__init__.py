"""jaxloom.trainer — not built yet. See README.md for what it will hold."""

from .__about__ import __version__

__all__ = ["__version__"]
