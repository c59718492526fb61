"""Every public name of every part (its `__all__`) has a docstring of its own that names its arguments;
classes' public methods too. The API reference (`nox -s docs`) is generated from these docstrings.

    python tools/check_docstrings.py      # exit 1 listing what lacks one

Rules: a class needs a docstring written in its body (not one inherited, nor the signature a dataclass
makes up); a function, method or class must name every parameter (`self`, `cls`, `*args`, `**kwargs`
aside) somewhere in its docstring — for a class, in its own or its `__init__`'s docstring, or, for a
field it inherits, in the parent's. Module-level constants need an attribute docstring (a string right
after the assignment), which is what the site shows.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import re
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import parts  # noqa: E402


def _own_doc(obj) -> str | None:
    """The docstring written for `obj` itself, or None."""
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        if doc and "__dataclass_fields__" in vars(obj) and doc.startswith(f"{obj.__name__}("):
            return None  # made up by @dataclass from the signature
        return inspect.cleandoc(doc) if doc else None
    return inspect.getdoc(obj)


def _class_docs(cls) -> str:
    """What may name a class's constructor arguments: its docstring, its `__init__`'s, and for inherited
    fields its parents' (inside jaxloom)."""
    docs = [_own_doc(cls) or ""]
    if "__init__" in vars(cls) and inspect.isfunction(vars(cls)["__init__"]):
        docs.append(inspect.getdoc(vars(cls)["__init__"]) or "")
    docs += [_own_doc(base) or "" for base in cls.__mro__[1:] if base.__module__.startswith("jaxloom.")]
    return "\n".join(docs)


def _unnamed(fn, doc: str) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in params
        if p.name not in ("self", "cls")
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and not re.search(rf"(?<![\w.]){re.escape(p.name)}(?!\w)", doc)
    ]


def _constant_documented(module, name: str) -> bool:
    own = [m for m in vars(module).values() if inspect.ismodule(m) and m.__name__.startswith(module.__name__ + ".")]
    for mod in (module, *own):
        try:
            tree = ast.parse(inspect.getsource(mod))
        except (OSError, TypeError):
            continue
        body = tree.body
        for stmt, after in zip(body, body[1:], strict=False):
            targets = [stmt.target] if isinstance(stmt, ast.AnnAssign) else getattr(stmt, "targets", [])
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return (
                    isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)
                )
    return False


def _check_callable(qual: str, obj, doc: str | None, out: list[str]) -> None:
    if not doc:
        out.append(f"{qual}: no docstring")
        return
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        return  # called with a value, not built from arguments
    missing = _unnamed(obj, _class_docs(obj) if inspect.isclass(obj) else doc)
    if missing:
        out.append(f"{qual}: docstring does not name {', '.join(missing)}")


def missing() -> list[str]:
    """Every public name (and public method) of every part without a docstring of its own, or whose
    docstring leaves out one of its arguments."""
    out: list[str] = []
    for part in parts.PARTS:
        out += problems(importlib.import_module(f"jaxloom.{part}"))
    return out


def problems(module) -> list[str]:
    """What `missing` reports, for the names in one module's `__all__`."""
    out: list[str] = []
    for name in getattr(module, "__all__", ()):
        if name.startswith("_"):
            continue
        obj = getattr(module, name)
        qual = f"{module.__name__}.{name}"
        if inspect.isclass(obj) or inspect.isfunction(obj):
            _check_callable(qual, obj, _own_doc(obj), out)
        elif not inspect.ismodule(obj) and not _constant_documented(module, name):
            out.append(f"{qual}: constant without an attribute docstring")
        if not inspect.isclass(obj):
            continue
        for attr, value in vars(obj).items():
            fn = value.__func__ if isinstance(value, classmethod | staticmethod) else value
            if attr.startswith("_") or not inspect.isfunction(fn) or fn.__qualname__.split(".")[0] != obj.__name__:
                continue
            _check_callable(f"{qual}.{attr}", fn, inspect.getdoc(fn), out)
    return out


if __name__ == "__main__":
    gaps = missing()
    print("\n".join(gaps) or "every public name has a docstring that names its arguments")
    sys.exit(1 if gaps else 0)
