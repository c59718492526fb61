"""`jaxloom` is one namespace over many distributions: check it in real, fresh venvs."""

import subprocess
import sys

import parts
import pytest


def test_meta_gives_every_part_in_this_install():
    import jaxloom as jl

    for p in parts.PARTS:
        assert getattr(jl, p).__version__ == parts.version(p)
    assert jl.__version__ == parts.version(parts.META)
    assert jl.MeshConfig.__module__ == "jaxloom.mesh.config"


def test_parts_export_no_clashing_names():
    import importlib

    owner = {}
    for p in parts.PARTS:
        for name in importlib.import_module(f"jaxloom.{p}").__all__:
            if not name.startswith("_"):
                assert name not in owner, f"{name} is exported by both {owner.get(name)} and {p}"
                owner[name] = p


def uv(*args, **kw):
    return subprocess.run([sys.executable, "-m", "uv", *args], capture_output=True, text=True, timeout=600, **kw)


def fresh_venv(tmp_path, *install):
    venv = tmp_path / "venv"
    assert uv("venv", "-q", "-p", sys.executable, str(venv)).returncode == 0
    py = venv / "bin" / "python"
    r = uv("pip", "install", "-q", "--python", str(py), *install)
    assert r.returncode == 0, r.stderr[-3000:]
    return py


def run(py, code):
    return subprocess.run(
        [str(py), "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.slow
def test_mesh_alone(tmp_path):
    """The mesh part with what it declares (jaxloom-core, from this checkout), and nothing later."""
    py = fresh_venv(tmp_path, str(parts.PACKAGES / "core"), str(parts.PACKAGES / "mesh"))
    r = run(
        py,
        "import jaxloom.mesh as m; print(m.MeshConfig.from_axes(fsdp=1).build().shape['fsdp'])\n"
        "try:\n import jaxloom.models\nexcept ModuleNotFoundError as e: print('absent', e.name)",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["1", "absent", "jaxloom.models"]


@pytest.mark.slow
def test_editable_install_keeps_the_namespace_open(tmp_path):
    """Editable installs put each part's src/ on sys.path; the meta-package's regular
    jaxloom/__init__.py must still let every part import."""
    install = [arg for p in [*parts.PARTS, parts.META] for arg in ("-e", str(parts.PACKAGES / p))]
    py = fresh_venv(tmp_path, *install)
    code = (
        "import jaxloom as jl; import jaxloom.ray, jaxloom.mesh; m = jl.MeshConfig();"
        "print(jl.mesh.__file__.count('packages/mesh/src'), jl.ray.__file__.count('packages/ray/src'))"
    )
    r = run(py, code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["1", "1"]
