"""Release helpers for the monorepo's parts.

    python tools/release.py bump PART LEVEL -m "what changed"   # LEVEL: major, minor, patch or X.Y.Z
    python tools/release.py check                               # pins match the parts; CHANGELOGs are current
    python tools/release.py build [--out dist]                  # every part's wheel, built by hatchling
    python tools/release.py check-install [--dist dist]         # the wheels into a fresh venv; import each part

`bump` writes the part's `__about__.py`, puts a CHANGELOG entry on top and moves the meta-package's pin;
bump the meta-package too (`bump jaxloom patch -m ...`) once the set of pins is final.
"""

from __future__ import annotations

import argparse
import json
import datetime
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parts  # noqa: E402

ALL = (*parts.PARTS, parts.META)
_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


def next_version(current: str, level: str) -> str:
    """`level` applied to `current` (both `X.Y.Z`); an explicit `X.Y.Z` must be newer."""
    now = _VERSION.match(current)
    if not now:
        raise ValueError(f"current version {current!r} is not X.Y.Z")
    major, minor, patch = map(int, now.groups())
    if level == "major":
        return f"{major + 1}.0.0"
    if level == "minor":
        return f"{major}.{minor + 1}.0"
    if level == "patch":
        return f"{major}.{minor}.{patch + 1}"
    new = _VERSION.match(level)
    if not new:
        raise ValueError(f"level {level!r}; expected major, minor, patch or a version X.Y.Z")
    if tuple(map(int, new.groups())) <= (major, minor, patch):
        raise ValueError(f"version {level} is not newer than the current {current}")
    return level


def bump(part: str, level: str, message: str) -> str:
    """Set `part`'s version, add a CHANGELOG entry with `message`, update the meta-package's pin."""
    if part not in ALL:
        raise ValueError(f"unknown part {part!r}; expected one of {', '.join(ALL)}")
    if not message.strip():
        raise ValueError("a CHANGELOG message is required (-m 'what changed')")
    old = parts.version(part)
    new = next_version(old, level)
    about = parts.about_path(part)
    about.write_text(about.read_text().replace(f'__version__ = "{old}"', f'__version__ = "{new}"'))
    changelog = parts.PACKAGES / part / "CHANGELOG.md"
    text = changelog.read_text()
    entry = f"## {new} — {datetime.date.today().isoformat()}\n" + "".join(
        f"- {line.strip()}\n" for line in message.strip().splitlines() if line.strip()
    )
    first = re.search(r"^## ", text, re.M)
    text = text[: first.start()] + entry + "\n" + text[first.start() :] if first else text.rstrip() + "\n\n" + entry
    changelog.write_text(text)
    if part != parts.META:
        meta = parts.PACKAGES / parts.META / "pyproject.toml"
        pinned = re.sub(rf'"jaxloom-{part}==[^"]+"', f'"jaxloom-{part}=={new}"', meta.read_text())
        meta.write_text(pinned)
    return new


def problems() -> list[str]:
    """Pins that disagree with versions, and CHANGELOGs whose newest entry is not the version."""
    out = parts.pin_problems()
    for part in ALL:
        top = re.search(r"^## (\S+)", (parts.PACKAGES / part / "CHANGELOG.md").read_text(), re.M)
        if not top or top.group(1) != parts.version(part):
            out.append(
                f"{part}: the CHANGELOG's newest entry is {top.group(1) if top else 'missing'}, "
                f"but the version is {parts.version(part)}"
            )
    return out


def build(out: Path) -> list[Path]:
    """Build one wheel per part into `out` (emptied first) with hatchling, hatch's build backend, run in
    this environment (`python -m hatchling build`): no isolated build env, nothing written outside `out`."""
    try:
        import hatchling  # noqa: F401
    except ImportError:
        raise RuntimeError("hatchling is not installed: pip install hatchling (or hatch)") from None
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for part in ALL:
        proc = subprocess.run(
            [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(out.resolve())],
            cwd=parts.PACKAGES / part,
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(f"building {part}'s wheel failed:\n{proc.stderr[-2000:]}")
    wheels = sorted(out.glob("*.whl"))
    names = {w.name.split("-")[0] for w in wheels}
    missing = [p for p in ALL if (p if p == parts.META else f"jaxloom_{p}") not in names]
    if missing:
        raise RuntimeError(f"no wheel was built for {missing} in {out}")
    return wheels


_PROBE = """
import importlib, json, sys
parts = json.loads(sys.argv[1])
out = {}
for p in parts:
    name = "jaxloom" if p == "jaxloom" else "jaxloom." + p
    module = importlib.import_module(name)
    about = importlib.import_module(name + ".__about__")
    out[p] = {"version": about.__version__, "file": module.__file__, "public": len(getattr(module, "__all__", ()))}
import jaxloom as jl
out["_lookup"] = jl.MeshConfig.__module__
print(json.dumps(out))
"""


def check_install(dist: Path, venv: Path | None = None) -> dict:
    """Install every wheel in `dist` into a fresh venv (third-party packages from the index) and import
    each part there. Returns what the venv reported; raises naming any part that is missing, has another
    version than the source tree, or was imported from outside the venv."""
    wheels = sorted(dist.glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no wheels in {dist}; run `python tools/release.py build` first")
    with tempfile.TemporaryDirectory(prefix="jaxloom-release-") as tmp:
        venv = venv or Path(tmp) / "venv"
        uv = shutil.which("uv")
        if uv:
            subprocess.run([uv, "venv", "-q", "-p", sys.executable, str(venv)], check=True)
            python = venv / "bin" / "python"
            subprocess.run([uv, "pip", "install", "-q", "--python", str(python), *map(str, wheels)], check=True)
        else:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            python = venv / "bin" / "python"
            subprocess.run([str(python), "-m", "pip", "install", "-q", *map(str, wheels)], check=True)
        probe = subprocess.run(
            [str(python), "-c", _PROBE, json.dumps(list(ALL))], capture_output=True, text=True, cwd=tmp
        )
        if probe.returncode:
            raise RuntimeError(f"importing the installed wheels failed:\n{probe.stderr[-2000:]}")
        report = json.loads(probe.stdout.strip().splitlines()[-1])
        bad = [
            f"{p}: version {report[p]['version']}, source tree {parts.version(p)}"
            for p in ALL
            if report[p]["version"] != parts.version(p)
        ]
        bad += [
            f"{p}: imported from {report[p]['file']}, outside the venv"
            for p in ALL
            if not report[p]["file"].startswith(str(venv))
        ]
        if bad:
            raise RuntimeError("the installed wheels are not the source tree's parts: " + "; ".join(bad))
        return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="release.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bump", help="set a part's version, CHANGELOG entry and meta pin")
    b.add_argument("part")
    b.add_argument("level", help="major, minor, patch or X.Y.Z")
    b.add_argument("-m", "--message", required=True)
    sub.add_parser("check", help="pins and CHANGELOGs agree with the versions")
    bd = sub.add_parser("build", help="build every wheel with hatchling")
    bd.add_argument("--out", type=Path, default=parts.ROOT / "dist")
    ci = sub.add_parser("check-install", help="install the wheels into a fresh venv and import every part")
    ci.add_argument("--dist", type=Path, default=parts.ROOT / "dist")
    a = p.parse_args(argv)
    try:
        if a.command == "bump":
            old = parts.version(a.part) if a.part in ALL else None
            print(f"{a.part}: {old} -> {bump(a.part, a.level, a.message)}")
        elif a.command == "check":
            found = problems()
            print(
                "\n".join(found)
                or "release check: pins and CHANGELOGs match " + ", ".join(f"{x} {parts.version(x)}" for x in ALL)
            )
            return 1 if found else 0
        elif a.command == "build":
            print("\n".join(str(w) for w in build(a.out)))
        else:
            report = check_install(a.dist)
            print("installed and imported: " + ", ".join(f"{x} {report[x]['version']}" for x in ALL))
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"release.py {a.command}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
