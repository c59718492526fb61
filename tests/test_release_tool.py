"""tools/release.py: bump, check, build every wheel with hatch, install the wheels in a fresh venv."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import parts
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo(tmp_path):
    """The release metadata of the monorepo (tools, pyprojects, CHANGELOGs, versions) in a scratch copy."""
    shutil.copytree(ROOT / "tools", tmp_path / "tools", ignore=shutil.ignore_patterns("__pycache__", "bench"))
    for part in (*parts.PARTS, parts.META):
        src = parts.PACKAGES / part
        dst = tmp_path / "packages" / part
        dst.mkdir(parents=True)
        for name in ("pyproject.toml", "CHANGELOG.md"):
            shutil.copy(src / name, dst / name)
        about = parts.about_path(part)
        (tmp_path / about.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(about, tmp_path / about.relative_to(ROOT))
    return tmp_path


def release(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(root / "tools" / "release.py"), *args], capture_output=True, text=True)


def test_bump_sets_version_changelog_and_meta_pin(repo):
    old = parts.version("mesh")
    major, minor, _ = map(int, old.split("."))
    out = release(repo, "bump", "mesh", "minor", "-m", "new thing\nanother")
    assert out.returncode == 0, out.stderr
    new = f"{major}.{minor + 1}.0"
    assert out.stdout.strip() == f"mesh: {old} -> {new}"
    assert f'__version__ = "{new}"' in (repo / "packages/mesh/src/jaxloom/mesh/__about__.py").read_text()
    changelog = (repo / "packages/mesh/CHANGELOG.md").read_text()
    today = __import__("datetime").date.today().isoformat()
    assert f"## {new} — {today}\n- new thing\n- another\n\n## {old} — " in changelog  # dated, newest first
    assert f'"jaxloom-mesh=={new}"' in (repo / "packages/jaxloom/pyproject.toml").read_text()
    assert release(repo, "check").returncode == 0
    meta = release(repo, "bump", "jaxloom", "patch", "-m", f"pins jaxloom-mesh {new}")
    assert meta.returncode == 0 and release(repo, "check").returncode == 0


def test_bad_bumps_are_clear_errors_and_change_nothing(repo):
    before = (repo / "packages/mesh/CHANGELOG.md").read_text()
    cases = [
        (("bump", "mesh", "0.0.1", "-m", "x"), "is not newer than the current"),
        (("bump", "mesh", "huge", "-m", "x"), "expected major, minor, patch or a version X.Y.Z"),
        (("bump", "meshy", "patch", "-m", "x"), "unknown part 'meshy'"),
        (("bump", "mesh", "patch", "-m", " "), "a CHANGELOG message is required"),
    ]
    for args, message in cases:
        out = release(repo, *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    assert (repo / "packages/mesh/CHANGELOG.md").read_text() == before


def test_check_names_a_stale_pin_and_a_stale_changelog(repo):
    about = repo / "packages/state/src/jaxloom/state/__about__.py"
    about.write_text(about.read_text().replace(parts.version("state"), "9.9.9"))
    out = release(repo, "check")
    assert out.returncode == 1
    assert f"pins jaxloom-state=={parts.version('state')}, but the part's version is 9.9.9" in out.stdout
    assert "state: the CHANGELOG's newest entry is" in out.stdout and "but the version is 9.9.9" in out.stdout


@pytest.mark.skipif(
    importlib.util.find_spec("hatchling") is None or shutil.which("uv") is None,
    reason="hatchling and uv are installed by `nox -s tests` (meta target)",
)
def test_wheels_build_with_hatchling_and_install_into_a_clean_venv(tmp_path):
    dist = tmp_path / "dist"
    built = release(ROOT, "build", "--out", str(dist))
    assert built.returncode == 0, built.stderr
    names = sorted(w.name for w in dist.glob("*.whl"))
    assert len(names) == len(parts.PARTS) + 1
    for part in parts.PARTS:
        assert f"jaxloom_{part}-{parts.version(part)}-py3-none-any.whl" in names
    installed = release(ROOT, "check-install", "--dist", str(dist))
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout.strip() == "installed and imported: " + ", ".join(
        f"{p} {parts.version(p)}" for p in (*parts.PARTS, parts.META)
    )
    # the bundled tokenizer and corpus travel inside the data wheel
    import zipfile

    data_wheel = zipfile.ZipFile(dist / f"jaxloom_data-{parts.version('data')}-py3-none-any.whl").namelist()
    assert "jaxloom/data/bundled/corpus.jsonl" in data_wheel
    assert "jaxloom/data/bundled/tokenizer/tokenizer.json" in data_wheel
