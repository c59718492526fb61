"""jaxloom: train large language models in JAX, on one CPU, one GPU or a Ray cluster.

The meta-package. `import jaxloom as jl` is cheap: each part (`jl.mesh`, `jl.models`, ...) is
imported on first use, and every public name of every part is reachable here (`jl.MeshConfig`).
`jaxloom` stays a namespace: parts installed elsewhere on `sys.path` (editable installs) still import.
"""

from __future__ import annotations

import importlib
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

from .__about__ import __version__ as __version__  # noqa: E402

# Dependency order: lower parts first, so a name is looked up in the cheapest part that has it.
PARTS: tuple[str, ...] = ("core", "mesh", "models", "state", "data", "generation", "trainer", "ray")


def _part(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def __getattr__(name: str):
    if name in PARTS:
        return _part(name)
    if not name.startswith("_"):
        for part in PARTS:
            try:
                module = _part(part)
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{part}":
                    raise
                continue
            if name in getattr(module, "__all__", ()):
                value = getattr(module, name)
                globals()[name] = value  # cache: the next lookup is a plain attribute
                return value
    raise AttributeError(f"module 'jaxloom' has no attribute {name!r} (looked in parts {', '.join(PARTS)})")


def __dir__() -> list[str]:
    names = set(globals()) | set(PARTS)
    for part in PARTS:
        try:
            names.update(n for n in getattr(_part(part), "__all__", ()) if not n.startswith("_"))
        except ModuleNotFoundError:
            pass
    return sorted(names)
