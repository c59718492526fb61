import subprocess
import sys

import jaxloom.mesh as jm

CHECK = """
import os, sys
before = dict(os.environ)
import jaxloom.mesh
from jax._src import xla_bridge
assert dict(os.environ) == before, 'import changed the environment'
assert not xla_bridge.backends_are_initialized(), 'import started a JAX backend'
assert 'jax._src.distributed' not in sys.modules or not __import__('jax').distributed.is_initialized()
print('ok')
"""


def test_import_has_no_side_effects():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_single_process_init_is_a_no_op():
    assert jm.init_distributed(None, 1, 0) is False
    assert jm.init_distributed() is False


def test_init_distributed_rejects_bad_arguments():
    import pytest

    with pytest.raises(ValueError, match="process_id 2 must be in"):
        jm.init_distributed("127.0.0.1:1234", 2, 2)
    with pytest.raises(ValueError, match="expected 'host:port'"):
        jm.init_distributed("localhost", 2, 0)


def test_simulate_cpu_devices_before_and_after_backend_start():
    code = (
        "import jaxloom.mesh as m, jax; m.simulate_cpu_devices(4); print(jax.device_count())\n"
        "try:\n m.simulate_cpu_devices(2)\nexcept RuntimeError as e: print('late', 'came too late' in str(e))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["4", "late", "True"]
