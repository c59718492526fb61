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
