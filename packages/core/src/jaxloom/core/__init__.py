"""jaxloom.core: what every part shares and nothing else — the config schema (`jaxloom.core.schema`: how
configs are checked) and the path layer (`jaxloom.core.paths`: local paths and object-store URIs)."""

from . import paths, schema
from .__about__ import __version__
from .schema import NonNegativeInt, PositiveFloat, PositiveInt, config, explain_validation_error, is_config

__all__ = [
    "NonNegativeInt",
    "PositiveFloat",
    "PositiveInt",
    "__version__",
    "config",
    "explain_validation_error",
    "is_config",
    "paths",
    "schema",
]
