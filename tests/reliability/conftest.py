import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))  # helpers beside the tests (importlib import mode)


import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The worker's uninterrupted run (faultrun.TINY): the final parameters every faulted run must reach."""
    from faultrun import run_worker

    out = tmp_path_factory.mktemp("ref")
    proc, lines, err = run_worker(out)
    assert proc.returncode == 0, err[-3000:]
    return np.load(out / "final.npz")
