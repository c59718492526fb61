import subprocess
import sys

import jaxloom as jl


def test_lazy_reexport_and_parts():
    import jaxloom.mesh

    assert jl.MeshConfig is jaxloom.mesh.MeshConfig
    assert jl.mesh is jaxloom.mesh
    assert "MeshConfig" in dir(jl)


def test_unknown_name_is_a_clear_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        jl.NoSuchThing  # noqa: B018


def test_import_is_cheap_and_pure():
    code = (
        "import sys, os; e = dict(os.environ); import jaxloom; "
        "assert 'jax' not in sys.modules; assert dict(os.environ) == e; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
