"""The documentation site builds with warnings as errors, and its API reference shows every public name."""

import importlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import parts
import pytest

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = shutil.which("mkdocs")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if MKDOCS is None:
        pytest.skip("mkdocs is installed by `nox -s tests` (meta target) and `nox -s docs`")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [MKDOCS, "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    return out


def test_every_doc_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages == set(re.findall(r":\s+(\S+\.md)\s*$", nav, re.M))


@pytest.mark.parametrize("part", parts.PARTS)
def test_api_reference_lists_every_public_name(site, part):
    html = (site / "packages" / part / "index.html").read_text()
    anchors = set(re.findall(r'id="(jaxloom\.[\w.]+)"', html))
    module = importlib.import_module(f"jaxloom.{part}")
    public = {n for n in module.__all__ if not n.startswith("_")}
    assert {f"jaxloom.{part}.{n}" for n in public} <= anchors


def test_every_install_line_of_the_readme_names_the_siblings_its_parts_need():
    """`pip install packages/mesh` failed on a fresh machine (jaxloom-core is not on an index; issue 51): each
    `pip install packages/...` line of the README names every jaxloom part its parts need (their closure, which
    `nox -s tests` installs alone in a venv of its own for each part)."""
    lines = [x for x in (ROOT / "README.md").read_text().splitlines() if x.startswith("pip install packages/")]
    assert lines, "the README shows how to install parts"
    for line in lines:
        named = re.findall(r"packages/([\w*]+)", line.split("#", 1)[0])
        if "*" in named:
            continue  # every part
        needed = {p for part in named for p in parts.closure(part)}
        assert needed <= set(named), f"{line!r} lacks {sorted(needed - set(named))}"
