"""jaxloom.core: what every part shares and nothing else — the config schema (`jaxloom.core.schema`: how
configs are checked), the path layer (`jaxloom.core.paths`: local paths and object-store URIs) and the host
process's memory (`jaxloom.core.host`: huge pages for XLA's per-step CPU buffers)."""

from . import host, paths, schema
from .__about__ import __version__
from .schema import NonNegativeInt, PositiveFloat, PositiveInt, explain_validation_error, is_config
from .schema import config as config

# `config` (the class decorator) is importable here and documented in `jaxloom.core.schema`; it is not listed in
# `__all__`: to type checkers it is `dataclasses.dataclass`, so the API reference renders it under schema.

__all__ = [
    "NonNegativeInt",
    "PositiveFloat",
    "PositiveInt",
    "__version__",
    "explain_validation_error",
    "host",
    "is_config",
    "paths",
    "schema",
]
