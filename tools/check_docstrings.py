"""Every public name of every part (its `__all__`) has a docstring; classes' public methods too.

    python tools/check_docstrings.py      # exit 1 listing what lacks one
"""

from __future__ import annotations

import importlib
import inspect
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import parts  # noqa: E402


def missing() -> list[str]:
    out = []
    for part in parts.PARTS:
        module = importlib.import_module(f"jaxloom.{part}")
        for name in getattr(module, "__all__", ()):
            if name.startswith("_"):
                continue
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not inspect.getdoc(obj):
                out.append(f"jaxloom.{part}.{name}")
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if attr.startswith("_") or not inspect.isfunction(value) or value.__qualname__.split(".")[0] \
                            != obj.__name__:
                        continue
                    if not inspect.getdoc(value):
                        out.append(f"jaxloom.{part}.{name}.{attr}")
    return out


if __name__ == "__main__":
    gaps = missing()
    print("\n".join(gaps) or "every public name has a docstring")
    sys.exit(1 if gaps else 0)
