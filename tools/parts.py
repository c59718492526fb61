"""What the monorepo's parts are: names, versions, sibling dependencies, and the meta-package pins.

Used by noxfile.py (which venv gets which parts) and by the release tests. Run it to check the pins:
    python tools/parts.py check
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
META = "jaxloom"
# Dependency order (lower parts first).
PARTS: tuple[str, ...] = ("core", "mesh", "models", "state", "data", "generation", "trainer", "ray")
_REQ = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(\[[^\]]*\])?\s*(.*)$")


def pyproject(part: str) -> dict:
    return tomllib.loads((PACKAGES / part / "pyproject.toml").read_text())


def about_path(part: str) -> Path:
    return PACKAGES / part / "src" / "jaxloom" / ("" if part == META else part) / "__about__.py"


def version(part: str) -> str:
    text = about_path(part).read_text()
    m = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    if not m:
        raise ValueError(f'{about_path(part)}: no __version__ = "X.Y.Z" line')
    return m.group(1)


def requirements(part: str, extra: str | None = None) -> list[tuple[str, str]]:
    """`[(distribution name, version spec), ...]` of a part's runtime dependencies (or, with `extra`, of
    that optional-dependency group, e.g. "test")."""
    out = []
    project = pyproject(part)["project"]
    reqs = project.get("dependencies", []) if extra is None else project.get("optional-dependencies", {}).get(extra, [])
    for req in reqs:
        m = _REQ.match(req.split(";")[0])
        out.append((m.group(1).lower().replace("_", "-"), m.group(3).strip()))
    return out


def siblings(part: str, extra: str | None = None) -> list[str]:
    """The parts `part` declares directly (at run time, or in the optional group `extra`)."""
    return [name.removeprefix("jaxloom-") for name, _ in requirements(part, extra) if name.startswith("jaxloom-")]


def closure(part: str) -> list[str]:
    """`part` and every part it needs, in dependency order."""
    seen: set[str] = set()
    stack = [part]
    while stack:
        p = stack.pop()
        if p not in seen:
            seen.add(p)
            stack.extend(siblings(p) + siblings(p, "test"))  # a part's tests may use parts it does not import
    return [p for p in (*PARTS, META) if p in seen]


def pin_problems() -> list[str]:
    """Every disagreement between the meta-package's exact pins and the parts' versions."""
    problems = []
    pins = {name.removeprefix("jaxloom-"): spec for name, spec in requirements(META) if name.startswith("jaxloom-")}
    for part in PARTS:
        if part not in pins:
            problems.append(f"the meta-package does not pin jaxloom-{part}")
        elif pins[part] != f"=={version(part)}":
            problems.append(
                f"the meta-package pins jaxloom-{part}{pins[part]}, but the part's version is {version(part)}"
            )
    problems += [f"the meta-package pins jaxloom-{p}, which is not a part" for p in pins if p not in PARTS]
    return problems


if __name__ == "__main__":
    if sys.argv[1:] != ["check"]:
        sys.exit("usage: python tools/parts.py check")
    found = pin_problems()
    print("\n".join(found) or "pins match: " + ", ".join(f"{p} {version(p)}" for p in PARTS))
    sys.exit(1 if found else 0)
